"""`llmem trace`: run the real training step on fake tensors and record every allocation and free, as CUDA would
see them.

The step (llmem.runtime.step) runs on fake cpu tensors with CUDA's behaviour emulated where it changes memory
(autocast op policy, fused dropout's bool mask, the fused SDPA kernels, AdamW's foreach default). The ledger
(llmem.runtime.ledger) follows every tensor storage; its event stream is replayed through llmem.memory.allocator's
model of the CUDA caching allocator for the reserved memory; the cuBLAS workspace (one block from the allocator at
the first matmul) and the CUDA context (outside the allocator) complete the picture: device_used = peak_reserved +
context.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from llmem.memory.activations.profile import activation_notes
from llmem.model.moe import routing_notes
from llmem.model.vision_inputs import vision_inputs
from llmem.result import EVAL_PHASE, MemoryResult, phase_over
from llmem.runtime.ds_loading import zero_init_load
from llmem.runtime.evaluation import eval_job_phase, eval_trace_notes, eval_traced, evaluation_loop
from llmem.runtime.job_trace import load_phases, phase_trace_notes
from llmem.runtime.ledger import Ledger, StepRoles, TracingFakeMode, tracking
from llmem.runtime.pipeline import fresh_sharding_cache
from llmem.runtime.quant_kernels import emulation_note
from llmem.runtime.replay import TraceDetails, build_result, replay_ledger, trace_details
from llmem.runtime.saving import optimizer_unsaved, run_save, save_job_phase, save_run
from llmem.runtime.step import StepHooks, check_iterations, prepared_step
from llmem.setup.context_parallel import cp_note
from llmem.setup.eval_phase import kept_steps
from llmem.setup.expert_parallel import ep_note
from llmem.setup.gpus import outside_allocator_bytes, resolve_gpu
from llmem.setup.layout import Layout
from llmem.setup.methods import method_spec
from llmem.setup.objectives import objective_notes, objective_spec
from llmem.setup.training import TrainingSetup


def method_notes(layout: Layout, setup: TrainingSetup, engine: str) -> list[str]:
    """What the real step's result says about its emulation, the optimizer and the activation options."""
    notes = []
    if layout.world_size > 1:
        notes.append(f"rank 0 of {layout.world_size} emulated on a fake process group ({layout.label}); NCCL's "
                     "internal buffers are not traced (device_used adds the catalog's assumption for them)")
    if layout.cp > 1:
        notes.append(cp_note(layout.cp, setup.seq_len, engine))
    if layout.ep > 1:    # torchtitan's expert parallelism (llmem.runtime.expert_parallel)
        notes.append(ep_note(layout.ep, layout.expert_shard_degree, setup.ep_imbalance, engine))
    if setup.precision == "fp16-mixed":
        notes.append("fp16-mixed: the GradScaler's state (a few scalars) is not included")
    if setup.quant_spec.quantised:
        notes.append(emulation_note(setup))
    if setup.offload_optimizer and engine == "trace":
        notes.append("optimizer offloaded: it steps fp32 master copies in host memory, its states there too; the "
                     "device keeps the gradients until zero_grad and is updated in place (no device allocations)")
    if setup.objective_spec.runs_trainer:         # TRL's trainer code and what the run emulates of it
        from llmem.runtime.objective_steps import objective_trace_notes

        notes += objective_trace_notes(setup) if engine == "trace" else objective_notes(setup)
    return notes + activation_notes(setup) + setup.optimizer_spec.notes(engine, setup.optimizer_in_backward)


def trace(setup: TrainingSetup, *, iterations: int = 2, progress: Callable[[str], None] | None = None,
          cuda_kernels: bool = True, job_phases: bool = True) -> MemoryResult:
    """Trace `iterations` real training steps of `setup` on fake tensors (rank 0 of the layout) and return what a
    CUDA GPU would show: peak allocated / reserved, device used, and the breakdown at peak allocated.

    cuda_kernels=False keeps the CPU dispatcher's SDPA choice (for cross-checks against real CPU runs).
    job_phases=False leaves the loading and saving phases out (the step's numbers are the same either way: the
    validation matrix compares the step alone)."""
    if setup.pp > 1:         # each pipeline stage in turn (llmem.runtime.pipeline)
        return trace_stages(setup, iterations=iterations, progress=progress, cuda_kernels=cuda_kernels)[0]
    return trace_with_details(setup, iterations=iterations, progress=progress, cuda_kernels=cuda_kernels,
                              job_phases=job_phases)[0]


