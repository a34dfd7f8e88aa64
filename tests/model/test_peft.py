"""peft: --peft-config (configs written by peft's own save_pretrained), --lora-dropout, and the activation terms of
LoRA under autocast, LoRA dropout, DoRA, IA3 and prompt tuning, worked out by hand.

Shapes used below (llmem/catalog/tiny): tiny-llama has 4 layers, hidden 512, 8 heads of 64 (kv 8: k/v width 512),
MLP 1376, vocab 32000; tiny-mistral the same but 2 kv heads (k/v width 128) and MLP 1792."""

from __future__ import annotations

import json
import time

import pytest

from llmem.cli import main
from llmem.errors import LlmemError
from llmem.estimator.engine import estimate
from llmem.memory.activations.profile import activation_profile, dims_for
from llmem.model.anatomy import load_anatomy
from llmem.model.peft import peft_anatomy, read_peft_config, trained_anatomy
from llmem.model.resolved import resolve
from llmem.setup.methods import METHODS
from llmem.setup.precision import regime_for
from llmem.setup.training import TrainingSetup
from llmem.validate.matrices import CI_MATRIX

T = 2 * 256          # tokens of a 2 x 256 micro-batch


def _setup(model="tiny-llama", **kw) -> TrainingSetup:
    return TrainingSetup(model=model, batch_size=2, seq_len=256, gpu="H100-80GB", **kw)


def _save(tmp_path, name, config) -> str:
    folder = tmp_path / name
    config.save_pretrained(str(folder))
    return str(folder)


def _blocks(setup: TrainingSetup) -> dict:
    return {b.name: b for b in activation_profile(resolve(setup)).blocks}


# ---------------------------------------------------------------------------------------------------------------
# trainable sets from peft itself, against hand formulas

def test_lora_config_from_save_pretrained(tmp_path):
    from peft import LoraConfig

    path = _save(tmp_path, "lora", LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    r = estimate(_setup("tiny-mistral", peft_config=path))
    # q: A [8, 512] + B [512, 8]; v: A [8, 512] + B [128, 8] (2 kv heads x 64); 4 layers
    assert r.setup.trainable_params == 4 * (8 * 512 + 512 * 8 + 8 * 512 + 128 * 8) == 53248
    assert r.setup.peft_config == path


def test_modules_to_save_are_named_apart_from_the_adapted_modules(tmp_path):
    """peft's modules_to_save train a whole copy of each module (ModulesToSaveWrapper), beside LoRA's adapters: the
    record names them apart, as peft's own model on the meta device wraps them."""
    import torch
    from peft import LoraConfig, get_peft_model
    from peft.utils import ModulesToSaveWrapper
    from transformers import AutoModelForCausalLM

    from llmem.model.config import resolve_config

    config = LoraConfig(r=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"], task_type="CAUSAL_LM")
    path = _save(tmp_path, "lora-save", config)
    record = estimate(_setup(peft_config=path)).setup
    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(resolve_config("tiny-llama")[1]), config)
    wrapped = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, ModulesToSaveWrapper)}
    assert record.saved_modules == tuple(sorted(wrapped)) == ("lm_head",)
    assert record.adapter_targets == ("q_proj", "v_proj")
    assert record.adapter_text().endswith("on q_proj, v_proj; lm_head trained whole (modules_to_save)")
    assert record.to_dict()["saved_modules"] == ["lm_head"]
    assert "saved_modules" not in estimate(_setup(lora_rank=8)).setup.to_dict()


