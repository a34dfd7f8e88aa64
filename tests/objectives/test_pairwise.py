"""--objective orpo / simpo / reward: TRL's pairwise trainers without a reference, laid out in the estimator's
schedule (llmem.estimator.pairwise), checked on tiny-llama's sizes worked by hand (hidden 512, vocab 32000, 4
layers; 2 pairs of 200 tokens: R = 4 rows, no size equal to a [32000, 512] weight's), the tensors as TRL's own loss
code allocates them in the trace (its ledger shows them at these sizes), the reward model's anatomy, the refusals,
and the registry's defaults against the installed trl's config classes."""

from __future__ import annotations

import re

import pytest

from llmem.errors import LlmemError
from llmem.estimator.schedule import StepSchedule
from llmem.memory.activations.profile import activation_profile
from llmem.model.resolved import resolve
from llmem.setup.objectives import CPO_SIMPO_DEFAULTS, OBJECTIVES, SIMPO_LOSS_TYPES
from llmem.setup.training import TrainingSetup

V, H, R, S = 32000, 512, 4, 200
TINY_LLAMA_PARAMS = 2 * V * H + 4 * (4 * H * H + 3 * H * 1376 + 2 * H) + H


def pairs(objective: str, **kw) -> TrainingSetup:
    return TrainingSetup(**{"model": "tiny-llama", "gpu": "H100-80GB", "objective": objective, "batch_size": 2,
                            "seq_len": S, "precision": "bf16-mixed", "optimizer": "sgd", **kw})


def events(setup: TrainingSetup, start: str = "it0:forward", end: str = "it0:optimizer_step") -> list[tuple[int, int]]:
    """(sign, bytes) of the first iteration's events from the phase or mark `start` to `end`."""
    r = resolve(setup)
    s = StepSchedule(r, activation_profile(r))
    s.build()
    points = [*s.sch.phase_starts, *s.sch.marks]
    a = min(i for i, w in points if w == start)
    b = min(i for i, w in points if w == end and i > a)
    return [(sign, size) for sign, _k, size, _st, _c in s.sch.events[a:b]]


@pytest.mark.parametrize("objective", ["orpo", "simpo"])
def test_full_logits_tensors(objective):
    """From the lm_head to the last decoder layer's backward: the bf16 logits [4, 200, 32000] cast to fp32
    (accelerate's convert_outputs_to_fp32); the chosen rows' shifted copy and log_softmax [2 x 199, 32000] fp32;
    in backward the kernel's gradient [4, 199, 32000] fp32, then [4, 200, 32000] fp32 three times (SliceBackward's
    zeros twice, their sum), the NLL's and log_softmax's gradients [2 x 199, 32000] fp32, SliceBackward's
    [2, 200, 32000] fp32, the sum's bf16 cast."""
    head = [n for sign, n in events(pairs(objective), "lm_head and loss", "layer 3") if sign > 0]
    # [4, 200, V] in bf16 has the bytes of [2, 200, V] in fp32 (the chosen rows' SliceBackward): three of them
    for n, count in ((R * S * V * 2, 3), (R * S * V * 4, 4), (2 * (S - 1) * V * 4, 4), (R * (S - 1) * V * 4, 1)):
        assert head.count(n) == count, n


def test_loss_backward_holds_three_full_gradients():
    """The loss backward's largest moment is the sum of the logits' two [4, 200, 32000] fp32 gradients: three of
    them live, the fp32 logits, their log_softmax [2 x 199, 32000], the saved targets and index (int64) and the
    kernel's two fp32 statistics per token released."""
    held = peak = 0
    for sign, n in events(pairs("orpo"), "it0:backward", "layer 3"):
        held += sign * n
        peak = max(peak, held)
    assert peak == 2 * R * S * V * 4 - 2 * (S - 1) * V * 4 - R * (S - 1) * (8 + 2 * 4) - 2 * (S - 1) * 8


def test_reward_model_has_a_score_head():
    """AutoModelForSequenceClassification(num_labels=1): the lm_head [32000, 512] gives way to the score [1, 512],
    and no tensor of the step is vocabulary-sized but the embedding's gradient [32000, 512] fp32."""
    anatomy = resolve(pairs("reward")).anatomy
    assert anatomy.architecture == "LlamaForSequenceClassification"
    assert anatomy.total_params == TINY_LLAMA_PARAMS - V * H + H == 29_037_568
    assert not any(p.name.startswith("lm_head") for p in anatomy.params)
    assert max(n for _sign, n in events(pairs("reward"), "it0:forward", "it1:forward")) == V * H * 4


@pytest.mark.parametrize(("fields", "message"), [
    ({"objective": "orpo", "loss_type": "ipo"}, "ORPOTrainer has no loss_type"),
    ({"objective": "simpo", "loss_type": "sigmoid"}, "unknown --loss-type"),
    ({"objective": "simpo", "precompute_ref_log_probs": True}, "has no reference model"),
    ({"objective": "orpo", "ref_dtype": "compute"}, "--ref-dtype"),
    ({"objective": "reward", "lora_rank": 8}, "drop --lora-rank"),
    ({"objective": "reward", "prompt_len": 8}, "drop it"),
    ({"objective": "orpo", "fused_ce": True}, "--fused-ce"),
    ({"objective": "simpo", "method": "ds-zero3", "gpus": 2, "offload_param": True}, "under DeepSpeed"),
])
def test_refusals(fields, message):
    with pytest.raises(LlmemError, match=re.escape(message)):
        pairs(**fields)


def test_defaults_are_the_installed_trls():
    pytest.importorskip("trl")
    from dataclasses import fields

    from trl.experimental.cpo import CPOConfig
    from trl.experimental.orpo import ORPOConfig
    from trl.trainer.reward_config import RewardConfig

    for name, cls in (("orpo", ORPOConfig), ("simpo", CPOConfig), ("reward", RewardConfig)):
        config = {f.name: f for f in fields(cls)}
        spec = OBJECTIVES[name]
        assert config["max_length"].default == spec.max_length
        assert config["disable_dropout"].default is spec.disable_dropout
        assert (config["beta"].default if "beta" in config else None) == spec.beta
        assert "precompute_ref_log_probs" not in config          # no reference model
    cpo = {f.name: f for f in fields(CPOConfig)}
    assert set(SIMPO_LOSS_TYPES) <= set(cpo["loss_type"].metadata["choices"])
    assert {k: cpo[k].default for k in CPO_SIMPO_DEFAULTS} == CPO_SIMPO_DEFAULTS
    assert {f.name: f for f in fields(RewardConfig)}["center_rewards_coefficient"].default is None


def test_cli_commands_are_the_installed_trls():
    pytest.importorskip("trl")
    from trl.cli.commands import get_commands

    names = {c.name for c in get_commands()}
    commands = {spec.cli_command for spec in OBJECTIVES.values() if spec.cli_command}
    assert commands <= names
    for spec in OBJECTIVES.values():      # sft has none: `trl sft` runs SFTTrainer, which is trl-sft's
        assert spec.cli_command or spec.name not in names - commands


def test_estimate_notes_name_the_objective_and_the_reference_cost():
    from llmem.estimator.engine import estimate

    notes = estimate(TrainingSetup(model="tiny-llama", objective="dpo", seq_len=256)).notes
    assert any(n.startswith("--objective dpo: TRL's DPOTrainer") for n in notes)
    cost = next(n for n in notes if n.startswith("the reference copy costs"))
    assert f"{TINY_LLAMA_PARAMS * 4 / 2**30:.2f} GiB" in cost                 # every parameter again, fp32
    assert any("ORPOTrainer" in n for n in estimate(pairs("orpo")).notes)
