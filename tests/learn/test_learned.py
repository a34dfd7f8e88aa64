"""Activations learned from the real code (llmem.learn, llmem.memory.activations.learned): the exact fit of
sizes in b and s, the cache (memory and disk, in a tmp dir), where learning is used and where it is refused, the
learned layer against the hand recipes where both exist, the floors it keeps, and the tiny catalog entries of three
families without a hand recipe (checked by their parameter counts worked out by hand)."""

from __future__ import annotations

import ast
import json
from fractions import Fraction
from pathlib import Path

import pytest
from micro_model import write_config

from llmem.errors import LlmemError
from llmem.estimator.engine import estimate
from llmem.memory.activations import learned as lm
from llmem.memory.activations.profile import activation_profile
from llmem.model.anatomy import load_anatomy
from llmem.model.resolved import resolve
from llmem.setup.training import TrainingSetup

ROOT = Path(__file__).resolve().parents[2]
MICRO = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
         "max_position_embeddings": 2048, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> str:
    return write_config(tmp_path_factory, MICRO)


def _setup(model: str, **kw) -> TrainingSetup:
    return TrainingSetup(model=model, **{"batch_size": 2, "seq_len": 256, "precision": "bf16-mixed", **kw})


# ---------------------------------------------------------------------------------------------- the fit
def test_sizes_are_fitted_exactly_from_the_points():
    """Allocations whose bytes are known polynomials (a weight cast, rotary cos/sin, a per-token tensor, eager
    scores, a prompt-tuning k/v of s + 20 tokens) come back with exactly those coefficients."""
    from llmem.learn.fit import fit_sizes
    from llmem.learn.points import POINTS, Reading

    truths = [lambda b, s: 2 * 4096 * 4096, lambda b, s: 4 * 128 * s, lambda b, s: 2 * 4096 * b * s,
              lambda b, s: 4 * 32 * b * s * s, lambda b, s: 2 * 1024 * b * (s + 20)]
    readings = [Reading([(True, k, f(b, s), 1, "activations", "m") for k, f in enumerate(truths)], "", (), {}, ())
                for b, s in POINTS]
    sizes = fit_sizes(readings, POINTS)
    assert sizes[0] == (2 * 4096 * 4096, 0, 0, 0, 0)
    assert sizes[1] == (0, 0, 4 * 128, 0, 0)
    assert sizes[2] == (0, 0, 0, 2 * 4096, 0)
    assert sizes[3] == (0, 0, 0, 0, 4 * 32)
    assert sizes[4] == (0, 2 * 1024 * 20, 0, 2 * 1024, 0)
    assert lm.poly_at(sizes[3], 3, 8192) == 4 * 32 * 3 * 8192 * 8192


def test_points_that_allocate_differently_are_refused():
    from llmem.learn.fit import fit_sizes
    from llmem.learn.points import POINTS, LearnError, Reading

    readings = [Reading([(True, 0, 8 * b * s, 1, "activations", "m")] * (2 if b == 3 else 1), "", (), {}, ())
                for b, s in POINTS]
    with pytest.raises(LearnError, match="allocates differently"):
        fit_sizes(readings, POINTS)


def test_a_learned_result_survives_its_json():
    p = (Fraction(3, 2), Fraction(0), Fraction(7), Fraction(1), Fraction(0))
    learned = lm.LearnedActivations((lm.LearnedBlock("x", (".x.",), (p,), ((p, -0.5, 0.5),), (p, p)),), (p,), (), (),
                                    2, ((1, 64),), 1.5)
    assert lm.LearnedActivations.from_json(json.loads(json.dumps(learned.to_json()))) == learned


# ---------------------------------------------------------------------------------------------- when it is used
def test_hand_recipes_are_not_learned_by_default(monkeypatch):
    monkeypatch.setenv(lm.LEARN_ENV, "auto")
    assert lm.learning_need(resolve(_setup("tiny-llama", lora_rank=8))) == (False, "")


def test_families_without_a_recipe_and_inexact_peft_types_are_learned(monkeypatch):
    monkeypatch.setenv(lm.LEARN_ENV, "auto")
    assert lm.learning_need(resolve(_setup("tiny-qwen3"))) == (True, "")
    assert lm.learning_need(resolve(_setup("tiny-llama", peft_config=_bundled("oft-r32-q-v")))) == (True, "")


