"""`--engine paper`: LLMem's equations (Kim et al., IJCAI 2024), as the paper states them.

Everything here follows docs/paper.md §3-§5; where the paper is silent the official code's conventions (§9) decide.
All sizes are bytes unless a name says "elements". The paper's setting is fixed: fp16 mixed precision on Colossal-AI
Gemini (fp16 params + fp32 master copies in chunks, HybridAdam), gradient checkpointing on, and the prediction is
the **device-used** memory that nvidia-smi / NVML reports (CUDA context and cached memory included).

Single GPU (paper §4.2, eq. m_peak^s)::

    m_peak^s = m_base + m_p + m_os + m_out + m_lm
    m_p   = ceilp((embed_p + ceil(other_p / cs) * cs) * (B16 + B32))          # m_p16 / m_p32: same with B16 / B32
    m_os  = sum over Embedding/Linear tensors t of 2 * ceilp(t_p * B32)        # momentum and variance, per tensor
    m_out = ceilp((e_n + l_n) * bs * sl * o_n * B16)                           # e_n = 2
    m_lm  = ceilp(bs * sl * V * B) + 2 * ceilp(bs * (sl - 1) * V * B) + lm_p   # B = 4 for CodeGen / GPT-Neo else 2
    ceilp(x) = ceil(x / cu_p) * cu_p,  cu_p = 2 MiB

Multi-GPU (paper §5), gpu_n GPUs, tp_n the tensor-parallel degree::

    CDP    m_peak^cdp   = m_peak^s
    ADP    m_peak^dp    = m_base + m_p16 + (m_p32 + m_os) / gpu_n + m_out + m_lm
    TP     m_peak^tp    = m_base + (m_p + m_os) / gpu_n + m_out + m_lm + m_back^tp
    DP+TP  m_peak^dp+tp = m_peak^dp - m_p16 * tp_n / gpu_n + m_back^tp
    m_back^tp = ceilp(l_n * bs * sl * o_n * (tp_n - 1) / tp_n * B16)

Readings chosen where the paper leaves room:

* ``cs`` is Colossal-AI Gemini's chunk-size search (paper.md §9.6, `search_chunk_configuration` with the
  GeminiPlugin defaults): minimum chunk 32*1024**2 elements, search range 32*1024**2 elements, step 1024 elements,
  parameters above mean + 3 std filtered out, greedy first-fit waste in registration order, rounding up to a multiple
  of the dp degree. "Registration order" is `anatomy.params` (each unique parameter once, tied weights once).
  Gemini with memory statistics may walk the first-visit order of a profiling step instead (for OPT that would move
  the decoder's final LayerNorm to the end); that is not modelled. The search runs on full (unsharded) tensor sizes
  for every method; only the dp degree of the rounding changes.
* ``embed_p`` is the input **token** embedding (the vocab x hidden table), which the paper keeps outside the chunk
  rounding (a tensor larger than cs gets a chunk of exactly its size). Learned position tables (OPT, GPT-Neo, GPT-BigCode) are small and stay in ``other_p``.
  ``other_p`` is every other unique parameter except an untied lm_head **weight** (the paper counts the lm_head at
  real size in m_lm instead); an lm_head bias (CodeGen) stays in ``other_p``.
* ``m_os`` takes the code's per-tensor reading (paper.md §9.3): the weight **and bias** of every module whose class
  name contains ``Embedding`` or is a ``Linear`` (``Linear``, any ``...Linear`` subclass, and HF's GPT-2-style
  ``Conv1D``, which is a Linear with transposed weight), each tensor rounded to a page, momentum and variance
  separately. LayerNorm parameters are left out (the paper: small enough to hide in fragmentation). Under sharding the
  code divides each tensor before rounding (``2 * ceilp(4 n / gpu_n)``); we do the same, so the paper's
  ``m_os / gpu_n`` is ``m_os(shards=gpu_n)`` here. An untied lm_head (CodeGen) is a Linear and has Adam states, so it
  is counted (the code counts it too, by its "last tensor" edge case, paper.md §9.5 item 9).
* ``lm_p`` is the fp16 lm_head weight, page-rounded, added even when it is tied to the embedding (paper and code).
* ``m_p16``, ``m_p32`` are ``m_p``'s formula with B16 resp. B32 alone (each page-rounded; their sum can exceed m_p by
  one page). Divisions by gpu_n are exact-then-ceil to whole bytes.
* ``m_back`` uses all ``l_n`` layers (the paper's formula; the code sums about l_n - 1 per-tensor roundings).
* DP+TP uses the code's convention (paper.md §4): ``gpu_n`` = world size = dp_n * tp_n in every term. The correction
  ``- m_p16 * tp_n / gpu_n`` leaves ``m_p16 * (1 - tp_n / gpu_n)``, which is the physically expected ``m_p16 / tp_n``
  only for 2DP+2TP, the one shape the paper tested. Other shapes get a note.
* Methods map as: single and ddp -> CDP (m_peak^s); fsdp and zero2 -> ADP (the paper has no ZeRO-2 variant); tp -> TP;
  fsdp+tp -> DP+TP. The paper's 1D TP shards each weight's last dimension, so head counts need not divide tp_n.

``m_base`` (CUDA context + Colossal-AI/Gemini initialisation, including NCCL buffers) is measured in the paper, not
computed, so it is an input here (``m_base_bytes``). Defaults, see `default_m_base`:

* V100 (16 and 32 GB): **600 MiB** (`V100_M_BASE_BYTES`). Reasoning (paper.md §6, §9.2, §7.1):
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
    74 MiB and would need a context twice what lazy loading gives. An emulation of the official code's arithmetic (measured chunks, per-
    tensor rounding, its lm_p quirk, OPT-350m's 512-wide embeddings) lands in the same window (553-636 MiB for the four models).
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

import math
from dataclasses import dataclass, field
from functools import lru_cache

from llmem.anatomy import ModelAnatomy
from llmem.config import EIGHT_BIT_OPTIMIZERS, TrainingSetup
from llmem.errors import LlmemError
from llmem.hardware import GpuSpec
from llmem.methods import resolve_layout
from llmem.result import COMPONENTS, MemoryResult
from llmem.units import MIB, format_bytes, parse_bytes

# ---- the paper's constants (paper.md §3.1) ----
CU_P = 2 * MIB          # cu_p: CUDA memory page size the paper rounds to
B16 = 2                 # B_16
B32 = 4                 # B_32
E_N = 2                 # e_n: embedding outputs kept (the code always appends the first embedding output twice)
LM_FP32_MODEL_TYPES = ("codegen", "gpt_neo")   # HF code casts their logits to fp32 -> B = B_32 in m_lm

# ---- Colossal-AI Gemini chunk search defaults (paper.md §9.6): element counts despite the "mb"/"byte" names ----
MIN_CHUNK_ELEMS = 32 * 1024**2
SEARCH_RANGE_ELEMS = 32 * 1024**2
SEARCH_INTERVAL_ELEMS = 1024

# ---- m_base (see the module docstring) ----
V100_M_BASE_BYTES = 600 * MIB

# ---- Algorithm 1 ----
CDP_FACTOR = 1.5        # eval[CDP] = bs * gpu_n * 1.5 (ZeRO-3's 1.5x communication volume)
PAPER_METHODS = ("CDP", "ADP", "TP", "DP+TP")
_ENGINE_METHOD = {"CDP": "ddp", "ADP": "fsdp", "TP": "tp", "DP+TP": "fsdp+tp"}
_PAPER_METHOD = {"single": "CDP", "ddp": "CDP", "fsdp": "ADP", "zero2": "ADP", "tp": "TP", "fsdp+tp": "DP+TP"}
CPU_OFFLOADING = "cpu-offloading"


def ceilp(x: float) -> int:
    """ceilp(x) = ceil(x / cu_p) * cu_p: round bytes up to the 2 MiB CUDA page (paper §3.1)."""
    return -(-math.ceil(x) // CU_P) * CU_P


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ================================================================== chunk size (cs)

def gemini_chunk_size(anatomy: ModelAnatomy, dp_degree: int = 1, *, min_chunk: int = MIN_CHUNK_ELEMS,
                      search_range: int = SEARCH_RANGE_ELEMS, interval: int = SEARCH_INTERVAL_ELEMS,
                      filter_exlarge: bool = True) -> int:
    """cs, in elements: Colossal-AI Gemini's `search_chunk_configuration` for one group of parameters (§9.6).

    Parameters are taken in registration order (`anatomy.params`: unique, tied weights once), all in one group of
    dp degree `dp_degree` (the world size under ADP, dp_n under DP+TP, 1 for one GPU and for pure TP).
    """
    if dp_degree < 1:
        raise LlmemError(f"dp degree must be >= 1, got {dp_degree}")
    sizes = tuple(p.numel for p in anatomy.params if p.trainable)
    return _chunk_search(sizes, dp_degree, min_chunk, search_range, interval, filter_exlarge)


@lru_cache(maxsize=256)
def _chunk_search(sizes: tuple[int, ...], dp_degree: int, min_chunk: int, search_range: int, interval: int,
                  filter_exlarge: bool) -> int:
    import numpy as np

    total = sum(sizes)
    if total == 0:
        return 0
    if total < min_chunk:                 # "let small parameters keep gathered": one chunk of the group's size
        return total
    kept = list(sizes)
    if filter_exlarge:                    # _filter_exlarge_params: drop sizes above mean + 3 std (np.std, ddof 0)
        arr = np.array(sizes, dtype=np.float64)
        upper = float(np.mean(arr) + 3 * np.std(arr))
        kept = [s for s in sizes if s <= upper]
    max_size = max([min_chunk, *kept])
    start = _ceil_div(max_size, interval) * interval
    candidates = np.arange(start, start + search_range + 1, interval, dtype=np.int64)
    # _get_unused_byte, vectorised over all candidate chunk sizes: greedy first fit in order
    left = np.zeros_like(candidates)
    acc = np.zeros_like(candidates)
    for s in kept:
        new_chunk = s > left
        acc += np.where(new_chunk, left, 0)
        left = np.where(new_chunk, candidates, left)
        left -= s
    waste = left + acc
    best = int(candidates[int(np.argmin(waste))])    # first minimum, as the strict `<` of the search loop
    return best + (-best % dp_degree)                 # round up to the lcm of the dp degrees (one group here)


# ================================================================== parameter inventories

def _is_embedding(kind: str) -> bool:
    return "Embedding" in kind


def _is_linear(kind: str) -> bool:
    return kind == "Linear" or kind.endswith("Linear") or kind == "Conv1D"


def token_embedding(anatomy: ModelAnatomy):
    """The input token embedding (vocab x hidden table) of `anatomy`: the paper's embed_p tensor."""
    embeds = [p for p in anatomy.params if _is_embedding(p.module_kind) and p.layer_index is None]
    if not embeds:
        raise LlmemError(f"{anatomy.name}: no embedding parameter found; the paper engine needs a decoder LM")
    for p in embeds:
        if p.shape and p.shape[0] == anatomy.vocab_size:
            return p
    return max(embeds, key=lambda p: p.numel)


