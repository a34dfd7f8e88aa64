"""The job's loading and saving phases (llmem.estimator.job_phases) on tiny-llama, against bytes worked out by hand
from its config (llmem/model/catalog/tiny/tiny-llama.json: hidden 512, intermediate 1376, 4 layers, vocab 32000,
untied embeddings), for FSDP2 and ZeRO-3 on one node of 8 GPUs, bf16-mixed full fine-tuning with AdamW."""

from __future__ import annotations

import pytest

from llmem import estimate
from llmem.cli import main
from llmem.errors import LlmemError
from llmem.setup.training import TrainingSetup

H, FFN, LAYERS, V = 512, 1376, 4, 32000
EMBED = V * H                                     # embed_tokens, and lm_head (untied): 16,384,000 each
LAYER = 4 * H * H + 3 * H * FFN + 2 * H            # q, k, v, o; gate, up, down; two RMSNorms: 3,163,136
P = 2 * EMBED + LAYERS * LAYER + H               # + the final norm: 45,421,056
GPUS = 8
FP32_SHARD = P * 4 // GPUS                        # every dim 0 divides by 8: FSDP2 pads nothing (22,710,528)
ADAMW_SHARD = 2 * FP32_SHARD                      # exp_avg, exp_avg_sq in fp32
MIB = 2**20
KIB = 2**10
# cuBLAS's workspace, kept by the allocator from the first matmul on: the default GPU's (pre-Hopper, CUDA 12's
# CUBLAS_WORKSPACE_CONFIG :4096:8 and :16:8 sizes: 2 x 4096 KiB + 8 x 16 KiB)
WORKSPACE = 2 * 4096 * KIB + 8 * 16 * KIB


def phases(**kw) -> dict[str, dict]:
    result = estimate(TrainingSetup(model="tiny-llama", gpus=GPUS, seq_len=64, **kw))
    return {p.name: p.to_dict() for p in result.job_phases}


def test_the_hand_count_is_the_models():
    assert P == 45_421_056
    assert estimate(TrainingSetup(model="tiny-llama", seq_len=64)).setup.total_params == P


def test_fsdp2_loading_both_paths():
    default = phases(method="fsdp")["load"]
    # accelerate's default (no cpu_ram_efficient_loading): 8 fp32 host copies; on the GPU this rank's shards and what
    # fsdp2_prepare_model holds whole at once: the embedding (its `input_weight` local keeps the parameter fully_shard
    # moved to the GPU) while the tail [final norm, lm_head] is moved whole (traced: tests/runtime/test_phase_trace.py)
    assert (default["kind"], default["host_bytes"]) == ("cpu", GPUS * P * 4)
    assert default["device_bytes"] == FP32_SHARD + (EMBED + EMBED + H) * 4 == 153_784_576
    efficient = phases(method="fsdp", load_path="cpu-ram-efficient")["load"]
    # one host copy per node; one parameter (the 65.5 MB embedding or lm_head) broadcast whole at a time
    assert efficient["host_bytes"] == P * 4
    assert efficient["device_bytes"] == FP32_SHARD + EMBED * 4 == 88_246_528


def test_fsdp2_saving_sharded_and_full():
    # weights and AdamW's states between steps (gradients freed), and cuBLAS's workspace
    resident = FP32_SHARD + ADAMW_SHARD + WORKSPACE
    sharded = phases(method="fsdp")["save"]         # accelerate's FSDP2 default: SHARDED_STATE_DICT
    assert sharded["kind"] == "sharded" and sharded["device_bytes"] == resident
    assert sharded["host_bytes"] == GPUS * ADAMW_SHARD      # each rank's optimizer shards copied to the host
    full = phases(method="fsdp", save_kind="full")["save"]
    # each parameter and state all-gathered whole in turn (the largest: 65.5 MB); rank 0 keeps the full optimizer
    assert full["device_bytes"] == resident + EMBED * 4 == 142_187_264
    assert full["host_bytes"] == 2 * P * 4 == 363_368_448


