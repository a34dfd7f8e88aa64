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
