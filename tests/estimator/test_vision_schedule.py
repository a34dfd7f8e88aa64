"""The vision side in the step schedule (llmem.estimator.schedule.vision) on a hand-made learned side: the forward
and backward played in order, the workspace at its place, a gradient handed to the parameter it belongs to."""

from __future__ import annotations

from types import SimpleNamespace

from llmem.estimator.events import Schedule
from llmem.estimator.schedule.vision import VisionEvents
from llmem.memory.activations.learned_vision import LearnedPiece, LearnedVision, Op, VisionStep

ACT = "activations"
WEIGHT = "model.visual.blocks.0.mlp.up_proj.weight"


class _Step:
    """What VisionEvents reaches through the step: its facts, its schedule, the gradient and workspace hooks."""

    def __init__(self, side: LearnedVision, units: tuple[str, ...] = ()) -> None:
        self.param = SimpleNamespace(name=WEIGHT, trainable=True)
        act = SimpleNamespace(vision=VisionStep((80, 4000, 240), ("model.visual",), side, "model.visual", units))
        self.facts = SimpleNamespace(act=act, root=[self.param], vision_params=frozenset({WEIGHT}), reshard=True,
                                     vision_units={u: [self.param] for u in units})
        self.sch = Schedule()
        self.handed: list[tuple[str, int]] = []
        self.workspaces = 0
        self.calls: list[tuple[str, object]] = []      # FSDP2's unit events, in order (the FsdpUnits stand-in's too)
        self.live = SimpleNamespace(pending_rs=[])

    def unshard_forward(self, key, unit) -> None:
        self.calls.append(("unshard_forward", key))

    def reshard_unit(self, key) -> None:
        self.calls.append(("reshard", key))

    def unshard_backward(self, key, unit) -> None:
        self.calls.append(("unshard_backward", key))

    def prefetch(self, key, unit) -> None:
        self.calls.append(("prefetch", key))

    def unit_post_backward(self, key, unit) -> None:
        self.calls.append(("post_backward", key))

    def flush_steps(self, it: int) -> None:
        pass

    def hand_over_grad(self, p, key: int) -> None:
        self.handed.append((p.name, key))

    def ensure_workspace(self) -> None:
        self.workspaces += 1


def _side() -> LearnedVision:
    pieces = (LearnedPiece("patch_embed", "patch_embed", (100,), (ACT,)),
              LearnedPiece("blocks.0", "blocks.0", (200, 300), (ACT, "gathered_weights")))
    forward = ((Op.KEEP, 0, 0, 0, ""), (Op.TEMP, 1, 7, 50, ACT), (Op.WORKSPACE, -1, 0, 0, ""), (Op.KEEP, 1, 0, 0, ""),
               (Op.FREE, -1, 7, 0, ""), (Op.KEEP, 1, 1, 0, ""))
    backward = ((Op.TEMP, -1, 8, 64, ACT), (Op.GRAD, 1, 0, 400, WEIGHT), (Op.FREE_KEPT, 1, 1, 0, ""), (Op.FREE_KEPT, 1, 0, 0, ""),
                (Op.FREE, -1, 8, 0, ""), (Op.TEMP, 0, 9, 32, ACT), (Op.FREE_KEPT, 0, 0, 0, ""), (Op.LATE, -1, 9, 0, ""))
    return LearnedVision(pieces, forward, backward)


def _sizes(sch: Schedule) -> list[int]:
    """The events as signed sizes: +n made, -n freed."""
    made: dict[int, int] = {}
    out = []
    for sign, key, size, _stream, _cat in sch.events:
        made.setdefault(key, size)
        out.append(sign * made[key])
    return out


def test_forward_and_backward_play_the_learned_ops():
    step = _Step(_side())
    ev = VisionEvents(step, step)
    ev.batch()
    ev.forward()
    late = ev.backward(0)
    step.sch.free_all(late)
    assert _sizes(step.sch) == [80, 4000, 240,                       # the batch
                                100, 50, 200, -50, 300,              # forward: kept, temporary, kept, freed, kept
                                64, 400, -300, -200, -64, 32, -100,  # backward: scatter, gradient, blocks' tensors
                                -32]                                 # freed after the embedding's gradient
    assert step.workspaces == 1 and step.handed == [(WEIGHT, step.sch.events[9][1])]
    assert step.sch.events[7][4] == "gathered_weights"


def test_fsdp2_gathers_a_block_around_its_own_ops():
    """FSDP2 with blocks.0 a unit of its own: its pre-forward (all-gather) at its first kept tensor, its post-forward
    (reshard) when the next piece allocates, or at the tower's end; in backward its pre-backward at its gradient
    (the first block to run backward: nothing before it to prefetch), its post-backward (reshard, reduce-scatter)
    as the patch embedding's backward allocates; nothing left for the root's final callback."""
    step = _Step(_side(), units=("model.visual.blocks.0",))
    ev = VisionEvents(step, step)
    ev.forward()
    assert step.calls == [("unshard_forward", "model.visual.blocks.0"), ("reshard", "model.visual.blocks.0")]
    # the unit is entered at the forward's second event (piece 1's temporary), after the patch embedding's kept one
    step.calls.clear()
    ev.backward(0)
    ev.units.final_callback()
    assert step.calls == [("unshard_backward", "model.visual.blocks.0"), ("post_backward", "model.visual.blocks.0")]
