"""A vision-language set-up's what-ifs: those its step does not wire (llmem.model.vision_inputs.unwired_options:
the fused loss, activation offloading, the optimizer in backward or on the host, checkpointing every other layer,
a quantised base, FSDP2's CPU offload) are not searched (llmem.planner.suggestions.fitting.applied refuses them);
each is reported instead, with the reason, so the plan says why it did not propose it."""

from __future__ import annotations

from dataclasses import replace

from llmem.errors import LlmemError
from llmem.planner.suggestions.fitting import vision_refusal
from llmem.planner.suggestions.record import suggestion_dict
from llmem.setup.training import TrainingSetup

# (kind, flags, changes) of a what-if
WhatIf = tuple[str, str, tuple[tuple[str, object], ...]]


def not_modelled(setup: TrainingSetup, what_ifs: list[WhatIf]) -> list[dict]:
    """One suggestion per what-if of `setup` that a vision-language step does not wire: its kind, "not modelled for
    a vision-language model" with the reason in words, fits False, modelled False ([] for a text set-up)."""
    out = []
    for kind, flags, changes in what_ifs if setup.images_per_sample else ():
        try:
            why = vision_refusal(replace(setup, **dict(changes)))
        except LlmemError:        # refused by the set-up's own validation: not proposed, for any model
            continue
        if why is not None:
            out.append(suggestion_dict(kind, f"{flags}: not modelled for a vision-language model ({why})", None,
                                       flags=flags, modelled=False))
    return out