def test_learning_is_refused_with_the_reason_where_one_layer_cannot_stand_for_all(monkeypatch):
    monkeypatch.setenv(lm.LEARN_ENV, "always")
    need, why = lm.learning_need(resolve(_setup("tiny-llama", method="tp", gpus=2)))
    assert not need and "tensor parallelism" in why
    need, why = lm.learning_need(resolve(_setup("tiny-llama", lora_rank=8, quant_base="nf4")))
    assert not need and "quantised base" in why


def _bundled(name: str) -> str:
    return str(ROOT / "llmem" / "model" / "catalog" / "peft" / name)


# ---------------------------------------------------------------------------------------------- learned vs hand
def test_learned_layer_equals_the_hand_recipe_and_is_cached(micro, monkeypatch, tmp_path):
    """LLMEM_LEARN=always on a Llama-shaped config: the learned layer keeps what the hand recipe says (within 1 %:
    the learned one also has SDPA's two 8-byte philox seeds), the peaks agree within 1 %, the note says so, the
    result is on disk and a second process (memory cleared) reads it instead of learning again."""
    monkeypatch.setenv(lm.CACHE_ENV, str(tmp_path))
    setup = _setup(micro, lora_rank=8)
    monkeypatch.setenv(lm.LEARN_ENV, "never")
    hand, hand_act = estimate(setup), activation_profile(resolve(setup))
    monkeypatch.setenv(lm.LEARN_ENV, "always")
    learned = estimate(setup)
    act = activation_profile(resolve(setup))
    assert act.per_layer_saved == pytest.approx(hand_act.per_layer_saved, rel=0.01)
    assert act.head_saved + act.shared_saved + act.embed_saved == \
        hand_act.head_saved + hand_act.shared_saved + hand_act.embed_saved
    assert learned.peak_allocated_bytes == pytest.approx(hand.peak_allocated_bytes, rel=0.01)
    assert learned.peak_reserved_bytes == pytest.approx(hand.peak_reserved_bytes, rel=0.01)
    assert any(n.startswith("activations learned from the real code on a 2-layer copy") for n in learned.notes)
    assert len(list((tmp_path / "learned").glob("*.json"))) == 1
    lm.forget_in_memory()
    import llmem.learn.shallow_copy as shallow_copy
    monkeypatch.setattr(shallow_copy, "learn", lambda r, points=None: pytest.fail("learned again"))
    assert estimate(setup).peak_allocated_bytes == learned.peak_allocated_bytes


