"""The paper engine (llmem.paper): every LLMem term recomputed by hand from the models' config dimensions.

The expected values below never call llmem.paper's term functions: tensor shapes are written out from each
architecture (HF modeling code), page rounding and the Gemini chunk search are re-implemented here.
"""

from __future__ import annotations

import math
import statistics

import pytest

from llmem.model.anatomy import ModelAnatomy, ParamInfo, load_anatomy
from llmem.paper import algorithm1, engine, equations
from llmem.result import COMPONENTS
from llmem.setup.gpus import resolve_gpu
from llmem.setup.training import TrainingSetup
from llmem.units import GIB, MIB

SL = 512
BS = 4
PAGE = 2 * 1024 * 1024


def cp(x: float) -> int:
    """ceil to a 2 MiB page, written independently of equations.ceilp."""
    return math.ceil(x / PAGE) * PAGE


def brute_chunk_size(sizes: list[int], dp: int, min_chunk: int = 32 * 1024**2, rng: int = 32 * 1024**2,
                     step: int = 1024) -> int:
    """Colossal-AI search_chunk_configuration, transcribed loop by loop (one dp group)."""
    total = sum(sizes)
    if total < min_chunk:
        return total
    upper = statistics.fmean(sizes) + 3 * statistics.pstdev(sizes)
    kept = [s for s in sizes if s <= upper]
    start = math.ceil(max(min_chunk, max(kept)) / step) * step
    best, best_waste = start, math.inf
    for cs in range(start, start + rng + 1, step):
        acc = left = 0
        for s in kept:               # _get_unused_byte
            if s > left:
                acc += left
                left = cs
            left -= s
        if left + acc < best_waste:
            best, best_waste = cs, left + acc
    return best + (-best % dp)


# ---------------------------------------------------------------- the three models, by hand

def opt125m():
    h, L, V, f, pos = 768, 12, 50272, 3072, 2048 + 2        # OPT's learned positions have an offset of 2
    layer = ([h * h, h] * 4                                  # k, v, q, out_proj (weight, bias), in HF's order
             + [h, h]                                        # self_attn_layer_norm
             + [f * h, f, h * f, h]                          # fc1, fc2
             + [h, h])                                       # final_layer_norm
    order = [V * h, pos * h, h, h] + layer * L               # embed_tokens, embed_positions, decoder final LN
    opt_tensors = [V * h, pos * h] + ([h * h, h] * 4 + [f * h, f, h * f, h]) * L
    return dict(name="facebook/opt-125m", h=h, L=L, V=V, B=2, order=order, opt_tensors=opt_tensors,
                embed=V * h, lm_head=V * h, untied_head=0)


def bloom560m():
    h, L, V = 1024, 24, 250880
    layer = [h, h, 3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, h * 4 * h, h]
    order = [V * h, h, h] + layer * L + [h, h]
    opt_tensors = [V * h] + [3 * h * h, 3 * h, h * h, h, 4 * h * h, 4 * h, h * 4 * h, h] * L
    return dict(name="bigscience/bloom-560m", h=h, L=L, V=V, B=2, order=order, opt_tensors=opt_tensors,
                embed=V * h, lm_head=V * h, untied_head=0)


def codegen350m():
    h, L, V = 1024, 20, 51200
    layer = [h, h, h * h, 3 * h * h, 4 * h * h, 4 * h, h * 4 * h, h]   # ln_1, out_proj, qkv_proj, fc_in, fc_out
    order = [V * h] + layer * L + [h, h] + [V * h, V]                  # wte, blocks, ln_f, lm_head (w, b)
    opt_tensors = [V * h] + [h * h, 3 * h * h, 4 * h * h, 4 * h, h * 4 * h, h] * L + [V * h, V]
    return dict(name="Salesforce/codegen-350M-nl", h=h, L=L, V=V, B=4, order=order, opt_tensors=opt_tensors,
                embed=V * h, lm_head=V * h, untied_head=V * h)


MODELS = {"opt-125m": opt125m(), "bloom-560m": bloom560m(), "codegen-350m": codegen350m()}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    spec = MODELS[request.param]
    return spec, load_anatomy(spec["name"])


