"""GRPO / RLOO with a colocated vLLM under FSDP2 (--method fsdp / zero2), estimate only, as TRL 1.16 runs it
(trl/generation/vllm_generation.py): before each generation sync_weights walks the policy's parameters in module
order, each DTensor's full_tensor() an all-gather of its shards in the stored dtype, two alive at once (the loop
variable holds the previous one); vLLM then generates (no FSDP2 unit gathered); the pool sits beside it all. Sizes
by hand for tiny-llama (hidden 512, intermediate 1376, vocab 32000, 4 layers, 45,421,056 parameters, every dim 0
even: no FSDP2 padding on 2 ranks; fp32 shards under bf16-mixed) and Qwen2.5-7B's published config."""

from __future__ import annotations

import re

import pytest
from schedules import phase_events

from llmem.errors import LlmemError
from llmem.model.resolved import resolve
from llmem.setup.training import TrainingSetup

GIB = 1024**3
PARAMS = 2 * 32000 * 512 + 4 * (4 * 512 * 512 + 3 * 512 * 1376 + 2 * 512) + 512     # 45,421,056
EMBED_FP32 = 32000 * 512 * 4                     # 65,536,000 B: model.embed_tokens.weight's full_tensor
Q_PROJ_FP32 = 512 * 512 * 4                      # 1,048,576 B: the next one (layer 0's q_proj)


def _setup(method: str = "fsdp", **kw) -> TrainingSetup:
    return TrainingSetup(**{"model": "tiny-llama", "gpu": "H100-80GB", "objective": "grpo", "method": method,
                            "gpus": 2, "precision": "bf16-mixed", "optimizer": "sgd", "batch_size": 2,
                            "seq_len": 128, "num_generations": 4, "max_completion_length": 64, "use_vllm": True,
                            "vllm_max_model_length": 128, **kw})


def _sync_events(setup: TrainingSetup, phase: str = "it1:weight_sync") -> list[tuple[int, int, str]]:
    return [(sign, n, comp) for sign, _k, n, _st, comp in phase_events(setup, phase)]


@pytest.mark.parametrize("method", ["fsdp", "zero2"])
def test_the_sync_gathers_each_full_tensor_in_module_order(method):
    """Every parameter's full tensor (the unsharded numel x 4 B, fp32 shards), in module order, each freed once the
    next exists: nothing else is gathered (the policy's units are all resharded after backward, zero2 included)."""
    ev = _sync_events(_setup(method))
    gathered = [n for sign, n, comp in ev if sign > 0 and comp == "gathered_weights"]
    layer = [512 * 512 * 4] * 4 + [1376 * 512 * 4] * 3 + [512 * 4] * 2
    assert gathered == [EMBED_FP32] + layer * 4 + [512 * 4, EMBED_FP32]
    assert sum(gathered) == PARAMS * 4
    assert not [n for sign, n, comp in ev if sign > 0 and comp != "gathered_weights"]
    live = peak = 0                        # at most two at once: the embedding and layer 0's q_proj
    for sign, n, comp in ev:
        live += sign * n if comp == "gathered_weights" else 0
        peak = max(peak, live)
    assert peak == EMBED_FP32 + Q_PROJ_FP32 == 66_584_576
    assert live == 0


def test_the_sync_phase_beside_the_shards_and_the_pool():
    """The weight_sync phase's peak: this rank's fp32 shards (PARAMS / 2 x 4 B = 90,842,112), the largest pair of
    full tensors; the pool (0.3 of the device, vLLM's requested memory) is outside the trainer's capacity, and
    the trainer's generation phase holds no gathered unit."""
    from llmem.estimator.engine import estimate
    from llmem.setup.gpus import outside_allocator_bytes, resolve_gpu

    gpu = resolve_gpu("H100-80GB")
    res = estimate(_setup())
    pool = int(0.3 * gpu.memory_bytes)
    assert res.components["vllm_pool"] == pool
    assert res.capacity_bytes == gpu.memory_bytes - outside_allocator_bytes(gpu, 2) - pool
    phases = {p.name: p for p in res.phases}
    assert list(phases) == ["weight_sync", "generation", "scoring", "training"]
    sync = phases["weight_sync"].components
    assert sync["weights"] == PARAMS // 2 * 4 == 90_842_112
    assert sync["gathered_weights"] == 66_584_576
    assert "gathered_weights" not in phases["generation"].components
    assert any("weight_sync phase (FSDP2" in n and "0.06 GiB" in n for n in res.notes)
    moment = next(m for m in res.moments if m["phase"] == "weight_sync")
    assert moment["components"]["gathered_weights"] == 66_584_576