def test_a_damaged_cache_file_is_ignored(micro, monkeypatch, tmp_path):
    monkeypatch.setenv(lm.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(lm.LEARN_ENV, "always")
    key = lm.learning_key(resolve(_setup(micro)))
    (tmp_path / "learned").mkdir()
    (tmp_path / "learned" / f"{lm.key_hash(key)}.json").write_text("{not json")
    assert lm.cached(key) is None


@pytest.mark.slow
@pytest.mark.parametrize("model,kw", [
    ("tiny-llama", {}), ("tiny-llama", {"lora_rank": 8}), ("tiny-llama", {"lora_rank": 8, "grad_ckpt": True}),
    ("tiny-llama", {"grad_ckpt": True}), ("tiny-mistral", {"lora_rank": 8}), ("tiny-mistral", {"precision": "bf16"}),
    ("Qwen/Qwen2.5-0.5B", {"lora_rank": 8, "batch_size": 1}), ("gpt2", {}),
    ("gpt2", {"lora_rank": 8, "lora_targets": "c_attn", "grad_ckpt": True}),
])
def test_learned_path_equals_the_hand_recipes(model, kw, monkeypatch):
    """Where both exist: per-layer saved bytes within 1 % (the learned layer adds SDPA's philox seeds and, on gpt2
    under LoRA, autocast's fp32 copies of LayerNorm weights, which the hand recipe leaves out), allocated peaks
    within 1 %. Reserved peaks: within 1 % except gpt2 under checkpointing, where the hand recipe is 4 % below the
    trace and the learned one within 1 % of it (tests/learn/test_learned.py::test_learned_path_against_the_trace)."""
    setup = _setup(model, **kw)
    monkeypatch.setenv(lm.LEARN_ENV, "never")
    hand, hand_act = estimate(setup), activation_profile(resolve(setup))
    monkeypatch.setenv(lm.LEARN_ENV, "always")
    learned, act = estimate(setup), activation_profile(resolve(setup))
    assert any("learned from the real code" in n for n in learned.notes)
    assert act.per_layer_saved == pytest.approx(hand_act.per_layer_saved, rel=0.01)
    assert learned.peak_allocated_bytes == pytest.approx(hand.peak_allocated_bytes, rel=0.01)
    if not (model == "gpt2" and kw.get("grad_ckpt")):
        assert learned.peak_reserved_bytes == pytest.approx(hand.peak_reserved_bytes, rel=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("model,kw", [
    ("tiny-llama", {"peft_config": _bundled("oft-r32-q-v")}), ("tiny-llama", {"peft_config": _bundled("delora-r32-q-v")}),
    ("tiny-llama", {"peft_config": _bundled("miss-r64-q-v")}), ("tiny-llama", {"peft_config": _bundled("hira-r32-q-v")}),
    ("tiny-llama", {"peft_config": _bundled("road2-q-v")}), ("tiny-llama", {"peft_config": _bundled("c3a-q-v")}),
    ("tiny-qwen3", {}), ("tiny-phi", {}), ("tiny-pythia", {}),
    ("tiny-phi", {"lora_rank": 8, "grad_ckpt": True}),
])
def test_learned_path_against_the_trace(model, kw, monkeypatch):
    """The learned path where no hand recipe exists (non-LoRA peft types, families without a recipe): estimate
    against trace within 2 % on both counters."""
    from llmem.runtime.trace import trace

    monkeypatch.setenv(lm.LEARN_ENV, "auto")
    setup = _setup(model, **kw)
    est, tr = estimate(setup), trace(setup)
    assert any("learned from the real code" in n for n in est.notes)
    assert est.peak_allocated_bytes == pytest.approx(tr.peak_allocated_bytes, rel=0.02)
    assert est.peak_reserved_bytes == pytest.approx(tr.peak_reserved_bytes, rel=0.02)


# ---------------------------------------------------------------------------------------------- errors and notes
def test_a_peft_type_needing_a_missing_package_is_one_line(tmp_path):
    """AdaMSS imports scikit-learn at get_peft_model: one LlmemError line naming it (the CLI's exit 2)."""
    import importlib.util

    if importlib.util.find_spec("sklearn") is not None:
        pytest.skip("scikit-learn is installed: AdaMSS builds")
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "ADAMSS", "task_type": "CAUSAL_LM", "r": 100, "num_subspaces": 32, "subspace_rank": 1,
         "target_modules": ["q_proj", "v_proj"], "init_weights": "orthogonal"}))
    with pytest.raises(LlmemError, match="needs a package that is not installed: scikit-learn") as err:
        resolve(_setup("tiny-llama", peft_config=str(tmp_path)))
    assert "\n" not in str(err.value)


def test_fallback_note_says_why_nothing_was_learned(monkeypatch):
    monkeypatch.setenv(lm.LEARN_ENV, "never")
    notes = estimate(_setup("tiny-qwen3", batch_size=1, seq_len=64)).notes
    assert any(n.startswith("LLMEM_LEARN=never: no activation recipe for model_type 'qwen3'") for n in notes)


# ---------------------------------------------------------------------------------------------- floors
def test_the_estimator_imports_learning_only_lazily_and_no_runtime():
    """Hand-recipe estimates stay milliseconds and import no runtime: llmem/estimator and llmem/memory never import
    llmem.runtime, and only the estimator imports llmem.learn (whose floor runs the real code), inside a function."""
    seen = []
    for folder in ("estimator", "memory"):
        for path in (ROOT / "llmem" / folder).rglob("*.py"):
            tree = ast.parse(path.read_text())
            top = {id(n) for n in tree.body}
            for node in ast.walk(tree):
                module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [module]
                assert not any(n.startswith("llmem.runtime") for n in names), path
                if any(n.startswith("llmem.learn") for n in names):
                    assert folder == "estimator" and id(node) not in top, path
                    seen.append(path.name)
    assert "engine.py" in seen