def test_zero3_loading_with_and_without_zero_init():
    zero_init = phases(method="ds-zero3")["load"]
    # HF's DeepSpeed config before from_pretrained: 16-bit partitions, one module gathered whole (the embedding);
    # rank 0 reads the 16-bit checkpoint into its host memory
    assert zero_init["kind"] == "zero-init"
    assert zero_init["device_bytes"] == P * 2 // GPUS + EMBED * 2 == 44_123_264
    assert zero_init["host_bytes"] == P * 2
    no_init = phases(method="ds-zero3", load_path="cpu")["load"]
    # the engine moves the whole 16-bit module to every GPU; 8 fp32 host copies loaded before it
    assert (no_init["device_bytes"], no_init["host_bytes"]) == (P * 2, GPUS * P * 4)


# tiny-qwen3 (llmem/model/catalog/tiny/tiny-qwen3.json): hidden 512, intermediate 1536, 8 / 4 heads of 64, q / k
# norms, 4 layers, vocab 16000, tied embeddings
QWEN3_EMBED = 16000 * 512
QWEN3_P = QWEN3_EMBED + 4 * (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 1536 + 2 * 512 + 2 * 64) + 512


def test_zero3_zero_init_holds_a_tied_lm_heads_own_partition():
    """zero.Init partitions the lm_head's own weight as it is built; tie_weights replaces it, and the replaced
    parameter lives on in a reference cycle (DeepSpeed's closures over it) until Python's cyclic collector runs:
    its partition is held through the load (the trace finds it: tests/runtime/test_phase_trace.py)."""
    assert QWEN3_P == 20_780_032
    result = estimate(TrainingSetup(model="tiny-qwen3", gpus=GPUS, seq_len=64, method="ds-zero3"))
    load = {p.name: p for p in result.job_phases}["load"]
    # every dim divides by 8: this rank's 16-bit partitions, the embedding gathered whole, the orphan's partition
    assert load.device_bytes == QWEN3_P * 2 // GPUS + QWEN3_EMBED * 2 + QWEN3_EMBED * 2 // GPUS == 23_627_008


def test_zero3_saving_sharded_and_16bit_gather():
    # between steps: 16-bit partitions, the 9 RMSNorm weights (512 elements each, under the 1e5 persistence
    # threshold) kept whole in 16 bits, fp32 master partitions and AdamW's two fp32 states; cuBLAS's workspace; and
    # what stage 3 keeps through the step: the 16-bit gradient partitions' buffer and the IPG bucket
    # (reduce_bucket_size 5e8 elements in 16 bits)
    resident = P * 2 // GPUS + 9 * H * 2 + FP32_SHARD + ADAMW_SHARD + WORKSPACE + P * 2 // GPUS + 5 * 10**8 * 2
    sharded = phases(method="ds-zero3")["save"]        # DeepSpeed's default: no 16-bit gather
    assert sharded["kind"] == "sharded" and sharded["device_bytes"] == resident == 1_099_371_008
    assert sharded["host_bytes"] == GPUS * FP32_SHARD   # each rank's fp32 flat partition, one storage at a time
    gather = phases(method="ds-zero3", save_kind="gather-16bit")["save"]
    assert gather["device_bytes"] == resident + EMBED * 2    # one module's own parameters gathered at a time
    assert gather["host_bytes"] == max(P * 2, GPUS * FP32_SHARD)


def test_zero2_full_save_clones_the_16bit_model_on_every_rank():
    """HF Trainer's save_model runs accelerate's get_state_dict on every rank: under ZeRO-1/2 each clones the
    replicated bf16 weights to its host (8 x 90.8 MB), more than each rank's fp32 flat partition (P x 4 / 8)."""
    save = phases(method="ds-zero2")["save"]
    assert save["kind"] == "full" and save["host_bytes"] == GPUS * P * 2 == 726_736_896


def test_adapters_save_their_weights_only():
    """LoRA r=8 on q_proj, v_proj: A (8 x 512) and B (512 x 8) per target, fp32 (peft's autocast_adapter_dtype)."""
    adapters = LAYERS * 2 * (8 * H + H * 8)
    save = phases(method="ddp", lora_rank=8)["save"]
    assert save["kind"] == "adapters" and save["host_bytes"] == adapters * 4 == 262_144
    assert phases(method="fsdp", lora_rank=8)["save"]["kind"] == "sharded"    # accelerate saves FSDP2's shards


