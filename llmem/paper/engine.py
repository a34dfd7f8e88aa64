"""The engine on the paper floor: LLMem's equations as a MemoryResult (--engine paper).

The paper engine (`--engine paper`): a set-up's m_peak from LLMem's equations (llmem.paper.equations) as a
MemoryResult, with what the paper does not model named in its notes.

``m_base`` (CUDA context + Colossal-AI/Gemini initialisation, including NCCL buffers) is measured in the paper, not
computed, so it is an input here (``m_base_bytes``). Defaults, see `default_m_base`:

* V100 (16 and 32 GB): **600 MiB** (`V100_M_BASE_BYTES`). Reasoning (the paper's experimental set-up, its code's
  measurement of m_base, and its Table 2):
  - What it holds: the paper measured on V100s with PyTorch 2.0.1 + CUDA 11.7. PyTorch 2.0 sets
    CUDA_MODULE_LOADING=LAZY, so the bare driver context on sm_70 is ~300-400 MiB; on top come the cuBLAS library
    and handle, Colossal-AI's fused kernels (HybridAdam), the NCCL communicator of `launch_from_torch`, and, because
    the code measures ``m_pbase`` through nvidia-smi after Gemini init and `empty_cache`, whatever the caching
    allocator still holds then (cuBLAS workspace, the probe input's page). That puts m_base at roughly 500-900 MiB.
  - What the paper's own numbers say: Table 2 lists LLMem's single-GPU estimates (OPT-125m 16,314 MB, OPT-350m
    16,004, bloom-560m 16,578, codegen-350M 16,236) without their batch sizes. Inverting m_peak^s = m_base + terms(bs)
    for every integer bs gives, per model, a comb of candidate m_base values (spacing 156-758 MiB, the per-sample
    cost). The one value the four combs share best is 600 MiB: at bs = 85, 60, 10 and 34 the implied m_base is 650,
    546, 638 and 574 MiB (largest miss 54 MiB, 0.3 % of 16 GiB). The next-best common value, ~1,470 MiB, misses by
    74 MiB and would need a context twice what lazy loading gives. An emulation of the official code's arithmetic
    (measured chunks, per-tensor rounding, its lm_p quirk, OPT-350m's 512-wide embeddings) lands in the same window
    (553-636 MiB for the four models).
  - Figure 7 (single V100, ~1.3B models predicted and observed OOM; the models are probably OPT-1.3b, bloom-1b1,
    santacoder and gpt-neo-1.3B) needs m_base > 368 MiB for santacoder's m_peak^s at bs = 1 to exceed 16 GiB.
  - Multi-GPU runs add NCCL buffers per peer, so 4xV100 m_base may be somewhat larger. With this default,
    Algorithm 1 on 4xV100 at sl = 512 picks OPT-1.3b ADP, bloom-1b1 ADP, bloom-3b TP (on a tie, TP 4x1 = DP+TP 2x2),
    santacoder ADP, gpt-neo-1.3B ADP, llama-7b CPU offloading, as Table 3 says, but OPT-2.7b DP+TP (bs: ADP 6,
    TP 18, DP+TP 14 -> eval 24 / 18 / 28) where Table 3 says 4TP. No m_base in 400-800 MiB changes a decision;
    OPT-2.7b -> TP needs ADP infeasible and bs_TP >= 2 bs_DP+TP, which these equations give only for m_base
    >= ~3,300 MiB; all seven rows agree only for m_base in 3,300-3,400 MiB, not a plausible context + init.
* Other GPUs: the GPU catalog's CUDA-context assumption (`gpu.cuda_context_bytes`), i.e. no Colossal-AI overhead.
  The paper validated only on V100; give ``m_base_bytes`` (or ``--cuda-context``) from a measurement elsewhere.
"""

from __future__ import annotations

from llmem.errors import LlmemError
from llmem.model.anatomy import ModelAnatomy
from llmem.model.peft import trained_anatomy
from llmem.model.resolved import setup_record
from llmem.paper.equations import PaperTerms, paper_terms
from llmem.result import COMPONENTS, MemoryResult
from llmem.search import max_batch_size
from llmem.setup.gpus import GpuSpec
from llmem.setup.layout import Layout, resolve_layout
from llmem.setup.methods import METHODS, canonical_method
from llmem.setup.training import TrainingSetup
from llmem.units import MIB, format_bytes, parse_bytes

# ---- m_base (see the module docstring) ----
V100_M_BASE_BYTES = 600 * MIB