def test_peft_lora_config_equals_lora_options(tmp_path):
    """The same LoRA through two paths: the anatomy peft builds from a saved config, and --lora-rank's analytic
    with_lora. Same trainable set, same activations, same counters."""
    from peft import LoraConfig

    path = _save(tmp_path, "lora", LoraConfig(r=16, lora_dropout=0.1, target_modules="all-linear",
                                              task_type="CAUSAL_LM"))
    for precision in ("bf16-mixed", "bf16"):
        a = estimate(_setup(precision=precision, peft_config=path))
        b = estimate(_setup(precision=precision, lora_rank=16, lora_targets="all-linear", lora_dropout=0.1))
        assert a.setup.trainable_params == b.setup.trainable_params
        assert (a.peak_allocated_bytes, a.peak_reserved_bytes) == (b.peak_allocated_bytes, b.peak_reserved_bytes)


def test_dora_ia3_prompt_prefix_trainable_counts(tmp_path):
    from peft import IA3Config, LoraConfig, PrefixTuningConfig, PromptTuningConfig

    dora = _save(tmp_path, "dora", LoraConfig(r=8, use_dora=True, target_modules=["q_proj", "v_proj"],
                                              task_type="CAUSAL_LM"))
    ia3 = _save(tmp_path, "ia3", IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                           feedforward_modules=["down_proj"], task_type="CAUSAL_LM"))
    prompt = _save(tmp_path, "prompt", PromptTuningConfig(num_virtual_tokens=20, task_type="CAUSAL_LM"))
    prefix = _save(tmp_path, "prefix", PrefixTuningConfig(num_virtual_tokens=10, task_type="CAUSAL_LM"))
    count = {name: estimate(_setup(model, peft_config=path)).setup.trainable_params
             for name, model, path in (("dora", "tiny-llama", dora), ("ia3", "tiny-mistral", ia3),
                                       ("prompt", "tiny-llama", prompt), ("prefix", "tiny-llama", prefix))}
    # DoRA: LoRA's A [8, 512] + B [512, 8] on q and v, plus a magnitude vector [512] each; 4 layers
    assert count["dora"] == 4 * 2 * (8 * 512 + 512 * 8 + 512) == 69632
    # IA3: a vector per output of k and v (128 each) and per input of down_proj (1792); 4 layers
    assert count["ia3"] == 4 * (128 + 128 + 1792) == 8192
    # prompt tuning: n virtual token embeddings of the hidden size
    assert count["prompt"] == 20 * 512
    # prefix tuning: per virtual token a key and a value for every layer (num_layers * 2 * token_dim)
    assert count["prefix"] == 10 * 4 * 2 * 512


def test_trainable_set_matches_the_traced_peft_model(tmp_path):
    """The anatomy read back from peft agrees with the model the trace runs (requires_grad of the peft model)."""
    from peft import IA3Config

    from llmem.runtime.build import apply_peft, meta_model_for

    path = _save(tmp_path, "ia3", IA3Config(task_type="CAUSAL_LM"))
    setup = _setup("tiny-mistral", precision="bf16-mixed", peft_config=path)
    model = apply_peft(meta_model_for(setup), setup)
    traced = {n.replace("base_model.model.", "", 1): p.numel() for n, p in model.named_parameters()
              if p.requires_grad}
    a = trained_anatomy(load_anatomy(setup.model), setup)
    assert {p.name: p.numel for p in a.params if p.trainable} == traced



@pytest.mark.parametrize("targets", ["all-linear,q_proj", "all-linear,lm_head", "q_proj,v_proj"])
def test_traced_targets_are_the_estimates(targets):
    """peft takes all-linear only as the whole target_modules string: beside other names the trace expands it
    (peft's own rule), so the model it runs trains what the estimate's anatomy trains (a list holding
    "all-linear" would have matched no module and left only the other names adapted)."""
    from llmem.runtime.build import apply_peft, meta_model_for

    setup = _setup("tiny-llama", precision="bf16-mixed", lora_rank=4, lora_targets=targets)
    model = apply_peft(meta_model_for(setup), setup)
    traced = {n.replace("base_model.model.", "", 1): p.numel() for n, p in model.named_parameters()
              if p.requires_grad}
    a = trained_anatomy(load_anatomy(setup.model), setup)
    assert {p.name: p.numel for p in a.params if p.trainable} == traced
    layers = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in traced}
    assert len(layers) == (8 if "lm_head" in targets else 7 if "all-linear" in targets else 2)


