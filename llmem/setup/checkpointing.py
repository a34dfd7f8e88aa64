"""The activation-checkpointing policies (--ac-policy): what a checkpointed decoder layer keeps for backward, one row
each. Nothing here knows torch: the trace's policy is llmem.runtime.selective_ac, the estimate's arithmetic
llmem.memory.activations.selective."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmem.errors import LlmemError


@dataclass(frozen=True, kw_only=True)
class AcPolicy:
    """One way to checkpoint a decoder layer."""
    name: str
    saves: str                  # what a checkpointed layer keeps between its forward and its backward
    selective: bool = False     # op-level selective checkpointing (torch's create_selective_checkpoint_contexts)
    refusal: str | None = None  # why llmem cannot model it (the one line a user gets)


AC_POLICIES: dict[str, AcPolicy] = {p.name: p for p in (
    AcPolicy(name="full", saves="the layer input only; the whole layer is recomputed in backward (torch.utils.checkpoint)"),
    # torchtitan/distributed/activation_checkpoint.py, _apply_op_sac with _op_sac_save_list
    AcPolicy(name="op", selective=True,
             saves="torchtitan's op-level selective checkpointing: the layer input plus the outputs of every other "
                   "aten.mm (the 1st, 3rd, ... in forward order), of SDPA (output, logsumexp and the kernel's RNG "
                   "state), of aten.max / aten.abs and reduce_scatter; the rest is recomputed"),
    AcPolicy(name="memory-budget", saves="torch._functorch.config.activation_memory_budget",
             refusal="--ac-policy memory-budget (torch._functorch.config.activation_memory_budget) is decided by "
                     "torch.compile's min-cut partitioner, which llmem does not run: use --ac-policy op or full"),
)}


def ac_policy(name: str) -> AcPolicy:
    """The row of --ac-policy NAME, or the one line saying why it cannot be used."""
    row = AC_POLICIES.get(name)
    if row is None:
        raise LlmemError(f"unknown --ac-policy {name!r}: choose one of "
                         f"{', '.join(n for n, p in AC_POLICIES.items() if p.refusal is None)}")
    if row.refusal:
        raise LlmemError(row.refusal)
    return row


# the options llmem models only over the non-reentrant checkpoint, refused beside --ckpt-reentrant:
# (flag, field, whether the field's value asks for it, why)
REENTRANT_REFUSED: tuple[tuple[str, str, Callable[[Any], bool], str], ...] = (
    ("--ac-policy op", "ac_policy", lambda v: v in AC_POLICIES and AC_POLICIES[v].selective,
     "torch's selective checkpointing (context_fn) runs only in the non-reentrant checkpoint"),
    ("--offload-activations", "offload_activations", bool, "save_on_cpu around the reentrant checkpoint is not modelled"),
    ("--compile", "compile", bool, "the compiled layer is learned under the non-reentrant checkpoint"),
    ("--images-per-sample", "images_per_sample", bool,
     "a vision encoder's checkpointing is learned under the non-reentrant checkpoint"),
)


def reentrant_refusal(value: Callable[[str], Any]) -> tuple[str, str] | None:
    """The first option REENTRANT_REFUSED holds that a set-up asks for, as (flag, why), each field read through
    `value` (a TrainingSetup's attribute, or a config file's value before the set-up is built); None: none."""
    return next(((flag, why) for flag, name, given, why in REENTRANT_REFUSED if given(value(name))), None)


# --ckpt-offload: checkpointing whose saved layer input leaves the device between forward and backward, as an
# autograd Function of a library's runs it (llmem.memory.activations.ckpt_offload sizes it, llmem.runtime.unsloth_ckpt
# traces it). unsloth_zoo 2026.10.9, unsloth_zoo/gradient_checkpointing.py:
UNSLOTH_MINIMUM_SIZE = 2 * 1024 * 1024            # MINIMUM_SIZE: a layer input of at most 2 MiB stays on the device
UNSLOTH_INITIAL_GPU_BUFFER = 2 * 256 * 2048 * 2   # INITIAL_GPU_BUFFER_SIZE elements of bf16 / fp16: 2 MiB
UNSLOTH_INITIAL_CPU_BUFFERS = 200 * 128 * 1024 * 2  # INITIAL_CPU_BUFFER_COUNT x INITIAL_CPU_BUFFER_SIZE, pinned
UNSLOTH_DOUBLE_BUFFER_HEADROOM = 512 * 1024 * 1024  # DOUBLE_BUFFER_HEADROOM: free memory to double-buffer


@dataclass(frozen=True, kw_only=True)
class CkptOffload:
    """One offloaded checkpoint: what each checkpointed decoder layer keeps, and where."""
    name: str
    function: str             # the autograd Function that checkpoints a layer (file:class)
    saves: str                # what a checkpointed layer keeps and where (the one line of --help and the notes)
    staging: int = 0          # device staging buffers the reload lands in (GPU_BUFFERS, GPU_BUFFERS_B); 0: the
                              # reload is a new device tensor (`.to("cuda")`) held until the layer's backward returns
    min_bytes: int = 0        # a layer input whose stored bytes are at most this stays on the device (MINIMUM_SIZE)
    keeps_last: bool = False  # from the second step on the last checkpointed layer's input stays on the device
    bf16_store: bool = False  # an fp32 layer input is stored as bf16 (cast back to fp32 for the recompute)

    @property
    def active(self) -> bool:
        """Whether a library's Function checkpoints the layers (False: the row of torch's own checkpoint)."""
        return bool(self.function)


CKPT_OFFLOADS: dict[str, CkptOffload] = {o.name: o for o in (
    CkptOffload(name="none", function="", saves="the checkpoint keeps each layer's input on the device"),
    CkptOffload(name="unsloth", function="unsloth_zoo/gradient_checkpointing.py:UnslothCheckpointFunction",
                staging=2, min_bytes=UNSLOTH_MINIMUM_SIZE, keeps_last=True, bf16_store=True,
                saves="Unsloth's smart offloading (use_gradient_checkpointing=\"unsloth\", unsloth_zoo 2026.10): each "
                      "checkpointed layer's input over 2 MiB copied to pinned host memory, copied back in backward "
                      "into two device staging buffers the size of the largest input (the second from the second "
                      f"step on, where more than {UNSLOTH_DOUBLE_BUFFER_HEADROOM >> 20} MiB is free); the last "
                      "layer's input stays on the device from the second step on"),
    CkptOffload(name="unsloth-single", function="unsloth_zoo/gradient_checkpointing.py:UnslothCheckpointFunction",
                staging=1, min_bytes=UNSLOTH_MINIMUM_SIZE, keeps_last=True, bf16_store=True,
                saves="--ckpt-offload unsloth with one staging buffer (UNSLOTH_DISABLE_DOUBLE_BUFFER=1, or an "
                      "integrated GPU)"),
    CkptOffload(name="unsloth-classic",
                function="unsloth_zoo/gradient_checkpointing.py:Unsloth_Offloaded_Gradient_Checkpointer",
                saves="Unsloth's first offloaded checkpoint, as LLaMA-Factory's use_unsloth_gc and axolotl's "
                      "activation_offloading: legacy copy it: every checkpointed layer's input to host memory, "
                      "copied back to a new device tensor for its recompute"),
)}


def ckpt_offload(name: str) -> CkptOffload:
    """The row of --ckpt-offload NAME."""
    row = CKPT_OFFLOADS.get(name)
    if row is None:
        raise LlmemError(f"unknown --ckpt-offload {name!r}: choose one of {', '.join(CKPT_OFFLOADS)}")
    return row
