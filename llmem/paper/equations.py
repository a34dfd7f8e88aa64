"""LLMem's equations (Kim et al., IJCAI 2024, "LLMem: Estimating GPU Memory Usage for Fine-Tuning Pre-Trained LLMs"), as the paper states them.

Everything here follows the paper's §3-§5; where the paper is silent the conventions of its official code decide.
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

* ``cs`` is Colossal-AI Gemini's chunk-size search, as the official code (github.com/taehokim20/LLMem) runs it
  (`search_chunk_configuration` with the GeminiPlugin defaults): minimum chunk 32*1024**2 elements, search range 32*1024**2 elements, step 1024 elements,
  parameters above mean + 3 std filtered out, greedy first-fit waste in registration order, rounding up to a multiple
  of the dp degree. "Registration order" is `anatomy.params` (each unique parameter once, tied weights once).
  Gemini with memory statistics may walk the first-visit order of a profiling step instead (for OPT that would move
  the decoder's final LayerNorm to the end); that is not modelled. The search runs on full (unsharded) tensor sizes
  for every method; only the dp degree of the rounding changes.
* ``embed_p`` is the input **token** embedding (the vocab x hidden table), which the paper keeps outside the chunk
  rounding (a tensor larger than cs gets a chunk of exactly its size). Learned position tables (OPT, GPT-Neo, GPT-BigCode) are small and stay in ``other_p``.
  ``other_p`` is every other unique parameter except an untied lm_head **weight** (the paper counts the lm_head at
  real size in m_lm instead); an lm_head bias (CodeGen) stays in ``other_p``.
* ``m_os`` takes the official code's per-tensor reading (its `SizeEstimator`): the weight **and bias** of every module whose class
  name contains ``Embedding`` or is a ``Linear`` (``Linear``, any ``...Linear`` subclass, and HF's GPT-2-style
  ``Conv1D``, which is a Linear with transposed weight), each tensor rounded to a page, momentum and variance
  separately. LayerNorm parameters are left out (the paper: small enough to hide in fragmentation). Under sharding the
  code divides each tensor before rounding (``2 * ceilp(4 n / gpu_n)``); we do the same, so the paper's
  ``m_os / gpu_n`` is ``m_os(shards=gpu_n)`` here. An untied lm_head (CodeGen) is a Linear and has Adam states, so it
  is counted (the code counts it too, by its "last tensor" edge case).
* ``lm_p`` is the fp16 lm_head weight, page-rounded, added even when it is tied to the embedding (paper and code).
* ``m_p16``, ``m_p32`` are ``m_p``'s formula with B16 resp. B32 alone (each page-rounded; their sum can exceed m_p by
  one page). Divisions by gpu_n are exact-then-ceil to whole bytes.
* ``m_back`` uses all ``l_n`` layers (the paper's formula; the code sums about l_n - 1 per-tensor roundings).
* DP+TP uses the official code's convention: ``gpu_n`` = world size = dp_n * tp_n in every term. The correction
  ``- m_p16 * tp_n / gpu_n`` leaves ``m_p16 * (1 - tp_n / gpu_n)``, which is the physically expected ``m_p16 / tp_n``
  only for 2DP+2TP, the one shape the paper tested. Other shapes get a note.
* Methods map as: single and ddp -> CDP (m_peak^s); fsdp and zero2 -> ADP (the paper has no ZeRO-2 variant); tp -> TP;
  fsdp+tp -> DP+TP. The paper's 1D TP shards each weight's last dimension, so head counts need not divide tp_n.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from llmem.errors import LlmemError
from llmem.model.anatomy import ModelAnatomy
from llmem.setup.methods import METHODS
from llmem.units import MIB, ceil_div

# ---- the paper's constants (paper §3.1) ----
CU_P = 2 * MIB          # cu_p: CUDA memory page size the paper rounds to
B16 = 2                 # B_16
B32 = 4                 # B_32
E_N = 2                 # e_n: embedding outputs kept (the code always appends the first embedding output twice)
LM_FP32_MODEL_TYPES = ("codegen", "gpt_neo")   # HF code casts their logits to fp32 -> B = B_32 in m_lm

# ---- Colossal-AI Gemini chunk search defaults (`search_chunk_configuration`): element counts despite the "mb"/"byte"
# names ----
MIN_CHUNK_ELEMS = 32 * 1024**2
SEARCH_RANGE_ELEMS = 32 * 1024**2
SEARCH_INTERVAL_ELEMS = 1024

PAPER_METHODS = ("CDP", "ADP", "TP", "DP+TP")


def ceilp(x: float) -> int:
    """ceilp(x) = ceil(x / cu_p) * cu_p: round bytes up to the 2 MiB CUDA page (paper §3.1)."""
    return -(-math.ceil(x) // CU_P) * CU_P


def gemini_chunk_size(anatomy: ModelAnatomy, dp_degree: int = 1, *, min_chunk: int = MIN_CHUNK_ELEMS,
                      search_range: int = SEARCH_RANGE_ELEMS, interval: int = SEARCH_INTERVAL_ELEMS,
                      filter_exlarge: bool = True) -> int:
    """cs, in elements: Colossal-AI Gemini's `search_chunk_configuration` for one group of parameters.

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
    start = ceil_div(max_size, interval) * interval
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


def _chunked_elems(anatomy: ModelAnatomy, cs: int) -> int:
    """embed_p + ceil(other_p / cs) * cs: elements of chunk capacity."""
    other = other_p(anatomy)
    return embed_p(anatomy) + (ceil_div(other, cs) * cs if cs else other)


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
    if key.lower() in METHODS:
        return METHODS[key.lower()].paper_name
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
        weights = mp16 + ceil_div(mp32, gpu_n)                         # m_p16 + m_p32 / gpu_n
    elif method == "TP":
        weights = ceil_div(mp, gpu_n)                                  # m_p / gpu_n
    else:
        weights = mp16 + ceil_div(mp32, gpu_n) - (mp16 * tp_n) // gpu_n   # m_peak^dp - m_p16 * tp_n / gpu_n
    back = m_back(anatomy, bs, sl, tp_n) if method in ("TP", "DP+TP") else 0
    return PaperTerms(method, gpu_n, dp_n, tp_n, bs, sl, cs, m_base, mp, mp16, mp32, mos,
                      m_out(anatomy, bs, sl), m_lm(anatomy, bs, sl), lm_p(anatomy), back, weights, tuple(notes))