def untied_lm_head(anatomy: ModelAnatomy):
    """The lm_head weight when it is a parameter of its own (not tied to the embedding), else None."""
    heads = [p for p in anatomy.params if _is_linear(p.module_kind) and p.layer_index is None
             and len(p.shape) == 2 and anatomy.vocab_size in p.shape]
    named = [p for p in heads if p.name.split(".")[-2:-1] == ["lm_head"] or p.name.endswith("lm_head.weight")]
    if named:
        return named[-1]
    return heads[-1] if heads else None


def embed_p(anatomy: ModelAnatomy) -> int:
    """embed_p: input-embedding parameter count (elements)."""
    return token_embedding(anatomy).numel


def lm_head_numel(anatomy: ModelAnatomy) -> int:
    """Elements of the lm_head weight (the token embedding's when tied)."""
    head = untied_lm_head(anatomy)
    return head.numel if head is not None else token_embedding(anatomy).numel


def other_p(anatomy: ModelAnatomy) -> int:
    """other_p: every other unique parameter, excluding the embedding and an untied lm_head weight (elements)."""
    head = untied_lm_head(anatomy)
    return anatomy.total_params - embed_p(anatomy) - (head.numel if head is not None else 0)


def optimizer_tensor_numels(anatomy: ModelAnatomy) -> list[int]:
    """t_p for every Embedding / Linear tensor (weights and biases, unique, registration order)."""
    return [p.numel for p in anatomy.params
            if p.trainable and (_is_embedding(p.module_kind) or _is_linear(p.module_kind))]