def trace_with_details(setup: TrainingSetup, *, iterations: int = 2,
                       progress: Callable[[str], None] | None = None,
                       cuda_kernels: bool = True, pp_rank: int = 0,
                       job_phases: bool = True) -> tuple[MemoryResult, TraceDetails]:
    """The trace, and what its result leaves out (TraceDetails: per-phase peaks, the allocations at the peak);
    under --pp, pipeline rank `pp_rank`'s stage. job_phases: trace's."""
    check_iterations(iterations)
    if method_spec(setup.method).zero_stage is not None:     # DeepSpeed's own engine runs the step
        return _deepspeed_trace(setup, iterations, progress, cuda_kernels, job_phases)
    say = progress or (lambda msg: None)
    gpu = resolve_gpu(setup.gpu, setup.gpu_memory, setup.cuda_context)
    t0 = time.perf_counter()
    fresh_sharding_cache()     # another trace's DeviceMesh process groups (llmem.runtime.pipeline)
    ledger = Ledger(workspace_bytes=gpu.cublas_workspace_bytes)
    fake_mode = TracingFakeMode()
    roles_box: list[StepRoles] = []

    with contextlib.ExitStack() as outer:
        def start_tracking() -> None:
            roles_box.append(outer.enter_context(tracking(ledger, fake_mode, real=False)))

        hooks = StepHooks(on_phase=lambda ph, it: roles_box[0].on_phase(ph, it), region=ledger.region)
        with prepared_step(setup, fake=True, fake_mode=fake_mode, hooks=hooks, cuda_kernels=cuda_kernels,
                           before_model=start_tracking, progress=say, pp_rank=pp_rank) as step:
            roles = roles_box[0]
            roles.bind(step)
            step.run(iterations, progress=say)
            step_events = len(ledger.events)
            traced_eval = eval_traced(setup)
            if traced_eval:
                say("evaluating")
                roles.on_phase("eval", iterations)
                evaluation_loop(step, kept_steps(setup, step.layout.world_size))
            unsaved = optimizer_unsaved(step.optimizer)
            traced_save = job_phases and save_run(setup) is not None and unsaved is None
            host_before_save = ledger.host_now
            if traced_save:
                say("saving a checkpoint")
                run_save(step, ledger, roles)
            roles.finish()
            ledger.enabled = False
            resolved = step.resolved
            managed = getattr(step.optimizer, "outside_allocator_bytes", 0)
            del step
    say("replaying the allocator")
    node_ranks = min(resolved.layout.gpus_per_node, resolved.layout.world_size)
    saved = [save_job_phase(ledger, setup, host_before_save, node_ranks)] if traced_save else []
    job = eval_job_phase(ledger, setup, step_events) if traced_eval else []
    ledger.events = ledger.events[:step_events]
    job = (load_phases(setup, progress=say) if job_phases else []) + job + saved
    series = replay_ledger(ledger, expandable_segments=setup.expandable_segments)
    wall = time.perf_counter() - t0
    notes = method_notes(resolved.layout, setup, "trace")
    anatomy = resolved.anatomy
    notes += [n for n in (anatomy.positions_note(setup.seq_len), anatomy.varied_layers_note) if n is not None]
    notes += routing_notes(anatomy, ep=resolved.layout.ep)
    images = vision_inputs(setup, resolved.base)     # a vision-language model's images (llmem.runtime.vision)
    if images is not None:
        notes.append(images.describe())
    notes.append(f"trace: {len(ledger.events)} allocator events, {wall:.1f} s")
    result = build_result("trace", ledger, resolved.record(), gpu, notes, series, managed)
    result.job_phases = job
    # the job's fit weighs the traced phases as the estimate's (llmem.result.phase_over)
    result.job_over = phase_over(job, gpu.memory_bytes - outside_allocator_bytes(gpu, resolved.layout.world_size))
    result.job_notes = eval_trace_notes(setup, [p for p in job if p.name == EVAL_PHASE]) + \
        (phase_trace_notes(setup, job, unsaved) if job_phases else [])
    if objective_spec(setup.objective).generates:     # GRPO's phases (llmem.runtime.generation)
        from llmem.runtime.generation import traced_phases

        result.phases = traced_phases(series)
    return result, trace_details(ledger, series, wall)


def _deepspeed_trace(setup: TrainingSetup, iterations: int, progress, cuda_kernels: bool,
                     job_phases: bool) -> tuple[MemoryResult, TraceDetails]:
    """DeepSpeed's own engine runs the step (llmem.runtime.deepspeed, its checkpoint saved after it), ZeRO-3's
    zero-init loading in a run of its own (llmem.runtime.ds_loading)."""
    from llmem.runtime.deepspeed import deepspeed_step

    result, details = deepspeed_step(setup, iterations=iterations, progress=progress, cuda_kernels=cuda_kernels,
                                     save=job_phases)
    result.job_notes = eval_trace_notes(setup, [])
    if job_phases:
        result.job_phases = zero_init_load(setup, progress) + result.job_phases
        result.job_notes += phase_trace_notes(setup, result.job_phases)
    return result, details


def trace_stages(setup, *, iterations: int = 2, progress=None, cuda_kernels: bool = True):
    """Each pipeline rank's stage traced in turn; the answer is the stage with the largest reserved peak (what
    device_used follows), with every stage's peaks in `stages` and a note naming it."""
    from llmem.runtime.pipeline import EMULATION_NOTE, stage_row
    from llmem.setup.pipeline import pipeline_schedule

    say = progress or (lambda msg: None)
    runs = []
    for rank in range(setup.pp):
        say(f"pipeline stage {rank + 1}/{setup.pp}")
        runs.append(trace_with_details(setup, iterations=iterations, progress=progress, cuda_kernels=cuda_kernels,
                                       pp_rank=rank))
    results = [r for r, _ in runs]
    top = max(range(len(results)), key=lambda k: (results[k].peak_reserved_bytes, results[k].peak_allocated_bytes))
    result, details = runs[top]
    result.stages = [stage_row(k, r) for k, r in enumerate(results)]
    result.notes = result.notes + [EMULATION_NOTE.format(schedule=pipeline_schedule(setup.pp_schedule).torch_class),
                                   f"pipeline: stage {top} of {setup.pp} (rank {top * (setup.gpus // setup.pp)}) has the "
                                   "largest peak; each stage's peaks are in `stages`"]
    return result, details

