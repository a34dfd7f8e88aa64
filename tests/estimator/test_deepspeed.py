"""DeepSpeed ZeRO as DeepSpeed's engine runs it (methods ds-zero1/2/3): the model-state terms against DeepSpeed's own
estimator functions where they count the same thing, every other buffer term worked by hand, the config round trip
(--export deepspeed read back by --from) and the refusals."""

from __future__ import annotations

import json

import pytest

from llmem import estimate
from llmem.cli import main
from llmem.errors import LlmemError
from llmem.estimator.states import model_states
from llmem.model.resolved import resolve
from llmem.setup.deepspeed import (
    flat_partition_numel,
    param_partition_numel,
    partition_numel,
    sub_group_numels,
)
from llmem.setup.sources import setup_from_file
from llmem.setup.training import user_setup

TINY = "tiny-llama"   # 45,421,056 parameters, hidden 512, 4 layers of 3,163,136


def _setup(method: str, gpus: int = 4, **kw):
    return user_setup(model=TINY, method=method, gpus=gpus, seq_len=128, **kw)


def test_zero2_model_states_are_deepspeeds_estimator():
    """estimate_zero2_model_states_mem_needs (deepspeed/runtime/zero/stage_1_and_2.py): 2 B x params on the GPU with
    the optimizer offloaded, 2 B x params + 18 B x params / GPUs without ("2_grads_16bit + 4_grads_32bit +
    4_params_32bit + 8_optimizer_states_32bit"): llmem's bf16 flat buffer, fp32 master partition, Adam states over
    it and the step's fp32 gradient are those terms; its bf16 partition gradients are the whole parameters that
    overlap the partition (DeepSpeed's grads_in_partition), at least DeepSpeed's 2 B x params / GPUs."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    r = resolve(_setup("ds-zero2", optimizer="adamw-fused"))
    n, part = r.anatomy.total_params, partition_numel([p.numel for p in r.anatomy.params], 2, 4)
    _, on_gpu = estimate_zero2_model_states_mem_needs(n, num_gpus_per_node=4, cpu_offload=False)
    _, offloaded = estimate_zero2_model_states_mem_needs(n, num_gpus_per_node=4, cpu_offload=True)
    assert part * 4 == n                       # 45,421,056 is a multiple of 2 x 4: no padding
    ms = model_states(r)
    assert ms.weights == 2 * n + 4 * part and ms.optimizer_states == 8 * part
    assert 2 * n + 4 * part + 8 * part + 2 * part + 4 * part == on_gpu
    largest = max(p.numel for p in r.anatomy.params)
    assert 2 * part <= ms.gradients <= 2 * (part + largest)
    ms = model_states(resolve(_setup("ds-zero2", offload_optimizer=True)))
    assert ms.weights == offloaded and ms.optimizer_states == 0


def test_zero3_partitions_are_deepspeeds_estimator():
    """estimate_zero3_model_states_mem_needs with the optimizer offloaded and the parameters not: 4 B x the largest
    layer + 2 B x params / GPUs - the bf16 partitions (ceil(numel / world) per parameter: a few elements of
    padding) and the largest layer's gathered bf16 parameters and their bf16 gradients."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    a = resolve(_setup("ds-zero3")).anatomy
    largest = max(a.layer_params(i) for i in range(a.num_layers))
    _, gpu, largest_bytes = estimate_zero3_model_states_mem_needs(a.total_params, largest, num_gpus_per_node=4,
                                                                  cpu_offload=True, cpu_offload_params=False)
    partitions = 2 * sum(param_partition_numel(p.numel, 4) for p in a.params)
    assert largest_bytes == 2 * largest + 2 * largest            # gathered bf16 parameters + their bf16 gradients
    assert 0 <= partitions + largest_bytes - gpu <= 2 * 4 * len(a.params)   # the per-parameter ceil padding


def test_partition_arithmetic_by_hand():
    # stage 1-2: padded to 2 x dp elements (nccl_start_alignment_factor), then split: 10 elements on 4 ranks -> 16 / 4
    assert flat_partition_numel(10, 4) == 4 and flat_partition_numel(16, 4) == 4 and flat_partition_numel(17, 4) == 6
    assert param_partition_numel(10, 4) == 3
    # stage 3 sub-groups: consecutive partitions until sub_group_size is reached; 0 -> one per parameter
    assert sub_group_numels([3, 4, 5], 0) == [3, 4, 5]
    assert sub_group_numels([3, 4, 5], 6) == [7, 5]
    assert sub_group_numels([3, 4, 5], 100) == [12]


@pytest.mark.parametrize("method, overlap, buffers", [("ds-zero2", True, 2), ("ds-zero2", False, 1),
                                                      ("ds-zero3", True, 1)])
def test_ipg_buffers_by_hand(method, overlap, buffers):
    """The IPG buffers of reduce_bucket_size elements in bf16 (setup_buckets: a second one under overlap_comm at
    stages 1-2; stage 3's one bucket made at init) live at the backward's peak: moving the bucket size from 4e8 to
    2e8 elements moves the communication buffers at the peak by buffers x 2e8 x 2 bytes (the whole model fits in
    either bucket, so the reduction's flattened copy is the same) and peak allocated by about as much."""
    big = estimate(_setup(method, reduce_bucket_size=400_000_000, overlap_comm=overlap))
    small = estimate(_setup(method, reduce_bucket_size=200_000_000, overlap_comm=overlap))
    # stage 3: the second step's forward, its coalesced prefetch of the whole model (flat buffer and copies) on
    # top of the bucket, as DeepSpeed's engine traced shows it
    assert big.peak_phase == small.peak_phase == ("forward" if method == "ds-zero3" else "backward")
    moved = buffers * 200_000_000 * 2
    comm = "communication_buffers"
    assert big.components[comm] - small.components[comm] == moved
    assert abs(big.peak_allocated_bytes - small.peak_allocated_bytes - moved) < 0.002 * moved


