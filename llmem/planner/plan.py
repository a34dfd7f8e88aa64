"""`llmem plan`: the largest batch per distributed method, a step-time model, and a recommendation.

For a model, a GPU type and count, a sequence length and the training options, the planner

1. lists the candidate layouts (`candidate_layouts`): single (one GPU only), ddp, fsdp, zero2, tp over all GPUs
   (only inside one node) and fsdp+tp for every tp dividing the node size with dp >= 2;
2. finds each candidate's largest micro-batch that fits (`max_batch_size`: exponential probe 1, 2, 4, ... then
   bisection over the memory engine, which is monotone in the batch size), with the user's headroom;
3. ranks the candidates, either by the time model below (`--ranking time`, default) or by LLMem's Algorithm 1
   (`--ranking paper`, LLMem §5, llmem.paper.algorithm1: eval = bs * gpu_n * 1.5 for CDP/ddp, bs * gpu_n for ADP/fsdp, bs for TP,
   bs * dp_n for DP+TP; argmax, ties to the earlier of CDP > ADP > TP > DP+TP; CPU offloading when nothing fits);
4. when nothing fits, says what would, each with its largest batch, memory, tokens/s and its time per token
   against the set-up as given (`time_cost_pct`): memory savers that keep full fine-tuning (fused cross-entropy,
   8-bit AdamW, the optimizer step in backward, checkpointing every 2nd / every layer, activation offloading, the
   cheap ones together), a shorter sequence, the LoRA (r16, all linear layers) and QLoRA (the same over a 4-bit
   NF4 base) settings that fit (each tried plain, with fused CE, with checkpointing, with both), optimizer
   offloading, FSDP2's CPU offload of parameters, gradients and optimizer (CPUOffloadPolicy, plain and with
   checkpointing and fused CE, timed with its host <-> device copies and the optimizer step on the host), or more
   GPUs of the same type;
5. writes a table or JSON, a memory-vs-batch plot, and a launch config for the recommended plan (accelerate YAML,
   torchrun script, DeepSpeed JSON).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from llmem.errors import LlmemError
from llmem.model.anatomy import ModelAnatomy, setup_anatomy
from llmem.paper.algorithm1 import CPU_OFFLOADING, EVAL_FORMULAS
from llmem.planner.engines import MemoryEngine, memory_engine
from llmem.planner.options import PlanOptions
from llmem.planner.search import (
    CandidatePlan,
    PlanContext,
    attach_time,
    limit_bytes,
    paper_eval,
    rank_by_paper,
    rank_by_time,
)
from llmem.planner.suggestions import suggest
from llmem.planner.timing import HOST_ADAMW_PARAMS_PER_S, PCIE_GBPS, peak_flops_per_s
from llmem.setup.gpus import GpuSpec, resolve_gpu
from llmem.setup.layout import candidate_layouts, gpus_per_node
from llmem.setup.objectives import setup_batch_multiple
from llmem.setup.training import TrainingSetup
from llmem.units import format_bytes


@dataclass
class Plan:
    setup: TrainingSetup
    anatomy: ModelAnatomy
    gpu: GpuSpec
    options: PlanOptions
    candidates: list[CandidatePlan]
    recommended: CandidatePlan | None
    recommendation: str                  # a label, "cpu-offloading", or "" when nothing fits
    reason: str
    suggestions: list[dict]
    notes: list[str]
    engine: MemoryEngine | None = field(repr=False, default=None)
    dataset_time_s: float | None = None

    @property
    def limit_bytes(self) -> int:
        return limit_bytes(self.gpu, self.options.headroom)

    def to_dict(self) -> dict:
        rec: dict | None
        if self.recommended is not None:
            rec = {**self.recommended.to_dict(), "reason": self.reason}
            if self.dataset_time_s is not None:
                rec["dataset_time_s"] = self.dataset_time_s
        else:
            rec = {"method": self.recommendation or None, "reason": self.reason}
        setup = self.setup.to_dict()
        setup.update({
            "model": self.anatomy.name, "total_params": self.anatomy.total_params, "gpu": self.gpu.name,
            "gpu_memory_bytes": self.gpu.memory_bytes, "headroom": self.options.headroom,
            "limit_bytes": self.limit_bytes, "engine": self.options.engine, "ranking": self.options.ranking,
            "mfu": self.options.mfu, "inter_node_gbps": self.options.inter_node_gbps,
            "global_batch": self.options.global_batch, "dataset_tokens": self.options.dataset_tokens,
            "gpus_per_node": gpus_per_node(self.setup.gpus, self.setup.gpus_per_node),
        })
        setup.pop("method", None)
        setup.pop("batch_size", None)
        return {"methods": [c.to_dict() for c in self.candidates], "recommended": rec,
                "suggestions": self.suggestions, "setup": setup, "notes": self.notes}


def plan(setup: TrainingSetup, options: PlanOptions | None = None, *, anatomy: ModelAnatomy | None = None,
         progress: Callable[[str, int, int], None] | None = None) -> Plan:
    """Plan `setup`'s model on setup.gpus GPUs of type setup.gpu (setup.method and batch_size are ignored)."""
    options = options or PlanOptions()
    if setup.pp > 1:
        raise LlmemError("llmem plan does not search pipeline-parallel layouts yet: drop --pp (estimate and trace "
                         "take it)")
    if setup.cp > 1:
        raise LlmemError("llmem plan does not search context-parallel layouts yet: drop --cp (estimate and trace "
                         "take it)")
    anatomy = anatomy or setup_anatomy(setup)
    gpu = resolve_gpu(setup.gpu, setup.gpu_memory, setup.cuda_context)
    limit = limit_bytes(gpu, options.headroom)
    engine = memory_engine(options.engine, anatomy, gpu, options.m_base_bytes, limit)
    ctx = PlanContext(anatomy, gpu, options, engine, limit)
    layouts = candidate_layouts(setup.gpus, setup.gpus_per_node, *ctx.heads, methods=options.methods, tp=options.tp)
    if not layouts:
        raise LlmemError(f"no layout of {setup.gpus} GPU(s) matches the requested method/tp for "
                         f"{anatomy.name}")
    notes = plan_notes(setup, gpu, options, anatomy)
    candidates: list[CandidatePlan] = []
    total_steps = len(layouts) + 1
    for i, layout in enumerate(layouts):
        if progress:
            progress(f"searching {layout.label}", i, total_steps)
        try:
            c = ctx.search(setup, layout)
        except LlmemError as exc:
            notes.append(f"{layout.label} skipped: {exc}")
            continue
        attach_time(ctx, c, setup)
        if options.ranking == "paper":
            c.eval = paper_eval(layout, c.max_batch_size)
        candidates.append(c)
    if not candidates:
        raise LlmemError("no candidate layout could be estimated: " + "; ".join(notes[-3:]))

    if options.ranking == "paper":
        best = rank_by_paper(candidates)
        if best is None:
            recommendation, reason = CPU_OFFLOADING, ("Algorithm 1: every method's eval is 0 (nothing fits at "
                                                      "batch 1), so CPU offloading (heterogeneous training)")
        else:
            recommendation = best.layout.label
            reason = (f"Algorithm 1: largest eval {best.eval:g} (max batch {best.max_batch_size}; eval = "
                      + EVAL_FORMULAS[best.layout.spec.paper_name] + ")")
    else:
        best = rank_by_time(candidates)
        if best is None:
            recommendation, reason = "", "nothing fits at batch 1 on these GPUs; see the suggestions"
        else:
            recommendation = best.layout.label
            reason = (f"fastest by the time model: {best.time.tokens_per_s:,.0f} tokens/s at micro-batch "
                      f"{best.time.micro_batch_size} x {best.time.accumulation_steps} accumulation step(s)")
    suggestions: list[dict] = []
    if not any(c.fits for c in candidates):
        if progress:
            progress("looking for what would fit", len(layouts), total_steps)
        # every what-if is searched on every layout that can run it (screened by the quick bound: suggestions.py)
        suggestions = suggest(ctx, setup, layouts, progress=progress and (
            lambda what, i, n: progress(what, len(layouts) + i, len(layouts) + n + 1)))
    result = Plan(setup, anatomy, gpu, options, candidates, best, recommendation, reason, suggestions, notes, engine)
    if best is not None and best.time is not None and options.dataset_tokens:
        result.dataset_time_s = options.dataset_tokens / best.time.tokens_per_s
    if progress:
        progress("done", total_steps, total_steps)
    return result


