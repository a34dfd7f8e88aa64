"""The layout written into a set-up in one place (ParallelismConfig.from_layout, TrainingSetup.with_layout): the
values a set-up runs a resolved `Layout` with, and those a result's record shows (ParallelismConfig.recorded)."""

from __future__ import annotations

from llmem.setup.layout import Layout
from llmem.setup.sections import ParallelismConfig
from llmem.setup.training import TrainingSetup


def test_a_pipeline_layout_writes_its_world_degrees_and_micro_batches():
    # tp 2 x pp 2 on 4 GPUs, 4 micro-batches of 2 samples: 8 samples a step, the interleaved stages kept
    base = TrainingSetup(model="gpt2", method="tp", gpus=4, pp=2, pp_schedule="interleaved-1f1b",
                         pp_virtual_stages=2, batch_size=4)
    s = base.with_layout(Layout("tp", 1, 2, 4, pp=2), 8, 4)
    assert (s.method, s.gpus, s.tp, s.pp, s.cp, s.ep) == ("tp", 4, 2, 2, 1, 1)
    assert (s.batch_size, s.pp_microbatches, s.pp_virtual_stages, s.microbatches) == (8, 4, 2, 4)


def test_a_plain_layout_drops_the_given_pipeline_and_expert_options():
    base = TrainingSetup(model="gpt2", method="fsdp", gpus=4, pp=2, pp_microbatches=4, batch_size=4)
    s = base.with_layout(Layout("ddp", 4, 1, 4), 2)
    assert (s.method, s.gpus, s.pp, s.pp_microbatches, s.pp_virtual_stages, s.batch_size) == \
        ("ddp", 4, 1, None, None, 2)
    moe = TrainingSetup(model="gpt2", method="fsdp", gpus=8, ep=4, ep_imbalance=1.5)
    assert moe.with_layout(Layout("fsdp", 8, 1, 8, ep=2), 1).parallelism.ep_imbalance == 1.5
    plain = moe.with_layout(Layout("fsdp", 8, 1, 8), 1)
    assert (plain.ep, plain.ep_imbalance) == (1, 1.0)


def test_tensor_parallel_styles_only_on_a_tensor_parallel_layout():
    given = ParallelismConfig(method="fsdp+tp", gpus=8, tp=2, sequence_parallel=True, loss_parallel=True,
                              gpus_per_node=8)
    two_d = ParallelismConfig.from_layout(Layout("fsdp+tp", 2, 4, 8, replicas=2), given)
    assert (two_d.gpus, two_d.tp, two_d.dp_replicate, two_d.sequence_parallel, two_d.loss_parallel) == \
        (8, 4, 2, True, True)
    fsdp = ParallelismConfig.from_layout(Layout("fsdp", 8, 1, 8), given)
    assert (fsdp.tp, fsdp.sequence_parallel, fsdp.loss_parallel, fsdp.gpus_per_node) == (None, False, False, 8)


def test_the_record_shows_the_degree_and_node_as_resolved():
    # ddp has no tensor parallelism: the record says tp 1, and the node of 4 GPUs the layout resolved
    given = ParallelismConfig(method="ddp", gpus=4)
    shown = given.recorded(Layout("ddp", 4, 1, 4))
    assert (shown.method, shown.gpus, shown.tp, shown.gpus_per_node) == ("ddp", 4, 1, 4)
