"""LLMem's Algorithm 1, "Distributed Fine-Tuning Method Decision" (paper §5): the one copy, used by the paper
engine's own selection (`paper_select`) and by `llmem plan --ranking paper`.

For each method, the largest batch whose m_peak fits the GPU; eval = bs * gpu_n * 1.5 for CDP, bs * gpu_n for ADP,
bs for TP, bs * dp_n for DP+TP; the largest eval wins, ties to the earlier of CDP > ADP > TP > DP+TP; when every
eval is 0, CPU offloading (heterogeneous training).
"""

from __future__ import annotations

from llmem.errors import LlmemError
from llmem.model.anatomy import ModelAnatomy
from llmem.paper.engine import m_base_for
from llmem.paper.equations import PAPER_METHODS, paper_terms
from llmem.search import max_batch_size
from llmem.setup.gpus import GpuSpec
from llmem.setup.methods import METHODS

CDP_FACTOR = 1.5        # eval[CDP] = bs * gpu_n * 1.5 (ZeRO-3's 1.5x communication volume)
CPU_OFFLOADING = "cpu-offloading"
EVAL_FORMULAS = {"CDP": "bs x gpu_n x 1.5 (CDP)", "ADP": "bs x gpu_n (ADP)", "TP": "bs (TP)",
                 "DP+TP": "bs x dp_n (DP+TP)"}


ONE_GPU_METHOD = next(m.name for m in METHODS.values() if m.one_gpu)   # CDP on one GPU


def engine_method(paper_name: str) -> str:
    """The llmem method a multi-GPU run of the paper's method uses (CDP: ddp, ADP: fsdp, TP: tp, DP+TP: fsdp+tp)."""
    return next(m.name for m in METHODS.values() if m.paper_name == paper_name and not m.one_gpu)


def method_eval(paper_name: str, batch: int, gpu_n: int, dp_n: int) -> float:
    """Algorithm 1's eval of a method at its largest batch."""
    weight = {"CDP": gpu_n * CDP_FACTOR, "ADP": gpu_n, "TP": 1, "DP+TP": dp_n}[paper_name]
    return float(batch * weight)


def algorithm1(bs_list: dict[str, int], gpu_n: int, dp_n: int) -> dict:
    """Algorithm 1's decision from per-method max batch sizes {CDP, ADP, TP, DP+TP} (missing = unavailable).

    eval: CDP = bs * gpu_n * 1.5, ADP = bs * gpu_n, TP = bs, DP+TP = bs * dp_n; argmax, ties to the earlier method
    (CDP > ADP > TP > DP+TP); every eval 0 -> CPU offloading.
    """
    evals = {m: method_eval(m, bs_list[m], gpu_n, dp_n) for m in PAPER_METHODS if m in bs_list}
    best = None
    for m in PAPER_METHODS:
        if m in evals and evals[m] > 0 and (best is None or evals[m] > evals[best]):
            best = m
    return {"eval": evals, "selected": best if best is not None else CPU_OFFLOADING,
            "batch_size": bs_list[best] if best is not None else 0}


def paper_select(anatomy: ModelAnatomy, gpu: GpuSpec, gpus: int, seq_len: int, m_base_bytes: int | None = None,
                 tp: int = 2, limit: int = 1 << 20) -> dict:
    """Algorithm 1 on `gpus` GPUs of type `gpu` at `seq_len`.

    Returns {"methods": {CDP|ADP|TP|DP+TP: {"method", "gpu_n", "dp_n", "tp_n", "max_batch", "eval",
    "peak_at_max", "peak_at_1"}}, "eval", "selected" (paper name or "cpu-offloading"), "selected_method" (llmem
    name or None), "batch_size", "m_base", "m_total"}. With one GPU only CDP (= single) is evaluated; DP+TP (with
    tp_n = `tp`, default 2 as in the paper) only when tp divides gpus leaving dp_n >= 2.
    """
    if gpus < 1:
        raise LlmemError(f"--gpus must be >= 1, got {gpus}")
    m_base = m_base_for(None, gpu, m_base_bytes)
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
        methods[name] = {"method": engine_method(name) if gpus > 1 else ONE_GPU_METHOD, "gpu_n": one.gpu_n,
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