# ================================================================== the paper's terms

def _chunked_elems(anatomy: ModelAnatomy, cs: int) -> int:
    """embed_p + ceil(other_p / cs) * cs: elements of chunk capacity."""
    other = other_p(anatomy)
    return embed_p(anatomy) + (_ceil_div(other, cs) * cs if cs else other)


def m_p(anatomy: ModelAnatomy, cs: int) -> int:
    """m_p = ceilp((embed_p + ceil(other_p / cs) * cs) * (B16 + B32)): fp16 param (= fp16 grad) + fp32 master."""
    return ceilp(_chunked_elems(anatomy, cs) * (B16 + B32))


def m_p16(anatomy: ModelAnatomy, cs: int) -> int:
    """m_{p,16}: the fp16 part of m_p."""
    return ceilp(_chunked_elems(anatomy, cs) * B16)


def m_p32(anatomy: ModelAnatomy, cs: int) -> int:
    """m_{p,32}: the fp32 part of m_p."""
    return ceilp(_chunked_elems(anatomy, cs) * B32)


def m_os(anatomy: ModelAnatomy, shards: int = 1) -> int:
    """m_os = sum_{t in E, L} ceilp(t_p * (B32 + B32)), code reading: per tensor, momentum and variance rounded
    separately, each shard rounded (shards = gpu_n gives the per-GPU m_os / gpu_n)."""
    return sum(2 * ceilp(B32 * n / shards) for n in optimizer_tensor_numels(anatomy))