def test_hand_inventory_matches_the_model(model):
    spec, a = model
    assert [p.numel for p in a.params] == spec["order"]          # registration order the chunk search walks
    assert (a.hidden_size, a.num_layers, a.vocab_size) == (spec["h"], spec["L"], spec["V"])
    assert equations.optimizer_tensor_numels(a) == spec["opt_tensors"]
    assert equations.embed_p(a) == spec["embed"]
    assert equations.other_p(a) == sum(spec["order"]) - spec["embed"] - spec["untied_head"]
    assert equations.lm_head_numel(a) == spec["lm_head"]


def test_ceilp():
    assert equations.ceilp(0) == 0
    assert equations.ceilp(1) == PAGE
    assert equations.ceilp(PAGE) == PAGE
    assert equations.ceilp(PAGE + 0.5) == 2 * PAGE


# ---------------------------------------------------------------- chunk size

def test_chunk_size_opt125m_brute_force():
    spec, a = MODELS["opt-125m"], load_anatomy("facebook/opt-125m")
    cs1 = brute_chunk_size(spec["order"], 1)
    assert equations.gemini_chunk_size(a, 1) == cs1
    for dp in (2, 3, 4, 8):
        assert equations.gemini_chunk_size(a, dp) == cs1 + (-cs1 % dp)
    assert 32 * 1024**2 <= cs1 <= 2 * 32 * 1024**2


def _fake(sizes: list[int]) -> ModelAnatomy:
    params = tuple(ParamInfo(f"p{i}", (n,), "float16", "Linear", None, None) for i, n in enumerate(sizes))
    return ModelAnatomy(name="fake", model_type="fake", architecture="Fake", family="llama", hidden_size=8,
                        num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, intermediate_size=32,
                        vocab_size=100, tie_word_embeddings=False, params=params)


def test_chunk_size_small_made_up_cases():
    sizes = [70, 30, 50, 50, 40, 60, 10, 20, 90, 30, 40, 50, 5000]   # 5000 > mean + 3 std (~4390): filtered
    kw = dict(min_chunk=100, search_range=60, interval=10)
    a = _fake(sizes)
    for dp in (1, 4):
        assert equations.gemini_chunk_size(a, dp, **kw) == brute_chunk_size(sizes, dp, 100, 60, 10)
    # the same by an even plainer loop over the candidates 100..160 (first minimum wins)
    waste = {}
    for cs in range(100, 161, 10):
        acc = left = 0
        for s in sizes[:-1]:
            if s > left:
                acc, left = acc + left, cs
            left -= s
        waste[cs] = acc + left
    assert equations.gemini_chunk_size(a, 1, **kw) == min(waste, key=lambda c: (waste[c], c))
    # a group smaller than the minimum chunk is one kept-gathered chunk of its own size (no dp rounding)
    assert equations.gemini_chunk_size(_fake([10, 20, 33]), 4, min_chunk=100) == 63


# ---------------------------------------------------------------- terms, single GPU

def _hand_terms(spec, cs, bs=BS, sl=SL, shards=1):
    h, L, V, B = spec["h"], spec["L"], spec["V"], spec["B"]
    other = sum(spec["order"]) - spec["embed"] - spec["untied_head"]
    elems = spec["embed"] + math.ceil(other / cs) * cs
    return dict(
        m_p=cp(elems * 6), m_p16=cp(elems * 2), m_p32=cp(elems * 4),
        m_os=sum(2 * cp(4 * n / shards) for n in spec["opt_tensors"]),
        m_out=cp((2 + L) * bs * sl * h * 2),
        lm_p=cp(spec["lm_head"] * 2),
        m_lm=cp(bs * sl * V * B) + 2 * cp(bs * (sl - 1) * V * B) + cp(spec["lm_head"] * 2),
    )


