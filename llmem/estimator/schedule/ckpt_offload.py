"""--ckpt-offload in the step schedule: what a library's offloaded checkpoint (Unsloth's autograd Functions, sized by
llmem.memory.activations.ckpt_offload) does on the device around each checkpointed decoder layer.

The layers' hidden states are laid out as they are: `ForwardLive.passed` is the current layer's input (the previous
layer's output, or a trained embedding's output; a frozen embedding's is the leaf laid out apart). A layer that
offloads lets its input die once it has run; one that does not keeps it (`ckpt_keys`) until its backward, as torch's
reentrant checkpoint does. In backward an offloaded layer's input comes back, into a staging buffer (no new block)
or as a new device tensor held until the layer's backward returns.
"""

from __future__ import annotations

from llmem.estimator.schedule.state import StepState
from llmem.setup.checkpointing import UNSLOTH_INITIAL_GPU_BUFFER


class CkptOffloadEvents:
    """The offloaded checkpoint's events for one step schedule (its staging buffers live across iterations)."""

    def __init__(self, facts, sch, state: StepState) -> None:
        self.f, self.sch, self.state = facts, sch, state
        self.b_grown = False     # GPU_BUFFERS_B grown to the stored bytes (double buffering on, from step 2)

    def offloads(self, i: int) -> bool:
        oc = self.f.ckpt_offload
        return oc.offloads(i, self.f.layers - 1, self.state.iteration)

    def before_layer(self, i: int) -> None:
        """UnslothCheckpointFunction.forward before it runs the layer: the staging buffers at the first offload
        (made at 2 MiB, the first grown by resize_: a new block, then the old one freed; the second grown from the
        second step on), and an fp32 input's bf16 temporary for its copy to the host."""
        oc, sch = self.f.ckpt_offload, self.sch
        if not self.offloads(i):
            return
        if oc.staged:
            staging = self.state.staging
            if not staging:
                first = sch.alloc(UNSLOTH_INITIAL_GPU_BUFFER, "activations")
                staging.append(sch.alloc(UNSLOTH_INITIAL_GPU_BUFFER, "activations") if oc.row.staging > 1 else -1)
                staging.insert(0, sch.alloc(oc.staging_bytes, "activations"))
                sch.free(first)
            elif self.state.iteration > 0 and oc.row.staging > 1 and not self.b_grown:
                grown = sch.alloc(oc.staging_bytes, "activations")
                sch.free(staging[1])
                staging[1], self.b_grown = grown, True
        if oc.cast_bytes:
            sch.free(sch.alloc(oc.cast_bytes, "activations"))

    def after_layer(self, i: int, out: int) -> None:
        """The layer has returned `out`: its input dies if it went to the host, else the checkpoint keeps it."""
        fwd = self.state.forward
        if self.offloads(i):
            self.sch.free(fwd.passed)
        else:
            fwd.ckpt_keys[i] = fwd.passed     # (-1: a frozen embedding's output, laid out apart)
        fwd.passed = out

    def reload(self, i: int) -> None:
        """An offloaded layer's input back for its recompute: the device tensor the backward makes, if any, held
        where the checkpoint's saved input is (freed when the layer's backward returns)."""
        if not self.offloads(i):
            return
        act = self.f.act
        first = act.blocks[0].tensors[:1] if act.blocks else ()
        n = self.f.ckpt_offload.reload_bytes(first == (act.ckpt_input_bytes,))
        self.state.forward.ckpt_keys[i] = self.sch.alloc(n, "activations") if n else -1