def m_out(anatomy: ModelAnatomy, bs: int, sl: int) -> int:
    """m_out = ceilp((e_n + l_n) * (bs * sl * o_n) * B16): embedding and layer outputs kept under checkpointing."""
    return ceilp((E_N + anatomy.num_layers) * bs * sl * anatomy.hidden_size * B16)


def lm_bytes(anatomy: ModelAnatomy) -> int:
    """B of m_lm: B32 when the model's HF code casts logits to fp32 (CodeGen, GPT-Neo), else B16."""
    return B32 if anatomy.model_type in LM_FP32_MODEL_TYPES else B16


def lm_p(anatomy: ModelAnatomy) -> int:
    """lm_p: the fp16 lm_head weight at real size, page-rounded (counted even when tied)."""
    return ceilp(lm_head_numel(anatomy) * B16)


def m_lm(anatomy: ModelAnatomy, bs: int, sl: int) -> int:
    """m_lm = ceilp(bs*sl*V*B) + 2*ceilp(bs*(sl-1)*V*B) + lm_p: logits, shifted logits + loss temporaries, lm_head."""
    b, v = lm_bytes(anatomy), anatomy.vocab_size
    return ceilp(bs * sl * v * b) + 2 * ceilp(bs * max(sl - 1, 0) * v * b) + lm_p(anatomy)


def m_back(anatomy: ModelAnatomy, bs: int, sl: int, tp_n: int) -> int:
    """m_back^tp = ceilp(l_n * (bs * sl * o_n) * (tp_n - 1) / tp_n * B16): TP backward all-gather buffers."""
    if tp_n <= 1:
        return 0
    return ceilp(anatomy.num_layers * bs * sl * anatomy.hidden_size * (tp_n - 1) / tp_n * B16)


# ================================================================== per-method peak

@dataclass(frozen=True)
class PaperTerms:
    """Every term of one method's m_peak, bytes (per GPU)."""
    method: str            # CDP, ADP, TP, DP+TP
    gpu_n: int
    dp_n: int
    tp_n: int
    bs: int
    sl: int
    cs: int                # chunk size, elements
    m_base: int
    m_p: int               # whole-model values before any division
    m_p16: int
    m_p32: int
    m_os: int              # already per GPU (per-shard rounding)
    m_out: int
    m_lm: int
    lm_p: int
    m_back: int
    weights: int           # the m_p part each GPU holds under this method
    notes: tuple[str, ...] = field(default=())

    @property
    def peak(self) -> int:
        return self.m_base + self.weights + self.m_os + self.m_out + self.m_lm + self.m_back


