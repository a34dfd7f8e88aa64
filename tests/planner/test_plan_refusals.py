"""`llmem plan`'s refusals: an export the options alone rule out is refused before the plan runs, in one line; a
plan none of whose layouts can be estimated says the reason first."""

from __future__ import annotations

import pytest

from llmem.cli import main
from llmem.errors import LlmemError
from llmem.planner.export import check_methods_exportable
from llmem.planner.plan import plan
from llmem.setup.training import TrainingSetup


@pytest.fixture
def no_plan(monkeypatch, tmp_path):
    """The plan, replaced by a function that fails the test: the refusal must come before it."""
    import llmem.planner.plan

    def ran(*args, **kwargs):
        raise AssertionError("the plan ran before the refusal")

    monkeypatch.setattr(llmem.planner.plan, "plan", ran)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    return captured.err


@pytest.mark.parametrize("flags, words", [
    (["--gpus", "4", "--method", "fsdp", "--objective", "trl-sft", "--export", "trl", "t.yaml"],
     "--export trl writes TRL's config with a DDP or one-GPU launch, not --method fsdp"),
    (["--gpus", "2", "--method", "ds-zero2", "--objective", "trl-sft", "--export", "trl", "t.yaml"], "not --method ds-zero2"),
    # (TRL's objectives refuse tp themselves; sft's --export trl is refused for its loss first)
    (["--gpus", "4", "--method", "tp", "--export", "trl", "t.yaml"], "plan with --objective trl-sft"),
    (["--gpus", "2", "--method", "ds-zero3", "--export", "accelerate", "a.yaml"],
     "--method ds-zero3 runs DeepSpeed's engine"),
    (["--gpus", "2", "--method", "ds-zero1", "--export", "torchrun", "run.sh"], "runs DeepSpeed's engine"),
    (["--gpus", "2", "--method", "ds-zero2", "--export", "torchtitan", "t.toml"],
     "--export torchtitan: --method ds-zero2 runs DeepSpeed's engine"),
    (["--gpus", "4", "--method", "fsdp+tp", "--export", "deepspeed", "ds.json"],
     "DeepSpeed has no equivalent of --method fsdp+tp"),
    (["--gpus", "4", "--method", "fsdp+tp", "--tp", "2", "--sequence-parallel", "--export", "accelerate", "a.yaml"],
     "--export accelerate launches plain tensor parallelism"),
])
def test_exports_the_method_rules_out_are_refused_before_the_plan(no_plan, capsys, flags, words):
    assert main(["plan", "tiny-llama", "--seq-len", "64", *flags]) == 2
    err = _one_line_error(capsys)
    assert err.startswith("llmem: error: --export")
    assert words in err
    assert not list(no_plan.iterdir())          # nothing written


@pytest.mark.parametrize("method, gpus", [("ddp", 4), ("single", 1), ("fsdp", 1)])
def test_trl_export_of_a_ddp_or_one_gpu_method_is_not_refused_early(method, gpus):
    """TRL's config launches DDP or one GPU: a method that runs as either is left to the plan."""
    check_methods_exportable(TrainingSetup(model="tiny-llama", gpus=gpus), "trl", (method,))


def test_no_method_given_leaves_the_export_to_the_plan():
    """Without --method the plan may pick DDP, which TRL's config launches: nothing to refuse yet."""
    check_methods_exportable(TrainingSetup(model="tiny-llama", gpus=8), "trl", None)


def test_plan_error_says_the_shared_reason_first():
    """Every layout refused for the same option: that reason leads the one line, the layouts follow."""
    setup = TrainingSetup(model="tiny-llama", gpus=8, seq_len=64, reshard_after_forward=8)
    with pytest.raises(LlmemError) as err:
        from llmem.planner.options import PlanOptions

        plan(setup, PlanOptions(methods=("fsdp",), layouts="dp-tp"))
    text = str(err.value)
    assert text.startswith("--reshard-after-forward 8 must divide FSDP2's 8 shard ranks")
    assert text.endswith("choose 2 or 4 (no layout could be estimated: fsdp (8))")
    assert "time model" not in text and "fits:" not in text      # the plan's notes are not the reason


def test_plan_error_puts_the_plain_layouts_reason_before_the_scale_out_ones(capsys):
    """With pipeline and context-parallel layouts refused for their own reasons, the dp x tp layout's comes first."""
    assert main(["plan", "tiny-llama", "--gpus", "8", "--seq-len", "64", "--method", "fsdp",
                 "--reshard-after-forward", "8"]) == 2
    err = _one_line_error(capsys)
    assert err.startswith("llmem: error: --reshard-after-forward 8 must divide FSDP2's 8 shard ranks")
    assert "choose 2 or 4 (fsdp (8)); no other layout could be estimated either: " in err
    assert err.index("choose 2 or 4") < err.index("with --pp")


def test_reasons_that_differ_only_in_the_refused_method_are_one():
    """A DeepSpeed-only option refused on every method: one reason naming each method once, then the layouts;
    ds-zero2, fsdp+tp and --tp inside a reason are not taken for the method's name."""
    from llmem.planner.plan import no_layout_message
    from llmem.setup.layout import candidate_layouts

    lays = {lay.label: lay for lay in candidate_layouts(4, None, 8, 8)}
    why = "--overlap-comm is a DeepSpeed ZeRO setting: use --method ds-zero1, ds-zero2 or ds-zero3 (got {})"
    failures = {why.format(lay.method): [lay] for lay in lays.values()}
    assert no_layout_message(failures) == (
        why.format("ddp, fsdp, zero2, tp, fsdp+tp")
        + " (no layout could be estimated: ddp (4), fsdp (4), zero2 (4), tp (4), fsdp+tp (2dp x 2tp))")
    tp_only = {"--tp 4 needs heads divisible by 4: choose --tp 2 (tp)": [lays["tp (4)"]],
               "--tp 4 needs heads divisible by 4: choose --tp 2 (fsdp+tp)": [lays["fsdp+tp (2dp x 2tp)"]]}
    assert no_layout_message(tp_only).startswith("--tp 4 needs heads divisible by 4: choose --tp 2 (tp, fsdp+tp) (")