def test_terms_by_hand(model):
    spec, a = model
    cs = equations.gemini_chunk_size(a, 1)
    hand = _hand_terms(spec, cs)
    assert equations.m_p(a, cs) == hand["m_p"]
    assert equations.m_p16(a, cs) == hand["m_p16"]
    assert equations.m_p32(a, cs) == hand["m_p32"]
    assert equations.m_os(a) == hand["m_os"]
    assert equations.m_os(a, 4) == _hand_terms(spec, cs, shards=4)["m_os"]
    assert equations.m_out(a, BS, SL) == hand["m_out"]
    assert equations.lm_p(a) == hand["lm_p"]
    assert equations.m_lm(a, BS, SL) == hand["m_lm"]
    h, L = spec["h"], spec["L"]
    assert equations.m_back(a, BS, SL, 4) == cp(L * BS * SL * h * 3 / 4 * 2)
    assert equations.m_back(a, BS, SL, 2) == cp(L * BS * SL * h * 1 / 2 * 2)
    assert equations.m_back(a, BS, SL, 1) == 0


def test_known_numbers_opt125m():
    """A few terms as plain numbers (MiB), to catch a change of reading."""
    a = load_anatomy("facebook/opt-125m")
    assert equations.m_out(a, BS, SL) // MIB == 42          # 14 * 4*512*768*2 B = 42 MiB
    assert equations.lm_p(a) // MIB == 74                   # 50272*768*2 B = 73.6 MiB -> 74
    # logits 4*512*50272*2 B = 196.4 -> 198 MiB; shifted 4*511*50272*2 B = 195.99 -> 196 MiB (x2)
    assert equations.m_lm(a, BS, SL) // MIB == 198 + 2 * 196 + 74


def test_single_gpu_peak(model):
    spec, a = model
    m_base = 600 * MIB
    setup = TrainingSetup(spec["name"], method="single", batch_size=BS, seq_len=SL, precision="fp16-mixed",
                          grad_ckpt=True, gpu="V100-16GB")
    r = engine.paper_estimate(setup, a, resolve_gpu("V100-16GB"), m_base_bytes=m_base)
    hand = _hand_terms(spec, equations.gemini_chunk_size(a, 1))   # cs itself: test_chunk_size_*
    peak = m_base + hand["m_p"] + hand["m_os"] + hand["m_out"] + hand["m_lm"]
    assert r.engine == "paper"
    assert r.peak_allocated_bytes == r.peak_reserved_bytes == r.device_used_bytes == peak
    assert sum(r.components.values()) == peak
    assert set(r.components) == set(COMPONENTS)
    assert r.components["weights"] == hand["m_p"]
    assert r.components["optimizer_states"] == hand["m_os"]
    assert r.components["activations"] == hand["m_out"]
    assert r.components["logits_and_loss"] == hand["m_lm"]
    assert r.components["cuda_context"] == m_base
    assert any("nvidia-smi" in n for n in r.notes)
    assert not any("precision" in n for n in r.notes)
    # CDP (ddp on 4 GPUs) is m_peak^s
    ddp = engine.paper_estimate(TrainingSetup(spec["name"], method="ddp", gpus=4, batch_size=BS, seq_len=SL),
                               a, resolve_gpu("V100-16GB"), m_base_bytes=m_base)
    assert ddp.device_used_bytes == peak


# ---------------------------------------------------------------- 4 GPUs

@pytest.mark.parametrize("method", ["fsdp", "zero2", "tp", "fsdp+tp"])
def test_four_gpu_methods_by_hand(model, method):
    spec, a = model
    m_base, gpu_n = 700 * MIB, 4
    setup = TrainingSetup(spec["name"], method=method, gpus=gpu_n, batch_size=BS, seq_len=SL)
    r = engine.paper_estimate(setup, a, resolve_gpu("V100-16GB"), m_base_bytes=m_base)
    h, L = spec["h"], spec["L"]
    if method in ("fsdp", "zero2"):         # ADP: m_base + m_p16 + (m_p32 + m_os)/gpu_n + m_out + m_lm
        t = _hand_terms(spec, equations.gemini_chunk_size(a, gpu_n), shards=gpu_n)
        weights = t["m_p16"] + math.ceil(t["m_p32"] / gpu_n)
        back = 0
    elif method == "tp":                    # TP: m_base + (m_p + m_os)/gpu_n + m_out + m_lm + m_back
        t = _hand_terms(spec, equations.gemini_chunk_size(a, 1), shards=gpu_n)
        weights = math.ceil(t["m_p"] / gpu_n)
        back = cp(L * BS * SL * h * 3 / 4 * 2)
    else:                                   # DP+TP (2dp x 2tp): m_peak^dp - m_p16 * tp_n/gpu_n + m_back
        t = _hand_terms(spec, equations.gemini_chunk_size(a, 2), shards=gpu_n)
        weights = t["m_p16"] + math.ceil(t["m_p32"] / gpu_n) - t["m_p16"] * 2 // gpu_n
        back = cp(L * BS * SL * h * 1 / 2 * 2)
    peak = m_base + weights + t["m_os"] + t["m_out"] + t["m_lm"] + back
    assert r.device_used_bytes == peak
    assert r.components["weights"] == weights
    assert r.components["activations"] == t["m_out"] + back
    assert sum(r.components.values()) == peak