def test_auto_is_hf_hidden_size_rule():
    """"auto" is HF's hidden_size^2 / 0.9 x hidden_size^2 / 10 x hidden_size (hidden 512 here)."""
    auto = estimate(_setup("ds-zero3", reduce_bucket_size="auto", prefetch_bucket_size="auto",
                           param_persistence_threshold="auto"))
    given = estimate(_setup("ds-zero3", reduce_bucket_size=512 * 512, prefetch_bucket_size=int(0.9 * 512 * 512),
                            param_persistence_threshold=5120))
    assert auto.peak_allocated_bytes == given.peak_allocated_bytes
    assert auto.peak_reserved_bytes == given.peak_reserved_bytes


def test_zero_stages_and_the_stage3_reuse_distance():
    """ZeRO-1 holds whole bf16 gradients through the backward, ZeRO-2 none (each goes into the bucket): not more (at
    the end of backward both hold the bucket and its flattened copy, where the peak is). ZeRO-3 without retention
    (max_reuse_distance 0, no prefetch) holds a partition of the parameters too: less again; with DeepSpeed's
    default reuse distance (1e9 elements, more than this whole model twice) every layer gathered in the second step's
    forward stays gathered for its backward, and that forward's coalesced prefetch holds its flat all-gather buffer
    besides the parameters' copies out of it until the last is fetched: at most twice the whole model in bf16 more."""
    z1, z2 = (estimate(_setup(m, reduce_bucket_size=1_000_000)).peak_allocated_bytes for m in ("ds-zero1", "ds-zero2"))
    lean = estimate(_setup("ds-zero3", reduce_bucket_size=1_000_000, max_reuse_distance=0, prefetch_bucket_size=0))
    kept = estimate(_setup("ds-zero3", reduce_bucket_size=1_000_000))
    n = resolve(_setup("ds-zero3")).anatomy.total_params
    assert z1 >= z2 > lean.peak_allocated_bytes
    assert 0 < kept.peak_allocated_bytes - lean.peak_allocated_bytes <= 2 * 2 * n


def test_export_deepspeed_reads_back_to_the_same_estimate(tmp_path):
    """--export deepspeed writes the ZeRO section the estimate assumed; --from reads it back to the same set-up."""
    path = tmp_path / "ds.json"
    assert main(["plan", TINY, "--method", "ds-zero3", "--gpus", "4", "--seq-len", "128", "--reduce-bucket-size", "2e6",
             "--max-reuse-distance", "0", "--export", "deepspeed", str(path)]) == 0
    cfg = json.loads(path.read_text())
    zero = cfg["zero_optimization"]
    assert (zero["stage"], zero["reduce_bucket_size"], zero["stage3_max_reuse_distance"]) == (3, 2_000_000, 0)
    assert zero["overlap_comm"] is True and "comment" not in cfg
    read = setup_from_file(path, model=TINY, gpus=4, seq_len=128).setup
    assert (read.method, read.reduce_bucket_size, read.max_reuse_distance) == ("ds-zero3", 2_000_000, 0)
    batch = cfg["train_micro_batch_size_per_gpu"]
    ours = estimate(_setup("ds-zero3", reduce_bucket_size=2_000_000, max_reuse_distance=0, batch_size=batch))
    assert estimate(read).peak_reserved_bytes == ours.peak_reserved_bytes


@pytest.mark.parametrize("kw, message", [
    (dict(method="fsdp", reduce_bucket_size=1000), "--reduce-bucket-size is a DeepSpeed ZeRO setting"),
    (dict(method="ds-zero2", offload_param=True), "--offload-param applies to ZeRO stage 3 only"),
    (dict(method="ds-zero2", prefetch_bucket_size=10), "--prefetch-bucket-size applies to ZeRO stage 3 only"),
    (dict(method="ds-zero3", precision="bf16"), "use it"),
    (dict(method="ds-zero1", optimizer="adamw-8bit"), "adamw-8bit is modelled with single and ddp only"),
    (dict(method="ds-zero1", optimizer="muon"), "elementwise torch optimizers only"),
    (dict(method="ds-zero2", reduce_bucket_size=0), "must be > 0"),
    (dict(method="ds-zero2", reduce_bucket_size="5.5"), "not a whole number"),
    (dict(method="ds-zero3", prefetch_bucket_size="1e400"), "not a whole number"),
    (dict(method="ds-zero3", prefetch_bucket_size="1e60"), "more than any GPU holds"),
    (dict(method="ddp", offload_param=True), "--offload-param offloads sharded parameters"),
])
def test_refusals(kw, message):
    with pytest.raises(LlmemError, match=message):
        estimate(user_setup(model=TINY, gpus=2, **kw))


def test_cli_refusal_is_one_line(capsys):
    code = main(["estimate", TINY, "--gpus", "2", "--method", "ds-zero2", "--offload-param"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--offload-param applies to ZeRO stage 3 only" in err
