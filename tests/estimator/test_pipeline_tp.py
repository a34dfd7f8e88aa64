"""TP x PP (torchtitan's 3-D layout, mesh pp x dp x tp): the layouts, each stage's TP-sharded parameters and its
send / recv buffers worked out by hand, the torchtitan TOML round trip, what stays refused (one line, exit 2), and
(slow) every stage's estimate against its trace.

tiny-llama (llmem/model/catalog/tiny/tiny-llama.json): hidden 512, intermediate 1376, 8 / 8 heads, 4 layers, vocab
32000, untied. torchtitan's split on 2 stages: (4 + 2) / 2 = 3 "layers" each, so stage 0 holds the embedding and
layers 0-1, stage 1 layers 2-3, the final norm and lm_head.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmem.errors import LlmemError
from llmem.setup.layout import candidate_layouts, resolve_layout
from llmem.setup.training import TrainingSetup

HIDDEN, INTER, VOCAB = 512, 1376, 32000
SP_ROW = dict(model="tiny-llama", method="fsdp+tp", gpus=8, tp=2, pp=2, precision="bf16-mixed", optimizer="sgd",
              batch_size=4, seq_len=128, sequence_parallel=True, loss_parallel=True)
TP_ROW = dict(model="tiny-llama", method="tp", gpus=4, pp=2, precision="bf16", optimizer="sgd", batch_size=4,
              seq_len=128, sequence_parallel=True, loss_parallel=True)


def _layer_numel(tp: int, dp: int) -> int:
    """One Llama decoder layer's local elements: q/k/v/gate/up ColwiseParallel (Shard(0) over tp), o/down
    RowwiseParallel (Shard(1) over tp), the two norms replicated over tp; then FSDP2's Shard(0) over dp."""
    attn = 4 * (HIDDEN // tp) * HIDDEN // dp            # q, k, v: [512 / tp, 512]; o: [512, 512 / tp]
    mlp = 2 * (INTER // tp) * HIDDEN // dp + HIDDEN * (INTER // tp) // dp
    return attn + mlp + 2 * HIDDEN // dp


def _stage_replays(**kw):
    from llmem.estimator.pipeline import stage_replays
    from llmem.model.resolved import resolve

    return stage_replays(resolve(TrainingSetup(**kw)))


def test_layouts_of_tp_x_pp():
    lay = resolve_layout("fsdp+tp", 8, 2, None, 8, 8, pp=2)
    assert (lay.dp, lay.tp, lay.pp, lay.world_size) == (2, 2, 2, 8)
    assert lay.mesh_shape == (("pp", 2), ("dp", 2), ("tp", 2))          # torchtitan's ParallelDims order
    assert lay.label == "fsdp+tp (dp 2 x tp 2 x pp 2)"
    lay = resolve_layout("tp", 4, None, None, 8, 8, pp=2)              # the stage's 2 GPUs all tensor-parallel
    assert (lay.dp, lay.tp, lay.pp, lay.mesh_shape) == (1, 2, 2, (("pp", 2), ("tp", 2)))
    # Llama-3.1-405B on 512 GPUs, as torchtitan runs it: dp 8 x tp 8 x pp 8 (128 query / 8 key-value heads)
    lay = resolve_layout("fsdp+tp", 512, 8, 8, 128, 8, pp=8)
    assert (lay.dp, lay.tp, lay.pp, lay.nodes) == (8, 8, 8, 64)


def test_the_plan_searches_tp_x_pp():
    from llmem.setup.layout import ModelLimits

    labels = [lay.label for lay in candidate_layouts(16, 8, 8, 8, limits=ModelLimits(8, 128), pp=2,
                                                     methods=("fsdp+tp",))]
    assert labels == ["fsdp+tp (dp 4 x tp 2 x pp 2)", "fsdp+tp (dp 2 x tp 4 x pp 2)"]   # tp 8 leaves dp 1
    assert [lay.label for lay in candidate_layouts(16, 8, 8, 8, limits=ModelLimits(8, 128), pp=2, tp=4,
                                                   methods=("fsdp+tp",))] == ["fsdp+tp (dp 2 x tp 4 x pp 2)"]


def test_hsdp_x_pp_layouts():
    # each stage's 4 (or 2 x tp 2) dp ranks as 2 replicas x 2 shards: torchtitan's mesh pp, dp_replicate,
    # dp_shard(, tp)
    lay = resolve_layout("fsdp", 8, None, None, 8, 8, replicas=2, pp=2)
    assert (lay.dp, lay.shard_degree, lay.label) == (4, 2, "fsdp (dp 2x2 x pp 2)")
    assert lay.mesh_shape == (("pp", 2), ("dp_replicate", 2), ("dp_shard", 2))
    lay = resolve_layout("fsdp+tp", 16, 2, 8, 8, 8, replicas=2, pp=2)
    assert lay.mesh_shape == (("pp", 2), ("dp_replicate", 2), ("dp_shard", 2), ("tp", 2))
    # the search: a stage across nodes (32 GPUs, pp 2: 16 per stage on nodes of 8) also sharded within a node
    from llmem.setup.layout import ModelLimits

    labels = [lay.label for lay in candidate_layouts(32, 8, 8, 8, limits=ModelLimits(8, 128), pp=2,
                                                     methods=("fsdp",))]
    assert labels == ["fsdp (dp 16 x pp 2)", "fsdp (dp 2x8 x pp 2)"]


def test_hsdp_x_pp_stage_weights_by_hand():
    # HSDP 2 x 2 per stage: FSDP2 shards over dp_shard 2 only (replicated over dp_replicate)
    reps = _stage_replays(model="tiny-llama", method="fsdp", gpus=8, pp=2, dp_replicate=2, precision="bf16-mixed",
                          optimizer="sgd", batch_size=4, seq_len=128)
    stage0 = (VOCAB * HIDDEN // 2 + 2 * _layer_numel(1, 2)) * 4
    assert reps[0].phases["setup:setup"].components["weights"] == stage0


def test_stage_weights_by_hand():
    # fsdp+tp, dp 2 x tp 2: stage 0's fp32 shards, the embedding [32000, 512] Shard(0) over tp, then over dp
    fsdp = _stage_replays(**SP_ROW)
    stage0 = (VOCAB // 2 * HIDDEN // 2 + 2 * _layer_numel(2, 2)) * 4
    assert stage0 == 22_712_320
    assert fsdp[0].phases["setup:setup"].components["weights"] == stage0
    # pure TP 2 x PP, bf16: stage 1's layers, the final norm (replicated) and lm_head [32000, 512] Shard(0) over tp
    tp = _stage_replays(**TP_ROW)
    stage1 = (2 * _layer_numel(2, 1) + HIDDEN + VOCAB // 2 * HIDDEN) * 2
    assert tp[1].phases["setup:setup"].components["weights"] == stage1


@pytest.mark.parametrize("sp, seq", [(True, 128 // 2), (False, 128)])
def test_send_recv_buffers_by_hand(sp, seq):
    # torch's PipelineStage recv buffers, made at the first step for all 4 micro-batches and kept: stage 0 the
    # gradients from stage 1, stage 1 the activations from stage 0; each [micro-batch 1, seq (/ tp under SP),
    # hidden] in bf16 (pure TP: nothing else is a communication buffer)
    reps = _stage_replays(**{**TP_ROW, "sequence_parallel": sp, "loss_parallel": sp})
    for rep in reps:
        assert rep.phases["it0:forward"].components["communication_buffers"] == 4 * 1 * seq * HIDDEN * 2


@pytest.mark.parametrize("kw, dp, replicas, shard", [
    ({"method": "fsdp+tp", "gpus": 8, "precision": "bf16-mixed"}, 2, 1, 2),
    ({"method": "fsdp+tp", "gpus": 16, "precision": "bf16-mixed", "dp_replicate": 2}, 4, 2, 2),    # HSDP x TP x PP
    # TP x PP without FSDP2: torchtitan trains in training.dtype (no MixedPrecisionPolicy, no autocast)
    ({"method": "tp", "gpus": 4, "precision": "fp32", "pp_schedule": "interleaved-1f1b"}, 1, 1, 1),
])
def test_exported_tp_x_pp_reads_back(tmp_path, kw, dp, replicas, shard):
    from llmem.planner.export import ExportPlan
    from llmem.planner.export_torchtitan import export_torchtitan
    from llmem.setup.layout import Layout
    from llmem.setup.sources import setup_from_file

    model = "meta-llama/Llama-3.1-8B"
    setup = TrainingSetup(model=model, tp=2, pp=2, batch_size=4, seq_len=256, optimizer="adamw-fused",
                          sequence_parallel=True, loss_parallel=True, **kw)
    lay = Layout(kw["method"], dp, 2, 8, replicas=replicas, pp=2)
    e = ExportPlan(model, "LlamaForCausalLM", lay, 1, 1, 256, kw["precision"], False, False,
                   optimizer="adamw-fused")
    p = SimpleNamespace(setup=setup, anatomy=SimpleNamespace(num_layers=32),
                        recommended=SimpleNamespace(layout=lay, time=SimpleNamespace(pp_microbatches=4)))
    text = export_torchtitan(p, e)
    assert "tensor_parallel_degree = 2" in text and "pipeline_parallel_degree = 2" in text
    assert f"data_parallel_shard_degree = {shard}" in text
    assert f"data_parallel_replicate_degree = {replicas}" in text
    path = tmp_path / "train.toml"
    path.write_text(text)
    assert setup_from_file(str(path)).setup == setup


@pytest.mark.parametrize("args, words", [
    (["--method", "tp", "--gpus", "4", "--pp", "2", "--dp-replicate", "2"], "replicates FSDP2's shards"),
    (["--method", "fsdp", "--gpus", "8", "--pp", "2", "--dp-replicate", "3"],
     "does not divide the 4 data-parallel ranks of each pipeline stage"),
    (["--method", "fsdp", "--gpus", "8", "--tp", "2", "--pp", "2"], "use --method tp or fsdp+tp"),
    (["--method", "fsdp+tp", "--gpus", "8", "--tp", "2", "--pp", "2", "--pp-schedule", "interleaved-1f1b"],
     "FSDP2 over several stages per rank"),
    (["--method", "tp", "--gpus", "2", "--pp", "2"], "one GPU per stage"),
    (["--method", "fsdp+tp", "--gpus", "8", "--tp", "2", "--pp", "2", "--cp", "2"], "--cp runs under --method fsdp"),
])
def test_what_stays_refused_is_one_line(capsys, args, words):
    from llmem.cli import main

    assert main(["estimate", "tiny-llama", "--batch-size", "4", "--seq-len", "64", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err


def test_refusal_under_resolve_is_llmem_error():
    from llmem.model.resolved import resolve

    with pytest.raises(LlmemError, match="one GPU per stage"):
        resolve(TrainingSetup(model="tiny-llama", method="tp", gpus=2, pp=2, batch_size=2))


@pytest.mark.slow
@pytest.mark.parametrize("row", [
    SP_ROW,
    {**TP_ROW, "pp_schedule": "interleaved-1f1b"},
    {**SP_ROW, "gpus": 16, "dp_replicate": 2},                       # HSDP x TP x PP: 2 x 2 x 2 x 2
])
def test_every_stage_estimate_within_2_percent_of_its_trace(row):
    from llmem.runtime.trace import trace

    est = _stage_replays(**row)
    traced = trace(TrainingSetup(**row)).stages
    for rep, truth in zip(est, traced, strict=True):
        for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
            assert abs(getattr(rep, key) / truth[key] - 1) < 0.02, (truth["stage"], key)


@pytest.mark.slow
def test_traced_recv_buffers_by_hand():
    """The trace's recv buffers (torch's own _prepare_forward_infra / _prepare_backward_infra, under the
    communication_buffers region): 4 micro-batches of [1, 128 / 2, 512] bf16 on each stage."""
    from llmem.runtime.trace import trace_with_details

    for rank in (0, 1):
        _, details = trace_with_details(TrainingSetup(**TP_ROW), pp_rank=rank)
        assert details.phase_peaks["forward"]["components"]["communication_buffers"] == 4 * 64 * HIDDEN * 2


HAND = """
[model]
name = "llama3"
flavor = "70B"
[training]
local_batch_size = 16
seq_len = 1024
[parallelism]
data_parallel_replicate_degree = {replicate}
data_parallel_shard_degree = 2
tensor_parallel_degree = 8
pipeline_parallel_degree = 4
pipeline_parallel_schedule = "1F1B"
pipeline_parallel_microbatch_size = 2
"""


@pytest.mark.parametrize("replicate", [1, 2])
def test_hand_written_3d_toml_reads_as_fsdp_tp_pp(tmp_path, replicate):
    # torchtitan's 3-D (4-D with HSDP) layout: replicate x 2 shards x tp 8 x pp 4 GPUs; its TP sequence parallel
    # with loss parallel; 16 samples in micro-batches of 2 -> 8
    from llmem.setup.sources import setup_from_file

    path = tmp_path / "hand.toml"
    path.write_text(HAND.format(replicate=replicate))
    s = setup_from_file(str(path)).setup
    assert (s.method, s.gpus, s.tp, s.pp, s.dp_replicate, s.pp_microbatches) == \
        ("fsdp+tp", replicate * 2 * 8 * 4, 8, 4, replicate, 8)
    assert s.sequence_parallel and s.loss_parallel
