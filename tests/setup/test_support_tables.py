"""The support tables (llmem.setup.support.SUPPORT): one row per feature, read in order by every engine through
resolve(), so estimate, trace and the planner refuse a combination with the same line; the pipeline's own limits
are a row of the table (checked once the model is known), not an estimator refusal."""

from __future__ import annotations

import pytest

from llmem.errors import LlmemError
from llmem.model.resolved import resolve
from llmem.setup.methods import METHODS
from llmem.setup.support import PIPELINE, SUPPORT, Case, ModelSupport, support_refusal
from llmem.setup.training import TrainingSetup


def _model(**facts) -> ModelSupport:
    return ModelSupport("LlamaForCausalLM", "llama", True, True, **facts)


def test_gpt2_pipeline_is_refused_at_resolve_for_its_tied_embeddings():
    """GPT-2 ties wte and lm_head (transformers' tie_word_embeddings): a pipeline would put one weight on the first
    and the last stage. The refusal comes from resolving, before any engine builds a schedule or a model."""
    setup = TrainingSetup("gpt2", method="single", gpus=2, pp=2, precision="bf16", seq_len=64, batch_size=2)
    with pytest.raises(LlmemError, match="tied input and output embeddings"):
        resolve(setup)


def test_trace_refuses_what_estimate_refuses_before_building():
    """The trace resolves through the same tables: one line, no AttributeError from a model without `.layers`."""
    from llmem.runtime.trace import trace

    setup = TrainingSetup("gpt2", method="single", gpus=2, pp=2, precision="bf16", seq_len=64, batch_size=2)
    with pytest.raises(LlmemError, match="tied input and output embeddings"):
        trace(setup)


@pytest.mark.parametrize("field, flag", [("fused_ce", "--fused-ce"), ("packing", "--packing"),
                                         ("offload_activations", "--offload-activations")])
def test_pipeline_row_names_the_option_it_cannot_model(field, flag):
    setup = TrainingSetup("tiny-llama", method="single", gpus=2, pp=2, precision="bf16", seq_len=64, batch_size=2,
                          **{field: True})
    assert support_refusal(setup, METHODS["single"], _model()) == f"--pp with {flag} is not modelled: drop one of them"
    with pytest.raises(LlmemError, match=f"--pp with {flag} is not modelled"):
        resolve(setup)


def test_pipeline_row_waits_for_the_model():
    """Without the model's facts (a planner screening methods from the options alone) the pipeline row is off; with
    them, its autocast limit applies: single under bf16-mixed runs torch.autocast over the whole schedule step."""
    setup = TrainingSetup("tiny-llama", method="single", gpus=2, pp=2, precision="bf16-mixed", seq_len=64,
                          batch_size=2)
    assert PIPELINE.refusal(Case(setup, METHODS["single"])) is None
    assert "autocast over the whole schedule step" in PIPELINE.refusal(Case(setup, METHODS["single"], _model()))


def test_rows_are_checked_in_registry_order():
    """--fused-ce under tp with --loss-parallel breaks two rows: the tp styles' row comes first in SUPPORT, so its
    line is the one a user reads."""
    order = list(SUPPORT)
    assert order.index("--sequence-parallel / --loss-parallel") < order.index("--fused-ce")
    setup = TrainingSetup("tiny-llama", method="tp", gpus=2, fused_ce=True, loss_parallel=True)
    assert support_refusal(setup, METHODS["tp"]).startswith("--fused-ce with --loss-parallel is not modelled")
    alone = TrainingSetup("tiny-llama", method="tp", gpus=2, fused_ce=True)
    assert support_refusal(alone, METHODS["tp"]).startswith("--fused-ce with tensor parallelism is not modelled")


def test_reshard_after_forward_names_the_divisors_of_the_shard_ranks():
    """12 FSDP2 ranks as 2 HSDP replicas: 6 shard ranks, whose non-trivial divisors are 2 and 3."""
    setup = TrainingSetup("tiny-llama", method="fsdp", gpus=12, dp_replicate=2, reshard_after_forward=4)
    why = support_refusal(setup, METHODS["fsdp"])
    assert "must divide FSDP2's 6 shard ranks" in why and why.endswith("choose 2 or 3")
    assert support_refusal(TrainingSetup("tiny-llama", method="fsdp", gpus=12, dp_replicate=2,
                                         reshard_after_forward=3), METHODS["fsdp"]) is None


def test_every_row_has_a_refusal_and_a_label_for_the_docs():
    for name, row in SUPPORT.items():
        assert row.refusals, name
        assert all(r.other for r in row.refusals), name
