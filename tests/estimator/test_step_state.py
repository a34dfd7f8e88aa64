"""The step schedule's live state (llmem.estimator.schedule.state.StepState) against bytes worked out by hand on
tiny-llama, and the narrow protocol (llmem.estimator.schedule.hooks.StepHooks) the objectives' events keep to."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from llmem.estimator.schedule import StepHooks, StepSchedule
from llmem.memory.activations.profile import activation_profile
from llmem.model.resolved import resolve
from llmem.setup.training import TrainingSetup

# tiny-llama: the embedding and the lm_head 32000 x 512 (untied), 4 layers of q, k, v, o 512 x 512, gate, up,
# down 512 x 1376 and two norms, the final norm
EMBEDDING = 32000 * 512
PARAMS = 2 * EMBEDDING + 4 * (4 * 512 * 512 + 3 * 512 * 1376 + 2 * 512) + 512
ESTIMATOR = Path(__file__).resolve().parents[2] / "llmem" / "estimator"


def _schedule(**kw) -> StepSchedule:
    r = resolve(TrainingSetup(model="tiny-llama", gpu="H100-80GB", batch_size=1, seq_len=64, **kw))
    return StepSchedule(r, activation_profile(r))


def _live(s: StepSchedule, keys) -> int:
    return sum(s.sch.size_of(k) for k in keys)


def test_after_backward_only_weights_gradients_and_the_workspace_are_live():
    """fp32 full fine-tuning on one GPU: after the first backward every activation is freed; what is live is the
    fp32 weights, one fp32 gradient per parameter (StepState.grads) and cuBLAS's workspace."""
    s = _schedule(precision="fp32")
    s.setup_phase()
    s.forward(0)
    s.backward(0)
    assert PARAMS == 45_421_056
    assert _live(s, s.state.grads.grads.values()) == PARAMS * 4
    assert s.sch.live_bytes == 2 * PARAMS * 4 + s.sch.size_of(s.state.workspace)
    assert s.sch.size_of(s.state.workspace) == s.facts.workspace_bytes > 0


def test_after_the_step_the_gradients_are_gone_and_adam_keeps_two_states():
    """optimizer.step() makes AdamW's exp_avg and exp_avg_sq (fp32, one each per parameter) at the first step;
    zero_grad(set_to_none=True) frees every gradient."""
    s = _schedule(precision="fp32")
    s.build(iterations=1)
    assert s.state.grads.grads == {}
    assert _live(s, s.state.states) == 2 * PARAMS * 4 == 363_368_448
    assert s.sch.live_bytes == 3 * PARAMS * 4 + s.facts.workspace_bytes


def test_fsdp_keeps_only_the_root_unit_gathered_after_forward():
    """FSDP2 on 2 GPUs, bf16-mixed: after the forward each decoder layer is resharded, the root stays gathered
    (reshard_after_forward applies to the layers' units only: fully_shard's root default), its embedding,
    lm_head and final norm in bf16."""
    s = _schedule(precision="bf16-mixed", method="fsdp", gpus=2)
    s.setup_phase()
    s.forward(0)
    gathered = s.state.units.gathered
    assert list(gathered) == [None]
    assert _live(s, gathered[None]) == (2 * EMBEDDING + 512) * 2 == 65_537_024
    assert s.state.units.last_forward_ag == []           # the root's post-forward freed the last all-gather output


def _members(path: Path) -> set[str]:
    """The names the file's event classes read off the schedule (`s.x`, `self.s.x`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "s":
            found.add(node.attr)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "s" and isinstance(node.value.value, ast.Name) and node.value.value.id == "self":
            found.add(node.attr)
    return found


def test_objective_events_use_only_the_protocol():
    """PreferenceEvents, GenerationEvents and PairwiseEvents reach the schedule through StepHooks alone."""
    source = (ESTIMATOR / "schedule" / "hooks.py").read_text()
    protocol = set(re.findall(r"^    def (\w+)\(", source, re.M)) | set(re.findall(r"^    (\w+): ", source, re.M))
    assert {"facts", "sch", "make_grad", "reference_fetch"} <= protocol
    assert all(hasattr(StepHooks, name) or name in StepHooks.__annotations__ for name in protocol)
    for name in ("objectives.py", "generation.py", "pairwise.py"):
        used = _members(ESTIMATOR / name)
        assert used and used <= protocol, (name, used - protocol)
