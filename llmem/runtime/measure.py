"""measure: run the same training step for real, with randomly initialised weights, and read the memory counters.

On a CUDA GPU: `torch.cuda.max_memory_allocated` / `max_memory_reserved` after `reset_peak_memory_stats`, and what
the driver reports as used by this process (NVML via pynvml when importable, else `mem_get_info`). Multi-GPU methods
run rank 0 on a fake process group on one GPU; launched under torchrun (WORLD_SIZE > 1) the step uses the real
process group instead. The dispatch-level ledger of llmem.runtime.ledger runs alongside and gives the breakdown.

Without a GPU (device="cpu"): the step runs on the CPU and the same ledger counts live tensor bytes (512-byte
rounded like the CUDA caching allocator) for peak_allocated; peak_reserved comes from replaying its events through
llmem.memory.allocator. This is the cross-check of `trace` (same accounting, real tensors instead of fake ones). The CPU
dispatcher picks its own SDPA kernel (math with dropout, flash-for-cpu without), so compare it with
`trace(..., cuda_kernels=False)`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from llmem.errors import LlmemError, first_line
from llmem.result import ALLOCATED_COMPONENTS, MemoryResult
from llmem.runtime.ledger import PHASE_CODES, Ledger, tracking
from llmem.runtime.replay import build_result, replay_ledger, trace_details
from llmem.runtime.step import StepHooks, check_iterations, prepared_step
from llmem.runtime.trace import method_notes
from llmem.setup.gpus import resolve_gpu
from llmem.setup.methods import method_spec


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local)
    return torch.device("cpu")


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text.lower() or "can't allocate memory" in text)


def _device_used_bytes(device: torch.device) -> int | None:
    """What nvidia-smi shows for this process (NVML), or the device's total minus free."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        try:
            index = device.index if device.index is not None else torch.cuda.current_device()
            uuid = torch.cuda.get_device_properties(index).uuid
            handle = None
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                u = pynvml.nvmlDeviceGetUUID(h)
                u = u.decode() if isinstance(u, bytes) else u
                if str(uuid) in u:
                    handle = h
                    break
            if handle is None:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pid = os.getpid()
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid and proc.usedGpuMemory:
                    return int(proc.usedGpuMemory)
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - pynvml missing or the driver refuses: fall back to the CUDA runtime
        free, total = torch.cuda.mem_get_info(device)
        return int(total - free)


def measure(setup, *, device: str | torch.device | None = None, iterations: int = 2,
            progress: Callable[[str], None] | None = None) -> MemoryResult:
    """Run `iterations` real training steps of `setup` and report the memory counters (engine "measure")."""
    check_iterations(iterations)
    device = torch.device(device) if device is not None else _default_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LlmemError("measure --device cuda: no CUDA GPU is visible to torch")
    if setup.compile:
        raise LlmemError("--compile is estimated and traced, not measured here: measure's op tracker (a "
                         "TorchDispatchMode) cannot run inside torch.compile's graphs; on a GPU, "
                         "benchmarks/compile_gpu.py runs the compiled step with CUDA's own counters")
    if method_spec(setup.method).zero_stage is not None:
        return _measure_deepspeed(setup, device, iterations, progress)
    try:
        if device.type == "cuda":
            return _measure_cuda(setup, device, iterations, progress)
        return _measure_cpu(setup, device, iterations, progress)
    except LlmemError:
        raise
    except Exception as exc:
        if _is_oom(exc):
            first = first_line(exc)[:200]
            raise LlmemError(f"out of memory at batch size {setup.batch_size} (seq {setup.seq_len}, "
                             f"{setup.method}, {setup.precision}): {first}; try a smaller --batch-size, "
                             "--grad-ckpt, or a sharded method") from None
        raise


def _measure_deepspeed(setup, device: torch.device, iterations: int, progress) -> MemoryResult:
    """ds-zero: DeepSpeed's engine on real CPU tensors (llmem.runtime.deepspeed, rank 0 on a fake process group).
    On a GPU, DeepSpeed's own launcher runs the ranks: llmem.check / LlmemCallback compare inside that run."""
    if device.type == "cuda":
        raise LlmemError(f"measure --device cuda with {setup.method}: DeepSpeed's engine is measured inside your own "
                         "deepspeed / accelerate launch: add llmem.LlmemCallback to the Trainer (or call "
                         "llmem.check after a step), or use --device cpu")
    from llmem.runtime.deepspeed import deepspeed_step

    result, _ = deepspeed_step(setup, iterations=iterations, progress=progress, fake=False)
    return replace(result, engine="measure")


