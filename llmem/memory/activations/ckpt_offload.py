"""--ckpt-offload: the sizes of a library's offloaded checkpoint (a row of llmem.setup.checkpointing.CKPT_OFFLOADS)
for one set-up: which checkpointed layers send their input to the host, the device staging buffers the reload lands
in, the device copy the backward makes for the recompute, and the host memory it all takes.

Unsloth's smart offloading, as unsloth_zoo 2026.10.9 writes it (unsloth_zoo/gradient_checkpointing.py,
UnslothCheckpointFunction, installed by patch_unsloth_smart_gradient_checkpointing as torch's and transformers'
checkpoint, use_reentrant forced True), per checkpointed decoder layer whose first argument requires grad:

- forward: the layer input's stored bytes (numel x 2 for an fp32 input, stored as bf16; its own bytes otherwise)
  over MINIMUM_SIZE (2 MiB), and the layer not the last one counted in the first forward (LAST_GC_INDEX; every
  layer offloads in the first step, FIRST_PASS), go to the host: CPU_BUFFERS' slot, pinned, grown to the stored
  bytes. The device side: the first offload makes GPU_BUFFERS[dev] (INITIAL_GPU_BUFFER_SIZE = 2 MiB) and, unless
  double buffering is off, GPU_BUFFERS_B[dev] (2 MiB), then resize_s GPU_BUFFERS[dev] to the stored bytes (a new
  block, the old freed); from the second step on, where more than 512 MiB is free at the first offload,
  GPU_BUFFERS_B[dev] grows to the stored bytes too (else it is freed). An fp32 input's non-blocking copy to a bf16
  host view converts on the device first (a bf16 temporary, freed after the copy). The layer runs under no_grad and
  its input is not saved: it dies once the layer has returned (a frozen embedding's output, a leaf AccumulateGrad
  holds, stays). A layer that does not offload saves its input as torch's reentrant checkpoint does.
- backward: the host copy goes into a staging buffer (alternating between the two), a view: no allocation; an fp32
  input is cast back (`buffer.to(float32)`, a new device tensor) and held until the layer's backward returns; the
  recompute and the layer's backward are torch's reentrant checkpoint's.

Unsloth's first offloaded checkpoint (Unsloth_Offloaded_Gradient_Checkpointer, as LLaMA-Factory 0.9.5's
use_unsloth_gc and axolotl 0.19's activation_offloading: legacy copy it): every checkpointed layer's input
`.to("cpu")`; the backward's `.to("cuda")` is a new device tensor in the input's dtype, held until the layer's
backward returns. No staging buffers, no threshold, no kept last layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.setup.checkpointing import (
    UNSLOTH_INITIAL_CPU_BUFFERS,
    UNSLOTH_INITIAL_GPU_BUFFER,
    CkptOffload,
    ckpt_offload,
)


@dataclass(frozen=True)
class OffloadedCheckpoint:
    """An offloaded checkpoint's sizes for one set-up, in bytes per GPU."""
    row: CkptOffload
    input_bytes: int      # a checkpointed layer's input on the device ([batch, seq, hidden], the stream's dtype)
    element_bytes: int    # the stream's bytes per element

    @property
    def stored_bytes(self) -> int:
        """The input's bytes as the Function stores them: an fp32 input as bf16 where the row says so
        (UNSLOTH_OFFLOAD_FP32's default), else as it is."""
        if self.row.bf16_store and self.element_bytes == 4:
            return self.input_bytes // 2
        return self.input_bytes

    @property
    def staged(self) -> bool:
        return self.row.staging > 0

    def offloads(self, layer: int, last: int, iteration: int) -> bool:
        """Whether checkpointed decoder layer `layer` (of `last` + 1) sends its input to the host in iteration
        `iteration` (0: the first step, FIRST_PASS)."""
        if self.stored_bytes <= self.row.min_bytes:
            return False
        return not (self.row.keeps_last and iteration > 0 and layer == last)

    @property
    def staging_bytes(self) -> int:
        """Each staging buffer once grown (GPU_BUFFERS[dev].resize_ to the stored bytes; bf16 / fp16 elements)."""
        return max(self.stored_bytes, UNSLOTH_INITIAL_GPU_BUFFER) if self.staged else 0

    @property
    def cast_bytes(self) -> int:
        """The device temporary of an fp32 input's copy to its bf16 host view (the CUDA copy kernel converts on the
        device before a non-blocking device-to-host copy)."""
        return self.stored_bytes if self.stored_bytes != self.input_bytes else 0

    def reload_bytes(self, first_tensor_is_input: bool) -> int:
        """The device tensor the backward makes for an offloaded layer's recompute, held until the layer's backward
        returns: the classic Function's `.to("cuda")` copy, Unsloth's cast back to fp32 (none where the recompute
        reads the staging buffer's view). 0 where the recompute's first kept tensor is that input itself (an fp32
        stream's norm keeps its input: the schedule's block lays it out)."""
        made = self.input_bytes if not self.staged or self.cast_bytes else 0
        return 0 if first_tensor_is_input else made

    def host_bytes(self, checkpointed_layers: int) -> int:
        """Host memory the offloaded inputs take at most (the first step, when every layer offloads): one slot of
        the stored bytes per layer, pinned; Unsloth also pins its 200 initial 256 KiB slots."""
        if self.stored_bytes <= self.row.min_bytes:
            return UNSLOTH_INITIAL_CPU_BUFFERS if self.staged else 0
        initial = max(UNSLOTH_INITIAL_CPU_BUFFERS - checkpointed_layers * 256 * 1024, 0) if self.staged else 0
        return checkpointed_layers * self.stored_bytes + initial


def offloaded_checkpoint(name: str, input_bytes: int, element_bytes: int) -> OffloadedCheckpoint | None:
    """The sizes of --ckpt-offload `name` over layer inputs of `input_bytes` (None: --ckpt-offload none)."""
    row = ckpt_offload(name)
    return OffloadedCheckpoint(row, input_bytes, element_bytes) if row.active else None


def ckpt_offload_note(oc: OffloadedCheckpoint, checkpointed_layers: int) -> str:
    """The estimate's line on an offloaded checkpoint: which layers' inputs leave the device, the staging buffers,
    the host memory."""
    gib = 2 ** 30
    if oc.stored_bytes <= oc.row.min_bytes:
        return (f"--ckpt-offload {oc.row.name}: each layer input is {oc.stored_bytes / 2**20:.2f} MiB, not over "
                "Unsloth's MINIMUM_SIZE (2 MiB): nothing is offloaded, every checkpointed layer keeps its input on "
                "the device as torch's reentrant checkpoint does")
    staged = (f"; {oc.row.staging} device staging buffer{'s' if oc.row.staging > 1 else ''} of "
              f"{oc.staging_bytes / 2**20:.1f} MiB" if oc.staged else "")
    kept = "; the last layer keeps its input on the device from the second step on" if oc.row.keeps_last else ""
    return (f"--ckpt-offload {oc.row.name}: {checkpointed_layers} checkpointed layer inputs of "
            f"{oc.stored_bytes / 2**20:.1f} MiB each on the host between forward and backward{staged}{kept}; "
            f"about {oc.host_bytes(checkpointed_layers) / gib:.2f} GiB of pinned host memory per GPU")