def test_sleep_mode_wakes_the_pool_beside_the_sync():
    """vllm_enable_sleep_mode: the pool is on the device only from the sync's wake-up to the end of generation;
    there it stands beside the trainer's live tensors at the sync's peak (the larger of the two phases)."""
    from llmem.estimator.engine import estimate

    asleep = estimate(_setup(vllm_enable_sleep_mode=True))
    phases = {p.name: p for p in asleep.phases}
    held = phases["weight_sync"].allocated_bytes
    assert held > phases["generation"].allocated_bytes
    pool = int(0.3 * asleep.gpu_memory_bytes)
    assert asleep.components["vllm_pool"] == max(0, held + pool - asleep.reserved_on_device_bytes)


def test_qwen_7b_sync_pair_by_hand():
    """Qwen2.5-7B on 8 GPUs: the embedding [152064, 3584] in fp32 (152064 / 8 and 3584 / 8 exact: no padding),
    2,179,989,504 B, then layer 0's q_proj [3584, 3584], 51,380,224 B: the largest consecutive pair (lm_head's
    neighbour is the final norm, 14,336 B)."""
    from llmem.estimator.generation import full_tensor_bytes, weight_sync_bytes

    r = resolve(TrainingSetup(model="Qwen/Qwen2.5-7B", gpu="H100-80GB", objective="grpo", method="fsdp", gpus=8,
                              batch_size=1, seq_len=2048, num_generations=8, max_completion_length=1024,
                              use_vllm=True))
    full = full_tensor_bytes(r)
    assert full[0] == full[-1] == 152064 * 3584 * 4 == 2_179_989_504
    assert full[1] == 3584 * 3584 * 4 == 51_380_224
    assert weight_sync_bytes(r) == 2_231_369_728


def test_vllm_starts_before_fsdp2_places_the_model():
    """vLLM's free-memory check: under DDP the policy's fp32 weights (7,615,616,512 x 4 B) are already on the device
    (0.7 x 80 GiB = 56 GiB asked, about 51 GiB free: refused); under FSDP2 the model is still on the host when TRL
    builds the engine (only the CUDA context counts)."""
    from llmem.estimator.generation import check_vllm_starts, colocated_pool
    from llmem.setup.gpus import outside_allocator_bytes

    def check(method):
        r = resolve(TrainingSetup(model="Qwen/Qwen2.5-7B", gpu="H100-80GB", objective="grpo", method=method,
                                  gpus=8, batch_size=1, seq_len=2048, num_generations=8, max_completion_length=1024,
                                  use_vllm=True, vllm_gpu_memory_utilization=0.7))
        check_vllm_starts(r, colocated_pool(r), 7_615_616_512 * 4, outside_allocator_bytes(r.gpu, 8))

    with pytest.raises(LlmemError, match="vLLM would not start"):
        check("ddp")
    check("fsdp")


@pytest.mark.parametrize(("fields", "message"), [
    ({"lora_rank": 8, "vllm_mode": "server", "vllm_max_model_length": None},
     "peft's merge_adapter inside vLLM's packed broadcast"),
])
def test_what_is_not_modelled_under_fsdp2_is_refused(fields, message):
    with pytest.raises(LlmemError, match=re.escape(message)):
        _setup(**fields)
    _setup()                               # colocated, full fine-tuning: modelled
    _setup("zero2", objective="rloo")      # RLOO shares the generation step


def test_an_uneven_shard_gathers_its_padding():
    """On 3 ranks the embedding's 32000 rows shard as 10,667 per rank: full_tensor() all-gathers 3 x 10,667 =
    32,001 padded rows and narrows them to 32,000 (a view: the padded storage stays, 32,001 x 512 x 4 B)."""
    from llmem.estimator.generation import full_tensor_bytes

    r = resolve(_setup(gpus=3, num_generations=3))
    assert full_tensor_bytes(r)[0] == 32_001 * 512 * 4 == 65_538_048
    assert full_tensor_bytes(r)[1] == 513 * 512 * 4        # q_proj's 512 rows: 171 per rank, 513 gathered