# ---------------------------------------------------------------------------------------------------------------
# the adapters' dtype (peft's autocast_adapter_dtype)

def _trained_dtypes(setup: TrainingSetup) -> set:
    """The dtypes of the trained parameters of the model the trace runs."""
    from llmem.runtime.build import apply_peft, meta_model_for

    model = meta_model_for(setup)
    if not setup.mixed and setup.precision != "fp32":
        import torch

        model.to(torch.bfloat16)         # as the step does under pure bf16, before peft
    return {str(p.dtype) for p in apply_peft(model, setup).parameters() if p.requires_grad}


@pytest.mark.parametrize("precision, adapter_dtype, dtype", [
    ("bf16", "fp32", "torch.float32"), ("bf16", "base", "torch.bfloat16"),
    ("bf16-mixed", "fp32", "torch.float32"), ("bf16-mixed", "base", "torch.float32")])
def test_traced_adapters_take_peft_dtype(precision, adapter_dtype, dtype):
    """get_peft_model(autocast_adapter_dtype=True) upcasts bf16 adapters to fp32 (tuners_utils.cast_adapter_dtype);
    False leaves them in the base layer's dtype (_move_adapter_to_device_of_base_layer). Under *-mixed peft builds
    them on the fp32 model: fp32 either way."""
    assert _trained_dtypes(_setup(precision=precision, lora_rank=8, adapter_dtype=adapter_dtype)) == {dtype}


def test_fp32_adapters_on_a_bf16_base_hold_fp32_states():
    """tiny-llama, LoRA r8 on q and v: 4 layers x 2 x (8 x 512 + 512 x 8) = 65,536 adapter parameters. Under pure
    bf16 with peft's default fp32 adapters their weights, gradients and AdamW's two states are 4 B each; with
    --adapter-dtype base 2 B. The frozen base (bf16) is the same in both."""
    from llmem.estimator.states import model_states

    n = 4 * 2 * (8 * 512 + 512 * 8)
    assert n == 65_536
    fp32 = model_states(resolve(_setup(precision="bf16", lora_rank=8)))
    base = model_states(resolve(_setup(precision="bf16", lora_rank=8, adapter_dtype="base")))
    assert (fp32.gradients, fp32.optimizer_states) == (n * 4, 2 * n * 4)
    assert (base.gradients, base.optimizer_states) == (n * 2, 2 * n * 2)
    assert fp32.weights - base.weights == n * (4 - 2)


def test_peft_types_hold_the_dtype_peft_gives_them(tmp_path):
    """--peft-config on a pure bf16 base, read back from peft itself: IA3's vectors (k, v: 512 each; down_proj:
    1376; 4 layers) and DoRA's adapters and magnitudes follow autocast_adapter_dtype like LoRA's; prompt tuning's
    embedding (20 x 512) is fp32 either way (peft builds prompt encoders in fp32 and casts only their output)."""
    from llmem.estimator.states import model_states
    from llmem.validate.matrices import bundled_peft_config

    def grads(name: str, adapter_dtype: str) -> int:
        setup = _setup(precision="bf16", peft_config=bundled_peft_config(name), adapter_dtype=adapter_dtype)
        return model_states(resolve(setup)).gradients

    ia3 = 4 * (512 + 512 + 1376)
    assert (grads("ia3-k-v-down", "fp32"), grads("ia3-k-v-down", "base")) == (ia3 * 4, ia3 * 2)
    assert (grads("prompt-tuning-20", "fp32"), grads("prompt-tuning-20", "base")) == (20 * 512 * 4,) * 2
    dora = grads("dora-r8-all-linear", "fp32")
    assert dora == 2 * grads("dora-r8-all-linear", "base")