def default_m_base(gpu: GpuSpec) -> int:
    """m_base when none is given: the V100 value justified in the module docstring, else the GPU's CUDA context."""
    if gpu.name.upper().startswith("V100"):
        return V100_M_BASE_BYTES
    return gpu.cuda_context_bytes


def m_base_for(setup: TrainingSetup | None, gpu: GpuSpec, m_base_bytes: int | None) -> int:
    if m_base_bytes is not None:
        return int(m_base_bytes)
    if setup is not None and setup.cuda_context is not None:
        return 0 if str(setup.cuda_context) in ("0", "0B") else parse_bytes(setup.cuda_context)
    return default_m_base(gpu)


def paper_layout(setup: TrainingSetup, layout: Layout | None = None) -> Layout:
    """The paper's 1D TP splits each weight's last dimension (not heads): no head-divisibility check. The paper
    models one model's fine-tuning step under Colossal-AI's methods: not DeepSpeed's engine, not TRL's objectives.
    `layout`: the one the planner resolved for the set-up (heads unchecked, as here), taken as it is."""
    if METHODS[canonical_method(setup.method)].zero_stage is not None:
        raise LlmemError(f"--engine paper with {setup.method}: the paper's methods are Colossal-AI's (its ADP is "
                         "ZeRO-3-style); DeepSpeed's engine is the llmem engine's: drop --engine paper")
    if setup.objective_spec.runs_trainer:
        raise LlmemError(f"--engine paper with --objective {setup.objective}: the paper models one model's "
                         "fine-tuning loss; drop --engine paper")
    if setup.pp > 1:
        raise LlmemError("--engine paper with --pp: the paper has no pipeline parallelism; drop --engine paper")
    if setup.images_per_sample:
        raise LlmemError("--engine paper with images: the paper's equations cover decoder-only language models, not "
                         "a vision encoder; drop --engine paper")
    return layout or resolve_layout(setup.method, setup.gpus, setup.tp, setup.gpus_per_node, 0, 0)


def _setup_terms(setup: TrainingSetup, anatomy: ModelAnatomy, m_base: int, bs: int, layout: Layout) -> PaperTerms:
    return paper_terms(anatomy, layout.method, layout.world_size, bs, setup.seq_len, m_base, layout.tp)


def paper_estimate(setup: TrainingSetup, anatomy: ModelAnatomy, gpu: GpuSpec,
                   m_base_bytes: int | None = None, layout: Layout | None = None) -> MemoryResult:
    """LLMem's per-GPU peak for `setup` as a MemoryResult (engine "paper"); `layout`: the planner's (paper_layout)."""
    if setup.ep > 1:
        raise LlmemError("the paper engine (LLMem's equations) has no expert parallelism: drop --ep or use "
                         "--engine llmem / trace")
    if setup.cp > 1:
        raise LlmemError("the paper engine (LLMem's equations) has no context parallelism: drop --cp or use "
                         "--engine llmem / trace")
    m_base = m_base_for(setup, gpu, m_base_bytes)
    layout = paper_layout(setup, layout)
    t = _setup_terms(setup, anatomy, m_base, setup.batch_size, layout)
    components = dict.fromkeys(COMPONENTS, 0)
    components["weights"] = t.weights
    components["optimizer_states"] = t.m_os
    components["activations"] = t.m_out + t.m_back
    components["logits_and_loss"] = t.m_lm
    components["cuda_context"] = t.m_base
    notes = [
        "paper engine: LLMem (Kim et al., IJCAI 2024) predicts the device-used (nvidia-smi) memory only; "
        "peak_allocated, peak_reserved and device_used are all set to its m_peak",
        f"method {setup.method} read as the paper's {t.method} (gpu_n={t.gpu_n}, dp_n={t.dp_n}, tp_n={t.tp_n}); "
        f"Gemini chunk size cs={t.cs:,} elements",
        f"m_base = {format_bytes(m_base)} (CUDA context + Colossal-AI init, shown as cuda_context; "
        f"{_m_base_source(setup, gpu, m_base_bytes)})",
        f"terms: m_p={format_bytes(t.m_p)} (m_p16={format_bytes(t.m_p16)}, m_p32={format_bytes(t.m_p32)}), "
        f"m_os={format_bytes(t.m_os)}, m_out={format_bytes(t.m_out)}, m_lm={format_bytes(t.m_lm)} "
        f"(lm_p={format_bytes(t.lm_p)}), m_back={format_bytes(t.m_back)}",
        *t.notes,
    ]
    notes.extend(_setup_mismatch_notes(setup, gpu))
    peak = t.peak
    return MemoryResult(engine="paper", peak_allocated_bytes=peak, peak_reserved_bytes=peak, device_used_bytes=peak,
                        gpu_memory_bytes=gpu.memory_bytes, components=components,
                        setup=setup_record(setup, trained_anatomy(anatomy, setup), layout, gpu),
                        peak_phase="", notes=notes)