def test_method_ordering(model):
    """Invariants the paper's formulas imply: CDP > ADP > DP+TP > TP at the same batch on 4 GPUs."""
    spec, a = model
    peaks = {m: equations.paper_terms(a, m, 4, 2, SL, 0).peak for m in equations.PAPER_METHODS}
    assert peaks["CDP"] > peaks["ADP"] > peaks["DP+TP"] > peaks["TP"]


def test_notes_for_setups_outside_the_paper():
    a = load_anatomy("facebook/opt-125m")
    setup = TrainingSetup("facebook/opt-125m", method="fsdp+tp", gpus=8, tp=2, precision="bf16-mixed",
                          optimizer="sgd", batch_size=2, seq_len=SL, gpu="A100-80GB")
    r = engine.paper_estimate(setup, a, resolve_gpu("A100-80GB"))
    text = " ".join(r.notes)
    assert "precision bf16-mixed ignored" in text
    assert "optimizer sgd ignored" in text
    assert "checkpointing assumed" in text
    assert "2DP+2TP" in text                      # shape caveat for 4dp x 2tp
    assert r.components["cuda_context"] == resolve_gpu("A100-80GB").cuda_context_bytes


def test_notes_name_every_option_the_equations_ignore():
    a = load_anatomy("gpt2")
    setup = TrainingSetup("gpt2", precision="fp16-mixed", optimizer="adamw-8bit", grad_ckpt=True, lora_rank=16, lora_targets="c_attn",
                          quant_base="nf4", fused_ce=True, offload_activations=True, seq_len=SL, gpu="V100-16GB")
    text = " ".join(engine.paper_estimate(setup, a, resolve_gpu("V100-16GB")).notes)
    assert "optimizer adamw-8bit ignored" in text
    for option in ("LoRA / peft adapters", "the quantised base", "--fused-ce", "--offload-activations"):
        assert option in text
    plain = TrainingSetup("gpt2", precision="fp16-mixed", grad_ckpt=True, seq_len=SL, gpu="V100-16GB")
    assert "ignored" not in " ".join(engine.paper_estimate(plain, a, resolve_gpu("V100-16GB")).notes)


def test_default_m_base():
    assert engine.default_m_base(resolve_gpu("V100-16GB")) == engine.V100_M_BASE_BYTES == 600 * MIB
    assert engine.default_m_base(resolve_gpu("H100")) == resolve_gpu("H100").cuda_context_bytes
    a = load_anatomy("facebook/opt-125m")
    setup = TrainingSetup("facebook/opt-125m", batch_size=1, seq_len=SL, cuda_context="1GiB")
    assert engine.paper_estimate(setup, a, resolve_gpu("V100")).components["cuda_context"] == GIB


# ---------------------------------------------------------------- Algorithm 1