def paper_method(method: str) -> str:
    """llmem method name (or paper name) -> the paper's CDP / ADP / TP / DP+TP."""
    key = method.strip()
    if key.upper() in PAPER_METHODS:
        return key.upper()
    if key.lower() in _PAPER_METHOD:
        return _PAPER_METHOD[key.lower()]
    raise LlmemError(f"the paper engine has no method {method!r}: choose single, ddp, fsdp, zero2, tp or fsdp+tp")


def paper_terms(anatomy: ModelAnatomy, method: str, gpu_n: int, bs: int, sl: int, m_base: int,
                tp_n: int | None = None) -> PaperTerms:
    """All terms of m_peak for `method` (CDP/ADP/TP/DP+TP or an llmem method name) on `gpu_n` GPUs."""
    method = paper_method(method)
    if gpu_n < 1:
        raise LlmemError(f"gpu_n must be >= 1, got {gpu_n}")
    notes: list[str] = []
    if method in ("CDP", "ADP"):
        tp_n = 1
    elif method == "TP":
        tp_n = gpu_n
    else:
        tp_n = tp_n or 2
        if gpu_n % tp_n or gpu_n // tp_n < 2:
            raise LlmemError(f"DP+TP needs tp_n dividing gpu_n with dp_n >= 2, got gpu_n={gpu_n}, tp_n={tp_n}")
        if (gpu_n, tp_n) != (4, 2):
            notes.append(f"DP+TP uses the code's convention m_p16*(1 - tp_n/gpu_n) = m_p16*{1 - tp_n / gpu_n:.3g}; "
                         f"the physical share is m_p16/tp_n = m_p16*{1 / tp_n:.3g}. They agree only for 2DP+2TP, "
                         "the one shape the paper tested")
    dp_n = gpu_n // tp_n
    # the group's dp degree for the chunk search: world size under ADP, dp_n under DP+TP, 1 for CDP-as-one-GPU & TP
    chunk_dp = {"CDP": 1, "ADP": gpu_n, "TP": 1, "DP+TP": dp_n}[method]
    cs = gemini_chunk_size(anatomy, chunk_dp)
    mp, mp16, mp32 = m_p(anatomy, cs), m_p16(anatomy, cs), m_p32(anatomy, cs)
    shards = 1 if method == "CDP" else gpu_n
    mos = m_os(anatomy, shards)
    if method == "CDP":
        weights = mp                                                    # m_peak^s
    elif method == "ADP":
        weights = mp16 + _ceil_div(mp32, gpu_n)                         # m_p16 + m_p32 / gpu_n
    elif method == "TP":
        weights = _ceil_div(mp, gpu_n)                                  # m_p / gpu_n
    else:
        weights = mp16 + _ceil_div(mp32, gpu_n) - (mp16 * tp_n) // gpu_n   # m_peak^dp - m_p16 * tp_n / gpu_n
    back = m_back(anatomy, bs, sl, tp_n) if method in ("TP", "DP+TP") else 0
    return PaperTerms(method, gpu_n, dp_n, tp_n, bs, sl, cs, m_base, mp, mp16, mp32, mos,
                      m_out(anatomy, bs, sl), m_lm(anatomy, bs, sl), lm_p(anatomy), back, weights, tuple(notes))


def default_m_base(gpu: GpuSpec) -> int:
    """m_base when none is given: the V100 value justified in the module docstring, else the GPU's CUDA context."""
    if gpu.name.upper().startswith("V100"):
        return V100_M_BASE_BYTES
    return gpu.cuda_context_bytes


def _m_base_for(setup: TrainingSetup | None, gpu: GpuSpec, m_base_bytes: int | None) -> int:
    if m_base_bytes is not None:
        return int(m_base_bytes)
    if setup is not None and setup.cuda_context is not None:
        return 0 if str(setup.cuda_context) in ("0", "0B") else parse_bytes(setup.cuda_context)
    return default_m_base(gpu)