def _m_base_source(setup: TrainingSetup | None, gpu: GpuSpec, m_base_bytes: int | None) -> str:
    if m_base_bytes is not None:
        return "given"
    if setup is not None and setup.cuda_context is not None:
        return "from --cuda-context"
    if gpu.name.upper().startswith("V100"):
        return "the V100 default inferred from the paper's Table 2, see llmem.paper.engine"
    return "default: the GPU's CUDA-context assumption, no Colossal-AI overhead"


def _setup_mismatch_notes(setup: TrainingSetup, gpu: GpuSpec) -> list[str]:
    notes = []
    if setup.precision != "fp16-mixed":
        notes.append(f"precision {setup.precision} ignored: the paper models fp16 mixed precision only "
                     "(fp16 params/grads + fp32 master copies)")
    if not setup.optimizer_spec.adam:
        notes.append(f"optimizer {setup.optimizer} ignored: the paper models Adam (fp32 momentum + variance) only")
    ignored = [flag for flag, on in (
        ("LoRA / peft adapters", bool(setup.lora_rank or setup.peft_config)),
        ("the quantised base", setup.quant_spec.quantised), ("--optimizer-in-backward", setup.optimizer_in_backward),
        ("--offload-optimizer", setup.offload_optimizer), (f"--grad-ckpt-every {setup.ckpt_every}",
                                                           setup.ckpt_every > 1),
        ("--fused-ce", setup.fused_ce), ("--offload-activations", setup.offload_activations),
        ("--packing", setup.packing), ("--sequence-parallel", setup.sequence_parallel),
        ("--loss-parallel", setup.loss_parallel),
        (f"--logits-dtype {setup.logits_dtype}", setup.logits_dtype != "fp32"),
        (f"--liger {setup.liger}", setup.liger != "none"),
        (f"--float8 {setup.float8}", setup.float8 != "none"), ("--compile", setup.compile),
        ("--shard-embeddings", setup.shard_embeddings)) if on]
    if ignored:
        notes.append(f"{', '.join(ignored)} ignored: the paper's equations model full fine-tuning of every "
                     "parameter with its whole logits (use the llmem engine for these)")
    if not setup.grad_ckpt:
        notes.append("gradient checkpointing assumed on: the paper's m_out keeps only layer outputs")
    spec = METHODS[setup.method]
    if spec.paper_name == "ADP" and not spec.reshard_after_forward:
        notes.append("zero2 estimated as the paper's ADP (ZeRO-3-style Gemini); the paper has no ZeRO-2 variant")
    if not gpu.name.upper().startswith("V100"):
        notes.append(f"the paper validated on V100-16GB only; {gpu.name} uses the same equations")
    return notes


def paper_peak(setup: TrainingSetup, anatomy: ModelAnatomy, gpu: GpuSpec, bs: int, method: str | None = None,
               m_base_bytes: int | None = None) -> int:
    """m_peak (bytes) of `setup` at batch size `bs`, optionally for another llmem/paper method on setup.gpus GPUs."""
    m_base = m_base_for(setup, gpu, m_base_bytes)
    if method is None:
        return _setup_terms(setup, anatomy, m_base, bs, paper_layout(setup)).peak
    return paper_terms(anatomy, method, setup.gpus, bs, setup.seq_len, m_base, setup.tp).peak


def paper_max_batch(setup: TrainingSetup, anatomy: ModelAnatomy, gpu: GpuSpec, method: str | None = None,
                    m_base_bytes: int | None = None, limit: int = 1 << 20) -> int:
    """Algorithm 1's inner loop: the largest bs with m_peak <= m_total (bs + 1 is the first to exceed it); 0 if
    even bs = 1 exceeds. m_total = gpu.memory_bytes (16384 MiB for the paper's V100)."""
    def fits(bs: int) -> bool:
        return paper_peak(setup, anatomy, gpu, bs, method, m_base_bytes) <= gpu.memory_bytes
    return max_batch_size(fits, limit)

