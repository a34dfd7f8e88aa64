"""A colocated vLLM engine's pool (llmem.memory.vllm) by hand, on Qwen2.5-7B's published config: 28 layers, 28 query
and 4 key/value heads of 128, hidden 3584, intermediate 18944, vocabulary 152064, 7,615,616,512 parameters, bf16."""

from __future__ import annotations

import pytest

from llmem.errors import LlmemError
from llmem.memory.vllm import CUDA_GRAPH_BYTES, NON_TORCH_BYTES, VllmModel, kv_block_bytes, vllm_pool

QWEN = VllmModel(params=7_615_616_512, num_layers=28, num_kv_heads=4, head_dim=128, hidden_size=3584,
                 intermediate_size=18944, vocab_size=152064)
GIB = 1024**3


def test_a_block_holds_16_tokens_of_k_and_v_in_every_layer():
    # 2 (K, V) x 16 tokens x 4 kv heads x 128 x 2 bytes = 32 KiB per layer, x 28 layers
    assert kv_block_bytes(QWEN) == 32_768 * 28 == 917_504
    assert kv_block_bytes(QWEN, tp=2) == 917_504 // 2            # 2 kv heads per rank
    assert kv_block_bytes(QWEN, tp=8) == 917_504 // 4            # 4 kv heads replicated: 1 per rank, not 0.5


def test_trl_default_utilisation_on_an_80_gib_gpu():
    """TRL 1.16's vllm_gpu_memory_utilization 0.3 of 80 GiB: 24 GiB; the weights 15,231,233,024 B; the profile run's
    MLP peak 4096 x (3584 + 3 x 18944) x 2 = 494,927,872 B (above the sampler's 2 x 256 x 152064 x 4); the rest in
    whole blocks."""
    pool = vllm_pool(QWEN, 80 * GIB, 0.3, max_model_len=32768)
    assert pool.pool_bytes == int(0.3 * 80 * GIB) == 25_769_803_776
    assert pool.weights_bytes == 15_231_233_024
    assert pool.activation_peak_bytes == 494_927_872
    room = 25_769_803_776 - 15_231_233_024 - 494_927_872 - CUDA_GRAPH_BYTES - NON_TORCH_BYTES
    assert room == 9_238_336_512
    assert pool.num_blocks == 10_068 and pool.kv_cache_bytes == 10_068 * 917_504   # 10,069 blocks would not fit
    assert pool.kv_tokens == 161_088
    # 8 generations of a 512-token prompt + 1024-token completion: 96 blocks each, 104 at once
    assert pool.concurrent_sequences(1536) == 10_068 // 96 == 104
    assert pool.resident_in_training_bytes == pool.pool_bytes
    assert vllm_pool(QWEN, 80 * GIB, 0.3, 32768, sleep=True).resident_in_training_bytes == 0


def test_vllm_refuses_to_start_when_one_sequence_does_not_fit():
    """0.2 of 80 GiB leaves 648,401,920 B: 706 blocks, fewer than the 2,048 of one 32,768-token sequence (the
    model's max_position_embeddings, what vLLM takes when vllm_max_model_length is unset)."""
    with pytest.raises(LlmemError, match="fewer than the 2048 blocks of one 32768-token sequence"):
        vllm_pool(QWEN, 80 * GIB, 0.2, max_model_len=32768)
    assert vllm_pool(QWEN, 80 * GIB, 0.2, max_model_len=8192).num_blocks == 648_401_920 // 917_504 == 706
    with pytest.raises(LlmemError, match="must lie in"):
        vllm_pool(QWEN, 80 * GIB, 1.5, max_model_len=1024)


# ------------------------------------------------------------------------------------ wired into GRPO's estimate
def _grpo(**kw):
    from llmem.setup.training import TrainingSetup

    base = dict(model="Qwen/Qwen2.5-7B", objective="grpo", gpu="H100-80GB", lora_rank=16, batch_size=8,
                num_generations=8, seq_len=2048, max_completion_length=1024, grad_ckpt=True)
    return TrainingSetup(**{**base, **kw})


