"""llmem: how much GPU memory fine-tuning an LLM takes, per GPU and per distributed method, before you start.

    import llmem
    result = llmem.estimate("meta-llama/Llama-3.1-8B", method="fsdp", gpus=4, seq_len=4096, batch_size=1)
    result.peak_reserved_bytes, result.components, result.fits
    llmem.plan("meta-llama/Llama-3.1-8B", gpus=4, seq_len=4096).recommendation
    llmem.estimate(llmem.setup_from_file("qlora.yml", model="meta-llama/Llama-3.1-8B"))

The floors, from the ground up (docs/architecture.md): errors, units, search; setup (the set-up and the
registries of its variants); result; model (anatomy, families, sharding, the resolved set-up); memory (activations,
quantised storage, the allocator model); estimate, paper and runtime (the engines); plan; validate; cli.
"""

from __future__ import annotations

from typing import Any

from llmem.errors import LlmemError
from llmem.result import MemoryResult
from llmem.setup.training import TrainingSetup, user_setup

__all__ = ["TrainingSetup", "MemoryResult", "LlmemError", "estimate", "trace", "measure", "plan", "check",
           "LlmemCallback", "setup_from_file"]
__version__ = "0.1.0"


def _setup(model: Any, options: dict[str, Any]) -> TrainingSetup:
    if isinstance(model, TrainingSetup):
        return model
    if isinstance(getattr(model, "setup", None), TrainingSetup):     # setup_from_file's FileSetup
        return model.setup
    return user_setup(model=model, **options)


def setup_from_file(path: Any, **overrides: Any):
    """The set-up a training config describes (axolotl, LLaMA-Factory, TRL / TrainingArguments, torchtune or
    accelerate YAML, DeepSpeed JSON, torchtitan TOML; a list of paths: a training config and its accelerate config),
    `overrides` (TrainingSetup fields) over the file's values: a FileSetup with `.setup` and `.record` (each key used
    or ignored, and why). Every engine takes it: llmem.estimate(llmem.setup_from_file("qlora.yml"))."""
    from llmem.setup.sources import setup_from_file as _read

    return _read(path, **overrides)


def estimate(model: str | TrainingSetup, *, engine: str = "llmem", m_base: str | int | None = None,
             **options: Any) -> MemoryResult:
    """Fast per-GPU estimate. `options` are TrainingSetup fields (method, gpus, batch_size, ...); `engine` "paper"
    gives LLMem's equations (`m_base`: the memory in use before training)."""
    setup = _setup(model, options)
    if engine == "paper":
        from llmem.model.anatomy import load_anatomy
        from llmem.paper.engine import paper_estimate
        from llmem.setup.gpus import resolve_gpu
        from llmem.units import parse_bytes

        return paper_estimate(setup, load_anatomy(setup.model, setup.trust_remote_code),
                              resolve_gpu(setup.gpu, setup.gpu_memory, setup.cuda_context),
                              m_base_bytes=parse_bytes(m_base) if m_base is not None else None)
    if engine != "llmem":
        raise LlmemError(f"unknown engine {engine!r}: choose llmem or paper")
    from llmem.estimator.engine import estimate as _estimate

    return _estimate(setup)


def trace(model: str | TrainingSetup, *, job_phases: bool = True, **options: Any) -> MemoryResult:
    """The real training step on fake tensors, replayed through a model of the CUDA caching allocator, and the
    job's loading and saving code where it runs on them (job_phases=False: the step alone)."""
    from llmem.runtime.trace import trace as _trace

    return _trace(_setup(model, options), job_phases=job_phases)


def measure(model: str | TrainingSetup, **options: Any) -> MemoryResult:
    """The real training step on a real device (CUDA if available, else CPU)."""
    from llmem.runtime.measure import measure as _measure

    return _measure(_setup(model, options))


def plan(model: str | TrainingSetup, *, plan_options: Any = None, **options: Any):
    """The largest batch per distributed method on `gpus` GPUs of type `gpu`, the time model and a recommendation
    (a llmem.planner.plan.Plan; `plan_options`: a llmem.planner.options.PlanOptions)."""
    from llmem.planner.plan import plan as _plan

    return _plan(_setup(model, options), plan_options)


def check(model: Any, optimizer: Any, **options: Any):
    """Inside a real run: its memory counters (`measured`, from a llmem.validate.live.MemoryWatch) against llmem's
    estimate of the set-up rebuilt from the live model and optimizer (a llmem.validate.live.LiveCheck)."""
    from llmem.validate.live import check as _check

    return _check(model, optimizer, **options)


def __getattr__(name: str) -> Any:
    if name == "LlmemCallback":       # transformers.TrainerCallback: imported only when asked for
        from llmem.validate.live import LlmemCallback

        return LlmemCallback
    raise AttributeError(f"module 'llmem' has no attribute {name!r}")
