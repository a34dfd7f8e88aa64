"""The answer every engine gives (estimate, paper, trace, measure): three counters and a breakdown.

Counters are named as PyTorch names them:
- peak_allocated: `torch.cuda.max_memory_allocated()`, bytes held by live tensors (512-byte rounded), at the peak.
- peak_reserved:  `torch.cuda.max_memory_reserved()`, bytes the caching allocator holds in segments.
- device_used:    what nvidia-smi shows for the process: peak_reserved + the CUDA context (driver, kernels, handles)
                  + CUDA managed memory resident on the device (paged 8-bit optimizer states).

`components` splits the counters at the moment of peak_allocated. The allocated components sum to peak_allocated;
`allocator_overhead` = peak_reserved - peak_allocated; `cuda_context` + `managed_memory` = device_used - peak_reserved.
So all components sum to device_used.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields

from llmem.setup.record import SetupRecord

# One name per kind of memory, in display order. Engines may leave any at 0.
COMPONENTS = (
    "weights",                 # parameters as stored (sharded under fsdp/tp), fp32 masters under mixed precision
    "gathered_weights",        # FSDP unsharded parameters of the current unit(s); autocast's low-precision copies
    "gradients",
    "optimizer_states",
    "optimizer_temporaries",   # e.g. AdamW foreach's sqrt(exp_avg_sq) copy at the step
    "activations",             # tensors saved for backward and temporaries of forward/backward
    "logits_and_loss",         # lm_head output, its fp32 upcast, log-softmax, their gradients
    "communication_buffers",   # DDP buckets, FSDP all-gather / reduce-scatter buffers, TP collectives
    "cuda_workspaces",         # cuBLAS workspace (taken from the caching allocator)
    "block_rounding",          # whole allocator blocks handed out beyond the tensors' sizes (counted as allocated)
    "allocator_overhead",      # reserved but not allocated: rounding, free blocks in cached segments
    "cuda_context",            # outside the allocator
    "managed_memory",          # outside the allocator: bitsandbytes' paged optimizer states (cudaMallocManaged)
)
ALLOCATED_COMPONENTS = COMPONENTS[:-3]


@dataclass
class MemoryResult:
    engine: str                          # "llmem", "paper", "trace", "measure"
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_used_bytes: int
    gpu_memory_bytes: int
    components: dict[str, int]
    setup: SetupRecord | None = None     # the set-up as resolved (the same record from every engine)
    peak_phase: str = ""                 # forward / backward / optimizer_step
    notes: list[str] = field(default_factory=list)
    timeline: list[dict] | None = None   # trace only: [{t, allocated, reserved, phase}]
    moments: list[dict] = field(default_factory=list)  # estimate: allocated bytes at each candidate peak moment

    @property
    def fits(self) -> bool:
        return self.device_used_bytes <= self.gpu_memory_bytes

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "setup":
                out["setup"] = value.to_dict() if value is not None else {}
            elif not (f.name == "timeline" and value is None):
                out[f.name] = copy.deepcopy(value)      # as dataclasses.asdict copies dicts and lists
        out["fits"] = self.fits
        return out