# ---------------------------------------------------------------------------------------------------------------
# bad input

def test_bad_peft_config_paths_and_json(tmp_path):
    with pytest.raises(LlmemError, match="does not exist"):
        estimate(_setup(peft_config=str(tmp_path / "nowhere")))
    with pytest.raises(LlmemError, match="no adapter_config.json"):
        estimate(_setup(peft_config=str(tmp_path)))
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(LlmemError, match="malformed peft config"):
        estimate(_setup(peft_config=str(bad)))
    bad.write_text(json.dumps({"r": 8}))
    with pytest.raises(LlmemError, match="no 'peft_type'"):
        estimate(_setup(peft_config=str(bad)))
    bad.write_text(json.dumps({"peft_type": "LORA", "r": 8, "target_modules": ["nonexistent_proj"]}))
    with pytest.raises(LlmemError, match="cannot apply"):
        estimate(_setup(peft_config=str(bad)))


def test_conflicting_and_invalid_options(tmp_path):
    from peft import LoraConfig

    path = _save(tmp_path, "lora", LoraConfig(r=8, task_type="CAUSAL_LM", target_modules=["q_proj"]))
    with pytest.raises(LlmemError, match="--peft-config"):
        _setup(peft_config=path, lora_rank=8)
    with pytest.raises(LlmemError, match="--lora-dropout needs --lora-rank"):
        _setup(lora_dropout=0.1)
    with pytest.raises(LlmemError, match=r"\[0, 1\)"):
        _setup(lora_rank=8, lora_dropout=1.0)
    with pytest.raises(LlmemError, match="tensor parallelism"):
        estimate(TrainingSetup(model="tiny-llama", method="tp", gpus=2, peft_config=path))