def fits_note(gpu: GpuSpec, options: PlanOptions) -> str:
    limit = f"{100 * (1 - options.headroom):g}% of {format_bytes(gpu.memory_bytes)} = " \
            f"{format_bytes(limit_bytes(gpu, options.headroom))}"
    if options.engine == "paper":
        return f"fits: device-used memory <= {limit} (engine paper)"
    return (f"fits: the step's allocations complete within {limit} less the CUDA context, as PyTorch decides OOM "
            f"(the allocator releases its cache and retries when full); engine {options.engine}")


def plan_notes(setup: TrainingSetup, gpu: GpuSpec, options: PlanOptions, anatomy: ModelAnatomy) -> list[str]:
    notes = [
        fits_note(gpu, options),
        f"time model: {gpu.name} peak {peak_flops_per_s(gpu, setup.precision) / 1e12:g} TFLOP/s for "
        f"{setup.precision} x MFU {options.mfu:g}; links {gpu.link_gbps:g} GB/s in a node, "
        f"{options.inter_node_gbps:g} GB/s per GPU across nodes; optimizer step, data loading not timed "
        f"(except the host's step under CPU offload: {HOST_ADAMW_PARAMS_PER_S / 1e9:g} G parameters/s per rank, "
        f"host <-> device copies at {PCIE_GBPS:g} GB/s)",
    ]
    if not setup.precision_spec.low_precision:
        notes.append("fp32 matmuls timed as TF32 (half the bf16 peak) on Ampere and newer, 1/8 of it before")
    if options.engine == "paper":
        notes.append("paper engine: LLMem's equations (fp16 mixed precision, Gemini chunks, gradient "
                     "checkpointing assumed); the time model still uses the setup given")
    if setup.batch_size != setup_batch_multiple(setup):
        notes.append("--batch-size is ignored by plan: the largest micro-batch is searched")
    if setup.optimizer_in_backward and options.global_batch:
        notes.append("--optimizer-in-backward cannot accumulate gradients: each step is one micro-batch per GPU, "
                     "so --global-batch is reached only when it fits in one micro-batch x data-parallel ranks")
    return notes

