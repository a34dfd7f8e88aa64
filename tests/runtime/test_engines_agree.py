"""estimate, trace and measure (CPU) accept and refuse the same set-ups, with the same message (one support check,
llmem.setup.support), and the engine-side inputs that once ended in a traceback end in one LlmemError line."""

from __future__ import annotations

import json
import time

import pytest

from llmem.errors import LlmemError
from llmem.estimator.engine import estimate
from llmem.runtime.measure import measure, measure_cpu_with_details
from llmem.runtime.step import host_bytes_bound
from llmem.runtime.trace import trace, trace_with_details
from llmem.setup.training import TrainingSetup

_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 512}
CONFIGS = {
    "llama": {"model_type": "llama", **_TINY, "tie_word_embeddings": False},
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 1000, "n_positions": 512,
             "bos_token_id": 0, "eos_token_id": 0},
    "phi3": {"model_type": "phi3", **_TINY, "tie_word_embeddings": False, "pad_token_id": 0},
    # Gemma-2: flash attention in transformers (_supports_flash_attn) but no SDPA one (softcapping)
    "gemma2": {"model_type": "gemma2", **_TINY, "head_dim": 16, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16, "sliding_window": 16,
               "tie_word_embeddings": True},
    # BLOOM: neither flash nor SDPA attention in transformers
    "bloom": {"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": 1000},
    "mixtral": {"model_type": "mixtral", **_TINY, "num_local_experts": 4, "num_experts_per_tok": 2,
                "tie_word_embeddings": False},
}


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    d = tmp_path_factory.mktemp("agree")
    paths = {}
    for name, fields in CONFIGS.items():
        (d / f"{name}.json").write_text(json.dumps(fields))
        paths[name] = str(d / f"{name}.json")
    head = d / "lora_lm_head"
    head.mkdir()
    (head / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["lm_head"], "task_type": "CAUSAL_LM"}))
    paths["peft_lm_head"] = str(head)
    return paths


ENGINES = {
    "estimate": estimate,
    "trace": lambda s: trace(s, iterations=1),
    "measure": lambda s: measure(s, device="cpu", iterations=1),
}


def _outcomes(setup: TrainingSetup) -> dict[str, object]:
    """Each engine's answer (its MemoryResult) or its LlmemError's message."""
    got: dict[str, object] = {}
    for name, run in ENGINES.items():
        try:
            got[name] = run(setup)
        except LlmemError as exc:
            got[name] = str(exc)
    return got


def _refused_alike(setup: TrainingSetup, *words: str) -> str:
    got = _outcomes(setup)
    assert all(isinstance(v, str) for v in got.values()), {k: type(v).__name__ for k, v in got.items()}
    assert len(set(got.values())) == 1, got
    message = got["estimate"]
    assert "\n" not in message and all(w in message for w in words), message
    return message


def _answered_alike(setup: TrainingSetup):
    got = _outcomes(setup)
    assert not any(isinstance(v, str) for v in got.values()), got
    records = {name: (r.setup.setup.attn, r.setup.setup.method, r.setup.trainable_params) for name, r in got.items()}
    assert len(set(records.values())) == 1, records
    return got


# ------------------------------------------------------------------------------------------------ the set-ups

@pytest.mark.parametrize("fused_ce", [False, True])
def test_lora_on_lm_head_is_refused_by_every_engine(cfg, fused_ce):
    # peft wraps lm_head when named (trace ran it; with --fused-ce: "element 0 of tensors does not require grad"),
    # but no engine models the adapter's [tokens, vocab] output
    _refused_alike(TrainingSetup(model=cfg["llama"], batch_size=1, seq_len=16, lora_rank=4, lora_targets="lm_head",
                                 fused_ce=fused_ce), "lm_head", "not modelled")


def test_peft_config_on_lm_head_with_fused_ce_is_refused_by_every_engine(cfg):
    # was: trace -> "element 0 of tensors does not require grad" (fused CE reads the frozen head weight only)
    _refused_alike(TrainingSetup(model=cfg["llama"], batch_size=1, seq_len=16, peft_config=cfg["peft_lm_head"],
                                 fused_ce=True), "lm_head", "not modelled")