def test_algorithm1_arithmetic():
    # eval: CDP = 2*4*1.5 = 12, ADP = 5*4 = 20, TP = 12, DP+TP = 6*2 = 12 -> ADP
    d = algorithm1.algorithm1({"CDP": 2, "ADP": 5, "TP": 12, "DP+TP": 6}, gpu_n=4, dp_n=2)
    assert d["eval"] == {"CDP": 12.0, "ADP": 20, "TP": 12, "DP+TP": 12}
    assert (d["selected"], d["batch_size"]) == ("ADP", 5)
    # ties go to the earlier method: ADP 3*4 = TP 12 = DP+TP 6*2
    assert algorithm1.algorithm1({"CDP": 0, "ADP": 3, "TP": 12, "DP+TP": 6}, 4, 2)["selected"] == "ADP"
    assert algorithm1.algorithm1({"CDP": 0, "ADP": 0, "TP": 13, "DP+TP": 6}, 4, 2)["selected"] == "TP"
    assert algorithm1.algorithm1({"CDP": 4, "ADP": 5, "TP": 0, "DP+TP": 0}, 4, 2)["selected"] == "CDP"   # 24 > 20
    assert algorithm1.algorithm1({"CDP": 4, "ADP": 6, "TP": 0, "DP+TP": 0}, 4, 2)["selected"] == "CDP"   # 24 = 24, tie
    assert algorithm1.algorithm1({"CDP": 4, "ADP": 7, "TP": 0, "DP+TP": 0}, 4, 2)["selected"] == "ADP"   # 24 < 28
    nothing = algorithm1.algorithm1({"CDP": 0, "ADP": 0, "TP": 0, "DP+TP": 0}, 4, 2)
    assert (nothing["selected"], nothing["batch_size"]) == (algorithm1.CPU_OFFLOADING, 0)


def test_paper_select_small_case():
    """OPT-125m on a made-up 4 x 3 GiB GPU: each max batch is the last bs whose peak fits; eval and argmax follow."""
    a = load_anatomy("facebook/opt-125m")
    gpu = resolve_gpu("made-up", memory="3GiB")
    m_base = 300 * MIB
    r = algorithm1.paper_select(a, gpu, 4, SL, m_base_bytes=m_base)
    assert set(r["methods"]) == {"CDP", "ADP", "TP", "DP+TP"}
    factor = {"CDP": 4 * 1.5, "ADP": 4, "TP": 1, "DP+TP": 2}
    for name, v in r["methods"].items():
        bs = v["max_batch"]
        tp = 2 if name == "DP+TP" else None
        assert equations.paper_terms(a, name, 4, bs + 1, SL, m_base, tp).peak > 3 * GIB
        if bs:
            assert equations.paper_terms(a, name, 4, bs, SL, m_base, tp).peak <= 3 * GIB
        assert v["eval"] == bs * factor[name]
    best = max(r["eval"].values())
    assert r["eval"][r["selected"]] == best
    assert r["selected_method"] == {"CDP": "ddp", "ADP": "fsdp", "TP": "tp", "DP+TP": "fsdp+tp"}[r["selected"]]
    # one GPU: only CDP (= single)
    one = algorithm1.paper_select(a, gpu, 1, SL, m_base_bytes=m_base)
    assert set(one["methods"]) == {"CDP"} and one["methods"]["CDP"]["method"] == "single"
    # nothing fits -> CPU offloading
    tiny = algorithm1.paper_select(a, resolve_gpu("tiny", memory="1GiB"), 4, SL, m_base_bytes=m_base)
    assert tiny["selected"] == algorithm1.CPU_OFFLOADING


def test_paper_max_batch_matches_linear_search():
    a = load_anatomy("bigscience/bloom-560m")
    gpu = resolve_gpu("V100-16GB")
    setup = TrainingSetup("bigscience/bloom-560m", method="fsdp", gpus=4, seq_len=SL)
    best = engine.paper_max_batch(setup, a, gpu)
    bs = 1
    while engine.paper_peak(setup, a, gpu, bs) <= gpu.memory_bytes:
        bs += 1
    assert best == bs - 1 > 0


def test_notes_name_the_kernel_and_unit_options_too():
    a = load_anatomy("meta-llama/Llama-3.1-8B")
    setup = TrainingSetup("meta-llama/Llama-3.1-8B", method="fsdp", gpus=2, precision="fp16-mixed", grad_ckpt=True,
                          compile=True, shard_embeddings=True, seq_len=SL, gpu="V100-16GB")
    text = " ".join(engine.paper_estimate(setup, a, resolve_gpu("V100-16GB")).notes)
    assert "--compile, --shard-embeddings ignored" in text