def _layout(setup: TrainingSetup, anatomy: ModelAnatomy):
    # The paper's 1D TP splits each weight's last dimension (not heads): pass head counts every tp divides.
    return resolve_layout(setup.method, setup.gpus, setup.tp, setup.gpus_per_node, 0, 0)


def _setup_terms(setup: TrainingSetup, anatomy: ModelAnatomy, m_base: int, bs: int) -> PaperTerms:
    layout = _layout(setup, anatomy)
    return paper_terms(anatomy, layout.method, layout.world_size, bs, setup.seq_len, m_base, layout.tp)


# ================================================================== engine entry points

def paper_estimate(setup: TrainingSetup, anatomy: ModelAnatomy, gpu: GpuSpec,
                   m_base_bytes: int | None = None) -> MemoryResult:
    """LLMem's per-GPU peak for `setup` as a MemoryResult (engine "paper")."""
    m_base = _m_base_for(setup, gpu, m_base_bytes)
    t = _setup_terms(setup, anatomy, m_base, setup.batch_size)
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
                        gpu_memory_bytes=gpu.memory_bytes, components=components, setup=setup.to_dict(),
                        peak_phase="", notes=notes)


def _m_base_source(setup: TrainingSetup | None, gpu: GpuSpec, m_base_bytes: int | None) -> str:
    if m_base_bytes is not None:
        return "given"
    if setup is not None and setup.cuda_context is not None:
        return "from --cuda-context"
    if gpu.name.upper().startswith("V100"):
        return "the V100 default inferred from the paper's Table 2, see llmem.paper"
    return "default: the GPU's CUDA-context assumption, no Colossal-AI overhead"


def _setup_mismatch_notes(setup: TrainingSetup, gpu: GpuSpec) -> list[str]:
    notes = []
    if setup.precision != "fp16-mixed":
        notes.append(f"precision {setup.precision} ignored: the paper models fp16 mixed precision only "
                     "(fp16 params/grads + fp32 master copies)")
    if not setup.optimizer.startswith("adamw") or setup.optimizer in EIGHT_BIT_OPTIMIZERS:
        notes.append(f"optimizer {setup.optimizer} ignored: the paper models Adam (fp32 momentum + variance) only")
    ignored = [flag for flag, on in (
        ("LoRA / peft adapters", bool(setup.lora_rank or setup.peft_config)),
        ("the quantised base", setup.quant_base != "none"), ("--optimizer-in-backward", setup.optimizer_in_backward),
        ("--offload-optimizer", setup.offload_optimizer), (f"--grad-ckpt-every {setup.ckpt_every}",
                                                           setup.ckpt_every > 1),
        ("--fused-ce", setup.fused_ce), ("--offload-activations", setup.offload_activations),
        ("--packing", setup.packing)) if on]
    if ignored:
        notes.append(f"{', '.join(ignored)} ignored: the paper's equations model full fine-tuning of every "
                     "parameter with its whole logits (use the llmem engine for these)")
    if not setup.grad_ckpt:
        notes.append("gradient checkpointing assumed on: the paper's m_out keeps only layer outputs")
    if setup.method == "zero2":
        notes.append("zero2 estimated as the paper's ADP (ZeRO-3-style Gemini); the paper has no ZeRO-2 variant")
    if not gpu.name.upper().startswith("V100"):
        notes.append(f"the paper validated on V100-16GB only; {gpu.name} uses the same equations")
    return notes


def paper_peak(setup: TrainingSetup, anatomy: ModelAnatomy, gpu: GpuSpec, bs: int, method: str | None = None,
               m_base_bytes: int | None = None) -> int:
    """m_peak (bytes) of `setup` at batch size `bs`, optionally for another llmem/paper method on setup.gpus GPUs."""
    m_base = _m_base_for(setup, gpu, m_base_bytes)
    if method is None:
        return _setup_terms(setup, anatomy, m_base, bs).peak
    return paper_terms(anatomy, method, setup.gpus, bs, setup.seq_len, m_base, setup.tp).peak