def test_cli_peft_config_json_and_errors(tmp_path, capsys):
    from peft import PromptTuningConfig

    path = _save(tmp_path, "prompt", PromptTuningConfig(num_virtual_tokens=8, task_type="CAUSAL_LM"))
    assert main(["estimate", "tiny-llama", "--peft-config", path, "--seq-len", "128", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["setup"]["peft_config"] == path and out["setup"]["trainable_params"] == 8 * 512
    assert main(["estimate", "tiny-llama", "--lora-rank", "8", "--lora-dropout", "0.1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setup"]["lora_dropout"] == 0.1
    assert main(["estimate", "tiny-llama", "--peft-config", str(tmp_path / "missing")]) == 2
    assert main(["estimate", "tiny-llama", "--peft-config", path, "--lora-rank", "8"]) == 2


# ---------------------------------------------------------------------------------------------------------------
# activation terms by hand (tiny-llama / tiny-mistral, 2 x 256 tokens)

def test_lora_under_autocast_keeps_its_own_cast():
    """bf16-mixed, r8 on q and v: the frozen q/k/v keep nothing; each lora_A keeps its bf16 cast of peft's fp32
    copy of x (T x 512 x 2 B), lora_B its input (T x 8 x 2 B). The norm output itself is not kept. v's output
    (the sum base + lora, which SDPA keeps) is made by the adapter, so it is counted there."""
    blocks = _blocks(_setup(precision="bf16-mixed", lora_rank=8))
    qkv = blocks["qkv_proj"]
    assert qkv.tensors == (T * 512 * 2, T * 8 * 2, T * 512 * 2, T * 8 * 2, T * 512 * 2)
    assert len(blocks["attention"].tensors) == 4          # q, k, out, lse
    # forward temporaries: the base output and the fp32 copy of x live for each adapter's forward
    assert (T * 512 * 4) in [n for n, _, _ in qkv.temps]


def test_lora_dropout_keeps_mask_and_output():
    """bf16 (no autocast), r8 on q and v, dropout 0.1, adapters in the base's dtype (autocast_adapter_dtype=False):
    lora_A reads the dropout output (T x 512 x 2 B), native dropout keeps a bool mask (T x 512 x 1 B); the norm
    output is no longer read by any adapter."""
    qkv = _blocks(_setup(precision="bf16", lora_rank=8, lora_dropout=0.1, adapter_dtype="base"))["qkv_proj"]
    assert sorted(qkv.tensors) == sorted((T * 512 * 2, T * 512, T * 8 * 2) * 2 + (T * 512 * 2,))   # + v's output
    assert (T * 512 * 2) in [n for n, _, _ in qkv.temps]     # the norm output: made, read, freed
    no_dropout = _blocks(_setup(precision="bf16", lora_rank=8, adapter_dtype="base"))["qkv_proj"]
    assert sorted(no_dropout.tensors) == sorted((T * 512 * 2, T * 8 * 2, T * 8 * 2, T * 512 * 2))  # + norm output


def test_fp32_adapters_on_a_bf16_base_keep_fp32_copies():
    """bf16, r8 on q and v, peft's default fp32 adapters (lora/layer.py: x cast to lora_A's fp32 dtype, the sum
    with the bf16 base output made in fp32 and cast back): each lora_A keeps its own fp32 copy of the norm output
    (T x 512 x 4 B), lora_B its fp32 input (T x 8 x 4 B); v's output (the bf16 cast of the sum, which SDPA keeps)
    is made by the adapter; the norm output itself is read only by the frozen base linears: not kept. With
    dropout 0.1: lora_A keeps the fp32 dropout output and the bool mask instead, the copy lives until the forward
    returns. Forward temporaries per adapter: lora_B's output, its scaled copy and the sum, fp32 [T, 512]."""
    qkv = _blocks(_setup(precision="bf16", lora_rank=8))["qkv_proj"]
    assert qkv.tensors == (T * 512 * 4, T * 8 * 4, T * 512 * 4, T * 8 * 4, T * 512 * 2)
    assert [n for n, _, _ in qkv.temps].count(T * 512 * 4) == 2 * 3
    dropout = _blocks(_setup(precision="bf16", lora_rank=8, lora_dropout=0.1))["qkv_proj"]
    assert dropout.tensors == (T * 512 * 4, T * 512, T * 8 * 4) * 2 + (T * 512 * 2,)
    assert [n for n, _, _ in dropout.temps].count(T * 512 * 4) == 2 * 4      # + the copy


def test_ia3_terms_by_hand(tmp_path):
    """IA3 on k, v (outputs) and down_proj (input) of tiny-mistral under bf16-mixed: k and v keep their base
    output (T x 128 x 2 B) for the vector's gradient, and v's final output moves here from SDPA's kept tensors;
    down_proj's multiply keeps the fp32 copy of its input (T x 1792 x 4 B)."""
    from peft import IA3Config

    path = _save(tmp_path, "ia3", IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                            feedforward_modules=["down_proj"], task_type="CAUSAL_LM"))
    blocks = _blocks(_setup("tiny-mistral", precision="bf16-mixed", peft_config=path))
    assert blocks["qkv_proj"].tensors == (T * 128 * 2,) * 3
    assert blocks["down_proj"].tensors == (T * 1792 * 4,)
    # SDPA keeps q, k, out (T x 512 x 2 each; k: T x 128 x 2) and the fp32 lse (2 x 8 x 256 x 4): v moved out
    assert blocks["attention"].tensors == (T * 512 * 2, T * 128 * 2, T * 512 * 2, 2 * 8 * 256 * 4)


def test_dora_weight_norm_temporaries():
    """DoRA on tiny-llama (bf16-mixed, r8, all-linear, 2 x 128 tokens): per adapted linear the forward makes
    [out, in] fp32 temporaries (W.to(fp32), lora_weight.to(fp32), s * lora_weight, W + that) and an fp32 eye(in);
    it keeps the base output and lora_B's output [t, out] for the magnitude's gradient, lora_A's bf16 cast of x,
    lora_B's input and three fp32 [out] vectors."""
    from llmem.validate.matrices import bundled_peft_config

    t = 2 * 128
    setup = TrainingSetup(model="tiny-llama", batch_size=2, seq_len=128, precision="bf16-mixed",
                          peft_config=bundled_peft_config("dora-r8-all-linear"))
    blocks = {b.name: b for b in activation_profile(resolve(setup)).blocks}
    gate_up = blocks["gate_up_proj"]
    temps = [n for n, _, _ in gate_up.temps]
    assert temps.count(1376 * 512 * 4) == 2 * 4           # gate and up: four [1376, 512] fp32 temporaries each
    assert temps.count(512 * 512 * 4) == 2                # the fp32 eye(512), once per adapter
    assert gate_up.tensors == (t * 1376 * 2, t * 512 * 2, t * 8 * 2, t * 1376 * 2, 3 * 1376 * 4) * 2
    assert blocks["mlp_act"].tensors == (t * 1376 * 2,) * 3   # gate, act(gate), up; act * up is not kept


def test_prompt_tuning_runs_n_more_tokens(tmp_path):
    from peft import PromptTuningConfig

    path = _save(tmp_path, "prompt", PromptTuningConfig(num_virtual_tokens=20, task_type="CAUSAL_LM"))
    setup = _setup(precision="bf16", peft_config=path)
    a = trained_anatomy(load_anatomy(setup.model), setup)
    assert dims_for(a, setup, 1).s == 256 + 20
    act = activation_profile(resolve(setup))
    assert act.first_layer_skip == 0            # the prompt needs gradients: layer 0 keeps everything
    lora = _setup(precision="bf16", lora_rank=8)
    assert activation_profile(resolve(lora)) \
        .first_layer_skip == 1                  # LoRA on q, v: the input norm of layer 0 keeps nothing


def test_prefix_tuning_falls_back_with_a_note(tmp_path):
    from peft import PrefixTuningConfig

    path = _save(tmp_path, "prefix", PrefixTuningConfig(num_virtual_tokens=10, task_type="CAUSAL_LM"))
    r = estimate(_setup(peft_config=path))
    assert any("no exact activation model for peft type PREFIX_TUNING" in n for n in r.notes)
    assert r.peak_allocated_bytes > 0


def test_peft_estimate_stays_fast(tmp_path):
    from peft import LoraConfig

    path = _save(tmp_path, "lora", LoraConfig(r=8, use_dora=True, target_modules="all-linear",
                                              task_type="CAUSAL_LM"))
    setup = _setup(peft_config=path)
    estimate(setup)                                           # builds and caches the peft anatomy
    start = time.perf_counter()
    for _ in range(5):
        estimate(setup)
    assert (time.perf_counter() - start) / 5 < 0.25
    assert peft_anatomy.cache_info().hits >= 5
    assert read_peft_config(path)[1]["peft_type"] == "LORA"


def test_ci_matrix_covers_the_peft_grid():
    peft_types = {json.loads(open(f"{s.peft_config}/adapter_config.json").read())["peft_type"]
                  + ("+dora" if "dora" in s.peft_config else "") for s in CI_MATRIX if s.peft_config}
    assert peft_types >= {"LORA+dora", "IA3", "PROMPT_TUNING"}
    assert any(s.lora_dropout > 0 for s in CI_MATRIX)
    mixed = {(s.lora_rank, s.lora_targets) for s in CI_MATRIX
             if s.method == "single" and s.precision == "bf16-mixed" and s.lora_rank}
    assert {(8, "q_proj,v_proj"), (64, "all-linear")} <= mixed
    # LoRA on an unquantised base under autocast (peft's fp32 adapters cast their input), both ranks
    autocast = {(s.lora_rank, s.lora_targets) for s in CI_MATRIX
                if s.lora_rank and s.quant_base == "none" and regime_for(s, METHODS[s.method]).autocast}
    assert {(8, "q_proj,v_proj"), (64, "all-linear")} <= autocast


@pytest.mark.slow   # ~20 s on 2 cores; the CI matrix's DoRA rows check the estimate against the trace by default
def test_dora_trace_equals_a_real_cpu_step():
    """The trace's peft path against real tensors: DoRA (which drops lora_weight's graph every forward) on
    tiny-llama, fp32, CPU kernels: the fake-tensor trace and the real CPU step allocate the same bytes."""
    from llmem.runtime.measure import measure
    from llmem.runtime.trace import trace
    from llmem.validate.matrices import bundled_peft_config

    setup = TrainingSetup(model="tiny-llama", seq_len=32, precision="fp32",
                          peft_config=bundled_peft_config("dora-r8-all-linear"))
    fake, real = trace(setup, cuda_kernels=False), measure(setup, device="cpu")
    assert (fake.peak_allocated_bytes, fake.peak_reserved_bytes) == (real.peak_allocated_bytes,
                                                                     real.peak_reserved_bytes)


def test_dora_on_a_quantised_base_is_estimated_with_a_note_and_refused_in_trace():
    from llmem.runtime.trace import trace
    from llmem.validate.matrices import bundled_peft_config

    setup = _setup(precision="bf16-mixed", quant_base="nf4", peft_config=bundled_peft_config("dora-r8-all-linear"))
    assert any("DoRA on a quantised base" in n for n in estimate(setup).notes)
    with pytest.raises(LlmemError, match="DoRA on a bitsandbytes-quantised base"):
        trace(setup)


# ---------------------------------------------------------------------------------------------------------------
# an adapter's buffers (OSF's frozen SVD factors)

OSF = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "llmem/model/catalog/peft/osf-q-v")
# tiny-llama's q_proj and v_proj are [512, 512]; OSF's effective_rank defaults to min(512, 512) // 2 = 256 and keeps
# the initial factors U_low_init [512, 256], S_low_init [256], V_low_init [256, 512] as fp32 buffers (both factors
# square: no U_high / V_high): 262,400 elements per module, 2 modules in each of 4 layers
OSF_BUFFER_NUMEL = 8 * (512 * 256 + 256 + 256 * 512)


def test_osf_buffers_read_from_peft():
    a = trained_anatomy(load_anatomy("tiny-llama"), _setup("tiny-llama", peft_config=OSF))
    assert sum(b.numel for b in a.buffers) == OSF_BUFFER_NUMEL
    assert {b.dtype for b in a.buffers} == {"float32"} and not any(b.trainable for b in a.buffers)
    assert {b.layer_index for b in a.buffers} == {0, 1, 2, 3}


@pytest.mark.parametrize("method, gpus, element_bytes", [("single", 1, 4), ("fsdp", 2, 4), ("ds-zero2", 2, 2)])
def test_osf_buffers_are_whole_weights_on_every_rank(method, gpus, element_bytes):
    """Buffers are neither sharded by FSDP2 nor partitioned by ZeRO; DeepSpeed's module.bfloat16() casts them."""
    from dataclasses import replace

    from llmem.estimator.states import model_states

    r = resolve(_setup("tiny-llama", precision="bf16-mixed", peft_config=OSF, method=method, gpus=gpus))
    without = replace(r, anatomy=replace(r.anatomy, buffers=()))
    assert model_states(r).weights - model_states(without).weights == OSF_BUFFER_NUMEL * element_bytes


def test_anatomy_text_keeps_the_buffers():
    from llmem.model.anatomy import anatomy_text, exact_round_trip

    a = trained_anatomy(load_anatomy("tiny-llama"), _setup("tiny-llama", peft_config=OSF))
    assert a.buffers and exact_round_trip(a, anatomy_text(a, {}))
    assert '"buffers"' not in anatomy_text(load_anatomy("tiny-llama"), {})     # shipped files unchanged
