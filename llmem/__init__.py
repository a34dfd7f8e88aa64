"""llmem: how much GPU memory fine-tuning an LLM takes, per GPU and per distributed method, before you start.

    import llmem
    result = llmem.estimate("meta-llama/Llama-3.1-8B", method="fsdp", gpus=4, seq_len=4096, batch_size=1)
    result.peak_reserved_bytes, result.components, result.fits
"""

from __future__ import annotations

from typing import Any

from llmem.config import TrainingSetup
from llmem.errors import LlmemError
from llmem.result import MemoryResult

__all__ = ["TrainingSetup", "MemoryResult", "LlmemError", "estimate", "trace", "measure"]
__version__ = "0.1.0"


def _setup(model: str | TrainingSetup, options: dict[str, Any]) -> TrainingSetup:
    if isinstance(model, TrainingSetup):
        return model
    from llmem.methods import canonical_method

    if "method" in options:
        options["method"] = canonical_method(options["method"])
    elif options.get("gpus", 1) > 1:
        options["method"] = "fsdp"
    return TrainingSetup(model=model, **options)


def estimate(model: str | TrainingSetup, **options: Any) -> MemoryResult:
    """Fast analytic per-GPU estimate. `options` are TrainingSetup fields (method, gpus, batch_size, ...)."""
    from llmem.estimator import estimate as _estimate

    return _estimate(_setup(model, options))


def trace(model: str | TrainingSetup, **options: Any) -> MemoryResult:
    """The real training step on fake tensors, replayed through a model of the CUDA caching allocator."""
    from llmem.tracer import trace as _trace

    return _trace(_setup(model, options))


def measure(model: str | TrainingSetup, **options: Any) -> MemoryResult:
    """The real training step on a real device (CUDA if available, else CPU)."""
    from llmem.measure import measure as _measure

    return _measure(_setup(model, options))