def paper_max_batch(setup: TrainingSetup, anatomy: ModelAnatomy, gpu: GpuSpec, method: str | None = None,
                    m_base_bytes: int | None = None, limit: int = 1 << 20) -> int:
    """Algorithm 1's inner loop: the largest bs with m_peak <= m_total (bs + 1 is the first to exceed it); 0 if
    even bs = 1 exceeds. m_total = gpu.memory_bytes (16384 MiB for the paper's V100)."""
    from llmem.planner import max_batch_size  # exponential probe then bisection (memory grows with bs)

    def fits(bs: int) -> bool:
        return paper_peak(setup, anatomy, gpu, bs, method, m_base_bytes) <= gpu.memory_bytes
    return max_batch_size(fits, limit)


def algorithm1(bs_list: dict[str, int], gpu_n: int, dp_n: int) -> dict:
    """Algorithm 1's decision from per-method max batch sizes {CDP, ADP, TP, DP+TP} (missing = unavailable).

    eval: CDP = bs * gpu_n * 1.5, ADP = bs * gpu_n, TP = bs, DP+TP = bs * dp_n; argmax, ties to the earlier method
    (CDP > ADP > TP > DP+TP); every eval 0 -> CPU offloading.
    """
    weights = {"CDP": gpu_n * CDP_FACTOR, "ADP": gpu_n, "TP": 1, "DP+TP": dp_n}
    evals = {m: bs_list[m] * weights[m] for m in PAPER_METHODS if m in bs_list}
    best = None
    for m in PAPER_METHODS:
        if m in evals and evals[m] > 0 and (best is None or evals[m] > evals[best]):
            best = m
    return {"eval": evals, "selected": best if best is not None else CPU_OFFLOADING,
            "batch_size": bs_list[best] if best is not None else 0}


def paper_select(anatomy: ModelAnatomy, gpu: GpuSpec, gpus: int, seq_len: int, m_base_bytes: int | None = None,
                 tp: int = 2, limit: int = 1 << 20) -> dict:
    """Algorithm 1 ("Distributed Fine-Tuning Method Decision") on `gpus` GPUs of type `gpu` at `seq_len`.

    Returns {"methods": {CDP|ADP|TP|DP+TP: {"method", "gpu_n", "dp_n", "tp_n", "max_batch", "eval",
    "peak_at_max", "peak_at_1"}}, "eval", "selected" (paper name or "cpu-offloading"), "selected_method" (llmem
    name or None), "batch_size", "m_base", "m_total"}. With one GPU only CDP (= single) is evaluated; DP+TP (with
    tp_n = `tp`, default 2 as in the paper) only when tp divides gpus leaving dp_n >= 2.
    """
    if gpus < 1:
        raise LlmemError(f"--gpus must be >= 1, got {gpus}")
    from llmem.planner import max_batch_size

    m_base = _m_base_for(None, gpu, m_base_bytes)
    m_total = gpu.memory_bytes
    available = ["CDP"] if gpus == 1 else ["CDP", "ADP", "TP"]
    if gpus > 1 and tp >= 2 and gpus % tp == 0 and gpus // tp >= 2:
        available.append("DP+TP")
    methods: dict[str, dict] = {}
    for name in available:
        def peak(bs: int, name=name) -> int:
            return paper_terms(anatomy, name, gpus, bs, seq_len, m_base, tp if name == "DP+TP" else None).peak
        best = max_batch_size(lambda bs, peak=peak: peak(bs) <= m_total, limit)
        one = paper_terms(anatomy, name, gpus, 1, seq_len, m_base, tp if name == "DP+TP" else None)
        methods[name] = {"method": _ENGINE_METHOD[name] if gpus > 1 else "single", "gpu_n": one.gpu_n,
                         "dp_n": one.dp_n, "tp_n": one.tp_n, "max_batch": best,
                         "peak_at_max": peak(best) if best else None, "peak_at_1": one.peak}
    dp_n = methods["DP+TP"]["dp_n"] if "DP+TP" in methods else 1
    decision = algorithm1({m: v["max_batch"] for m, v in methods.items()}, gpus, dp_n)
    for m, v in methods.items():
        v["eval"] = decision["eval"][m]
    sel = decision["selected"]
    return {"methods": methods, "eval": decision["eval"], "selected": sel,
            "selected_method": methods[sel]["method"] if sel in methods else None,
            "batch_size": decision["batch_size"], "m_base": m_base, "m_total": m_total, "gpus": gpus,
            "seq_len": seq_len}