def test_a_colocated_pool_stays_beside_the_trainer():
    """No sleep mode: the pool (0.3 of the H100's driver total) is device memory the trainer never gets back; the
    trainer's own counters are those of the step without transformers' generate (vLLM generates)."""
    from llmem.estimator.engine import estimate
    from llmem.setup.gpus import resolve_gpu

    total = resolve_gpu("H100-80GB").memory_bytes
    res = estimate(_grpo(use_vllm=True))
    assert res.components["vllm_pool"] == int(0.3 * total)
    assert res.device_used_bytes == res.reserved_on_device_bytes + res.components["cuda_context"] + int(0.3 * total)
    assert any("vLLM colocated" in n and "resident through training" in n for n in res.notes)
    server = estimate(_grpo(use_vllm=True, vllm_mode="server"))          # vLLM on other GPUs: nothing of it here
    assert server.components["vllm_pool"] == 0
    assert server.peak_allocated_bytes == res.peak_allocated_bytes


def test_sleep_mode_holds_the_pool_only_beside_generation():
    from llmem.estimator.engine import estimate

    awake, asleep = estimate(_grpo(use_vllm=True)), estimate(_grpo(use_vllm=True, vllm_enable_sleep_mode=True))
    assert asleep.peak_allocated_bytes == awake.peak_allocated_bytes
    assert asleep.device_used_bytes < awake.device_used_bytes
    # at the wake-up: the trainer's live tensors of the generation phase (the LoRA model's weights, the adapters'
    # optimizer states) and the whole pool
    gen = next(p for p in asleep.phases if p.name == "generation")
    assert asleep.device_used_bytes == max(asleep.reserved_on_device_bytes, gen.allocated_bytes
                                           + awake.components["vllm_pool"]) + asleep.components["cuda_context"]


def test_vllm_options_are_refused_where_they_do_not_apply():
    from llmem.model.resolved import resolve

    with pytest.raises(LlmemError, match="belongs to vLLM generation: add --use-vllm"):
        _grpo(vllm_enable_sleep_mode=True)
    with pytest.raises(LlmemError, match="must lie in \\(0, 1\\)"):
        _grpo(use_vllm=True, vllm_gpu_memory_utilization=1.0)
    with pytest.raises(LlmemError, match="the server's own option"):
        _grpo(use_vllm=True, vllm_mode="server", vllm_gpu_memory_utilization=0.5)
    with pytest.raises(LlmemError, match="shorter than a sequence"):
        _grpo(use_vllm=True, vllm_max_model_length=1024)
    from llmem.estimator.engine import estimate_resolved

    # 0.9 of 79.65 GiB asks 71.7 GiB; the bf16 base (14.2 GiB) and the CUDA context are on the device first
    with pytest.raises(LlmemError, match="vLLM would not start: .* lower --vllm-gpu-memory-utilization to at most"):
        estimate_resolved(resolve(_grpo(use_vllm=True, vllm_gpu_memory_utilization=0.9)))


def test_a_grpo_config_brings_its_vllm_settings(tmp_path):
    from llmem.setup.sources import setup_from_file

    cfg = tmp_path / "grpo.yaml"
    cfg.write_text("model_name_or_path: Qwen/Qwen2.5-7B\nper_device_train_batch_size: 8\nnum_generations: 8\n"
                   "max_completion_length: 1024\nuse_vllm: true\nvllm_mode: colocate\n"
                   "vllm_gpu_memory_utilization: 0.45\nvllm_enable_sleep_mode: true\nvllm_max_model_length: 4096\n")
    s = setup_from_file(str(cfg), seq_len=2048).setup
    assert (s.objective, s.use_vllm, s.vllm_mode, s.vllm_gpu_memory_utilization, s.vllm_enable_sleep_mode,
            s.vllm_max_model_length) == ("grpo", True, "colocate", 0.45, True, 4096)