def _run(setup, device: torch.device, iterations: int, ledger: Ledger, on_phase_extra, say):
    roles_box: list = []
    with contextlib.ExitStack() as outer:
        def start_tracking() -> None:
            roles_box.append(outer.enter_context(tracking(ledger, None, real=True)))

        def on_phase(phase: str, it: int) -> None:
            if on_phase_extra is not None:
                on_phase_extra(phase, it)
            roles_box[0].on_phase(phase, it)

        hooks = StepHooks(on_phase=on_phase, region=ledger.region)
        with prepared_step(setup, fake=False, device=device, hooks=hooks, before_model=start_tracking,
                           cuda_kernels=False, progress=say) as step:
            roles = roles_box[0]
            roles.bind(step)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            step.run(iterations, progress=say)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if on_phase_extra is not None:
                on_phase_extra("end", iterations)
            roles.finish()
            ledger.enabled = False
            # the emulated paged 8-bit states (meta buffers here too): managed memory, counted as the trace does
            info = (step.resolved, getattr(step.optimizer, "outside_allocator_bytes", 0))
            del step
    return info


def _measure_cpu(setup, device, iterations, progress) -> MemoryResult:
    return measure_cpu_with_details(setup, iterations=iterations, progress=progress)[0]


def measure_cpu_with_details(setup, *, iterations: int = 2, progress: Callable[[str], None] | None = None):
    """The CPU measurement with the ledger's details (phase peaks, category maxima) for cross-checks."""
    check_iterations(iterations)
    if setup.offload_activations:
        raise LlmemError("measure --device cpu: --offload-activations needs a device distinct from the host (the "
                         "saved tensors would stay where they are); use trace, or measure on a GPU")
    say = progress or (lambda msg: None)
    gpu = resolve_gpu(setup.gpu, setup.gpu_memory, setup.cuda_context)
    t0 = time.perf_counter()
    ledger = Ledger(workspace_bytes=gpu.cublas_workspace_bytes)
    resolved, managed = _run(setup, torch.device("cpu"), iterations, ledger, None, say)
    series = replay_ledger(ledger, expandable_segments=setup.expandable_segments)
    wall = time.perf_counter() - t0
    notes = method_notes(resolved.layout, setup, "measure")
    notes.append(f"measure on cpu: live tensor bytes counted per op (512-B rounded), reserved from the allocator "
                 f"model; cuBLAS workspace and CUDA context from the {gpu.name} catalog entry; {wall:.1f} s")
    result = build_result("measure", ledger, resolved.record(), gpu, notes, series, managed)
    return result, trace_details(ledger, series, wall)


def _measure_cuda(setup, device, iterations, progress) -> MemoryResult:
    say = progress or (lambda msg: None)
    torch.cuda.set_device(device)
    ledger = Ledger(workspace_bytes=0)   # the real cuBLAS workspace is a real allocation here
    last = {"peak": 0, "phase": "", "current": "setup"}

    def on_phase(phase: str, it: int) -> None:
        peak = torch.cuda.max_memory_allocated(device)
        if peak > last["peak"]:
            last["peak"], last["phase"] = peak, last["current"]
        last["current"] = phase

    t0 = time.perf_counter()
    resolved, managed = _run(setup, device, iterations, ledger, on_phase, say)
    peak_alloc = int(torch.cuda.max_memory_allocated(device))
    peak_res = int(torch.cuda.max_memory_reserved(device))
    used = _device_used_bytes(device)
    series = replay_ledger(ledger, expandable_segments=setup.expandable_segments)
    comps = {name: int(series["components"].get(name, 0)) for name in ALLOCATED_COMPONENTS}
    tracked = sum(comps.values())
    # the ledger's breakdown is taken at its own peak; what CUDA counted beyond it is whole-block rounding
    comps["block_rounding"] = max(0, peak_alloc - tracked)
    comps["allocator_overhead"] = peak_res - tracked - comps["block_rounding"]
    context = max(0, (used or 0) - peak_res)
    comps["cuda_context"] = context
    comps["managed_memory"] = managed   # the emulation's paged states are not on the device: added, as in trace
    comps["vllm_pool"] = 0
    notes = method_notes(resolved.layout, setup, "measure")
    notes.append(f"measure on {torch.cuda.get_device_name(device)}: max_memory_allocated {peak_alloc} B, "
                 f"per-op ledger peak {series['peak_allocated']} B (breakdown from the ledger at its own peak); "
                 f"{time.perf_counter() - t0:.1f} s")
    phase = last["phase"] if last["phase"] in PHASE_CODES else ""
    return MemoryResult(engine="measure", peak_allocated_bytes=peak_alloc, peak_reserved_bytes=peak_res,
                        device_used_bytes=peak_res + context + managed,
                        gpu_memory_bytes=torch.cuda.get_device_properties(device).total_memory,
                        components=comps, setup=resolved.record(), peak_phase=phase, notes=notes)