def test_the_estimator_is_forbidden_the_whole_runtime():
    """The estimator's contract names the runtime package whole; learning is a floor of its own between them."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    forbidden = next(c for c in contracts if c.get("source_modules") == ["llmem.estimator"])["forbidden_modules"]
    assert forbidden == ["llmem.runtime"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    assert layers.index("llmem.estimator | llmem.paper") + 1 == layers.index("llmem.learn") == \
        layers.index("llmem.runtime") - 1


# ---------------------------------------------------------------------------------------------- the tiny catalog entries
def test_tiny_families_without_a_recipe_have_their_published_layouts():
    """Parameter counts by hand from each family's modules (transformers' modeling files), h=512, L=4, V=16000:
    gpt_neox (Pythia): 2Vh + L(4h^2 + 2hi + 9h + i) + 2h, i=2048 (fused qkv and dense with biases, two LayerNorms,
    untied embed_out); phi (Phi-1.5): 2Vh + V + L(4h^2 + 2hi + 7h + i) + 2h, i=2048 (q/k/v/dense with biases, one
    LayerNorm, lm_head with bias); qwen3: Vh + L(h(qd + 2kvd) + qd h + 2hd + 3hi + 2h) + h, qd=512, kvd=256,
    hd=64, i=1536 (q/k RMSNorms per head, tied embeddings). The same formulas give the published counts of
    phi-1_5 (1,418,270,720) and Qwen3-0.6B (596,049,920)."""
    h, big_l, v = 512, 4, 16000
    pythia = 2 * v * h + big_l * (4 * h * h + 2 * h * 2048 + 9 * h + 2048) + 2 * h
    phi = 2 * v * h + v + big_l * (4 * h * h + 2 * h * 2048 + 7 * h + 2048) + 2 * h
    qwen3 = v * h + big_l * (h * (512 + 2 * 256) + 512 * h + 2 * 64 + 3 * h * 1536 + 2 * h) + h
    assert load_anatomy("tiny-pythia").total_params == pythia == 28_994_560
    assert load_anatomy("tiny-phi").total_params == phi == 29_006_464
    assert load_anatomy("tiny-qwen3").total_params == qwen3 == 20_780_032
    for name, family in (("tiny-pythia", "gpt_neox"), ("tiny-phi", "phi"), ("tiny-qwen3", "qwen3")):
        assert load_anatomy(name).model_type == family


def test_a_generation_objective_learns_the_plain_step(monkeypatch, tmp_path):
    """GRPO on a family without a hand recipe, nothing cached: the shallow copy runs at the learning points (batch
    2 and 3, 64 to 192 tokens), where GRPOConfig's checks would refuse (8 generations do not divide a batch of 2;
    a 512-token completion does not fit in 64 tokens). The copy runs the plain step, whose layer the training
    forward is; the learned layer is the sft set-up's, under the same cache key."""
    from dataclasses import replace

    from llmem.learn.shallow_copy import learn, learned_activations

    monkeypatch.setenv(lm.LEARN_ENV, "auto")
    monkeypatch.setenv(lm.CACHE_ENV, str(tmp_path))
    grpo = resolve(_setup("tiny-qwen3", objective="grpo", batch_size=8, seq_len=1024))
    sft = resolve(_setup("tiny-qwen3", batch_size=8, seq_len=1024))
    assert lm.learning_key(grpo) == lm.learning_key(sft)
    learned = learned_activations(grpo)
    assert learned is not None and learned.points[0] == (2, 64)
    assert replace(learned, seconds=0) == replace(learn(sft), seconds=0)


@pytest.mark.parametrize("fields", [
    {"method": "ds-zero3", "gpus": 8, "reduce_bucket_size": "auto", "offload_param": True},
    {"method": "fsdp", "gpus": 8, "dp_replicate": 2, "reshard_after_forward": 2},
    {"method": "fsdp", "gpus": 4, "cp": 2},
])
def test_the_learning_copy_runs_on_one_gpu_whatever_the_layout(fields):
    """The copy that learns a family's activations runs on one GPU: the user's ZeRO buckets, HSDP degree or context
    parallelism must not reach it (on an empty cache they refused the estimate with '(got single)'; a warm cache,
    which skips the copy, answered)."""
    from llmem.learn.shallow_copy import learning_setup
    from llmem.model.resolved import resolve

    r = resolve(TrainingSetup("tiny-llama", seq_len=64, **fields))
    copy = learning_setup(r, "/nowhere", 1, 64)
    assert (copy.method, copy.gpus, copy.dp_replicate, copy.cp) == ("single", 1, 1, 1)
    assert (copy.reduce_bucket_size, copy.offload_param, copy.reshard_after_forward) == (None, False, None)
    assert (copy.batch_size, copy.seq_len, copy.model) == (1, 64, "/nowhere")