def test_the_step_is_unchanged_and_methods_without_phases_have_none():
    base = TrainingSetup(model="tiny-llama", method="fsdp", gpus=GPUS, seq_len=64)
    other = TrainingSetup(model="tiny-llama", method="fsdp", gpus=GPUS, seq_len=64, load_path="cpu-ram-efficient",
                          save_kind="full")
    a, b = estimate(base).to_dict(), estimate(other).to_dict()
    assert a["peak_allocated_bytes"] == b["peak_allocated_bytes"] and a["notes"] == b["notes"]
    assert "job_phases" not in estimate(TrainingSetup(model="tiny-llama", method="tp", gpus=2, seq_len=64)).to_dict()
    assert repr(base) == repr(TrainingSetup(model="tiny-llama", method="fsdp", gpus=GPUS, seq_len=64))
    assert "load_path" not in repr(base) and "save_kind='full'" in repr(other)


def test_a_phase_over_the_gpu_is_flagged():
    result = estimate(TrainingSetup(model="tiny-llama", method="ds-zero3", gpus=GPUS, seq_len=64, load_path="cpu",
                                    gpu_memory="700MiB"))
    # 676 MiB of CUDA context leaves 24 MiB to the allocator: the 86.6 MiB 16-bit model moved whole does not fit
    assert any(n.startswith("load (cpu) needs 86.63 MiB per GPU") for n in result.job_notes)


@pytest.mark.parametrize("kw, message", [
    ({"load_path": "lazy"}, "unknown --load-path 'lazy'"),
    ({"method": "fsdp", "save_kind": "gather-16bit"}, "--save-kind gather-16bit does not apply to --method fsdp"),
    ({"method": "ddp", "save_kind": "adapters"}, "--save-kind adapters saves adapters"),
    ({"method": "tp", "load_path": "cpu"}, "--load-path cpu: loading and saving are modelled"),
])
def test_bad_values_are_refused(kw, message):
    with pytest.raises(LlmemError, match=message):
        TrainingSetup(model="tiny-llama", gpus=2, **kw)


def test_the_cli_refuses_in_one_line_with_exit_2(capsys):
    assert main(["estimate", "tiny-llama", "--load-path", "lazy"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("llmem: error: unknown --load-path 'lazy': choose one of") and "\n" not in err


# tiny-qwen3 (llmem/model/catalog/tiny/tiny-qwen3.json): hidden 512, 8 query heads and 4 key-value heads of 64,
# intermediate 1536, 4 layers, vocab 16000, the lm_head tied to the embedding
Q_EMBED = 16000 * 512
Q_LAYER = 512 * 512 + 2 * 512 * 256 + 512 * 512 + 3 * 512 * 1536 + 2 * 512 + 2 * 64   # attention, MLP, norms
Q_P = Q_EMBED + 4 * Q_LAYER + 512                                                    # 20,780,032


def test_fsdp2_state_dicts_copy_a_tied_weight_twice_and_init_a_stateless_optimizer():
    """get_model_state_dict has one entry per name (embed_tokens.weight and lm_head.weight) and _iterate_state_dict
    copies each; get_optimizer_state_dict's _init_optim_state gives SGD (no state) a zero gradient per trained
    parameter before reading it. Both traced: tests/runtime/test_phase_trace.py."""
    result = estimate(TrainingSetup(model="tiny-qwen3", method="fsdp", gpus=GPUS, seq_len=64, optimizer="sgd"))
    assert result.setup.total_params == Q_P == 20_780_032
    save = {p.name: p for p in result.job_phases}["save"]
    shard = Q_P * 4 // GPUS                     # every dim 0 divides by 8
    assert save.host_bytes == GPUS * (shard + Q_EMBED * 4 // GPUS) == 115_888_128
    assert save.device_bytes == shard + WORKSPACE + shard     # the weights, cuBLAS's workspace, the zero gradients
    full = {p.name: p for p in estimate(TrainingSetup(model="tiny-qwen3", method="fsdp", gpus=GPUS, seq_len=64,
                                                      optimizer="sgd", save_kind="full")).job_phases}["save"]
    assert full.host_bytes == (Q_P + Q_EMBED) * 4 == 115_888_128