@pytest.mark.parametrize("family,why", [("gpt2", "base_model_tp_plan is None"),
                                        ("phi3", "colwise_gather_output")])
def test_tp_without_a_plan_is_refused_by_every_engine(cfg, family, why):
    # was: estimate answered with no note, trace refused
    _refused_alike(TrainingSetup(model=cfg[family], method="tp", gpus=2, batch_size=1, seq_len=16,
                                 precision="fp32", optimizer="sgd"), "tp is not supported", why)


def test_tp_with_a_plan_is_answered_by_every_engine(cfg):
    got = _answered_alike(TrainingSetup(model=cfg["llama"], method="tp", gpus=2, batch_size=1, seq_len=16,
                                        precision="fp32", optimizer="sgd"))
    assert got["trace"].components["weights"] == got["measure"].components["weights"]


def test_flash_attention_follows_transformers_flags(cfg):
    # Gemma-2 has flash but no SDPA attention in transformers: flash runs (it was refused), recorded as flash
    setup = TrainingSetup(model=cfg["gemma2"], batch_size=1, seq_len=32, precision="bf16-mixed", attn="flash",
                          optimizer="sgd")
    got = _answered_alike(setup)
    assert got["estimate"].setup.setup.attn == "flash"
    # BLOOM has neither: every engine refuses flash with the class's flag named
    _refused_alike(TrainingSetup(model=cfg["bloom"], batch_size=1, seq_len=16, attn="flash"),
                   "BloomForCausalLM", "_supports_flash_attn")


def test_sdpa_on_a_class_without_it_runs_eager_in_every_engine(cfg):
    # was: estimate assumed eager, trace refused ("does not support attn='sdpa'")
    got = _answered_alike(TrainingSetup(model=cfg["gemma2"], batch_size=1, seq_len=16, precision="fp32",
                                        optimizer="sgd"))
    assert got["trace"].setup.setup.attn == "eager"


# ------------------------------------------------------------------------------------------------ tracebacks

@pytest.mark.parametrize("engine", ["trace", "measure"])
def test_huge_lora_rank_is_refused_before_anything_is_built(cfg, engine):
    # was: peft built 2 TB of real adapters on the host (trace), or ran past 60 s then failed (measure)
    setup = TrainingSetup(model=cfg["llama"], batch_size=1, seq_len=16, lora_rank=10**9)
    t0 = time.perf_counter()
    with pytest.raises(LlmemError, match="for real on the host") as err:
        ENGINES[engine](setup)
    assert time.perf_counter() - t0 < 10
    assert "TiB" in str(err.value) and "bound" in str(err.value)
    assert host_bytes_bound() > 0


@pytest.mark.parametrize("iterations", [0, -1])
def test_iterations_below_one_are_refused(cfg, iterations):
    setup = TrainingSetup(model=cfg["llama"], batch_size=1, seq_len=16)
    for run in (trace, measure_cpu_with_details, lambda s, iterations: measure(s, device="cpu",
                                                                               iterations=iterations)):
        with pytest.raises(LlmemError, match="iterations must be"):
            run(setup, iterations=iterations)


def test_moe_trace_runs_under_mixed_precision_as_the_real_step(cfg):
    # was: aten._grouped_mm's meta kernel -> "Expected inputs of BF16 type" (transformers feeds it the fp32 master
    # weights: autocast has no _grouped_mm entry); the fake step now matches the real CPU step byte for byte
    setup = TrainingSetup(model=cfg["mixtral"], batch_size=1, seq_len=32, precision="bf16-mixed")
    traced, _ = trace_with_details(setup, iterations=1, cuda_kernels=False)
    measured, _ = measure_cpu_with_details(setup, iterations=1)
    assert traced.peak_allocated_bytes == measured.peak_allocated_bytes
    assert abs(estimate(setup).peak_allocated_bytes - traced.peak_allocated_bytes) \
        <= 0.01 * traced.peak_allocated_bytes
