"""The analytic estimator: component bytes worked out by hand from the published shapes, and invariants."""

from __future__ import annotations

import json
import math

import pytest
from catalog_models import catalog_params

from llmem.errors import LlmemError
from llmem.estimator.engine import estimate
from llmem.model.anatomy import load_anatomy
from llmem.model.families import tp_refusal_of
from llmem.model.resolved import assemble, resolve
from llmem.setup.gpus import resolve_gpu
from llmem.setup.precision import PRECISIONS
from llmem.setup.training import TrainingSetup

MIB = 1024**2
WORKSPACE_A100 = 2 * 4096 * 1024 + 8 * 16 * 1024   # cuBLAS ":4096:2:16:8" (hardware.py assumption)


def step(result) -> dict:
    """Components of the optimizer-step moment."""
    return next(m for m in result.moments if m["phase"] == "optimizer_step")["components"]


# --- Llama-2-7B under FSDP on 8 GPUs: the "done when" -----------------------------------------------------

LLAMA2_7B_P = 6_738_415_616


def test_llama2_7b_fsdp8_model_states_cli_json(capsys):
    """4 (fp32 shard) + 4 (grad shard) + 8 (Adam m, v) + 4 (foreach sqrt temp) = 20 bytes per parameter / 8 GPUs.

    Every Llama-2-7B tensor's dim 0 (4096, 11008, 32000) divides by 8, so FSDP2 adds no padding. (In process: the
    `python -m llmem.cli` entry point itself is tests/cli/test_cli.py's.)
    """
    from llmem.cli import main

    assert main(["estimate", "meta-llama/Llama-2-7b-hf", "--method", "fsdp", "--gpus", "8", "--precision",
                 "bf16-mixed", "--batch-size", "1", "--seq-len", "1024", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes", "gpu_memory_bytes", "fits",
                "components", "setup"):
        assert key in data
    assert data["setup"]["total_params"] == LLAMA2_7B_P
    s = next(m for m in data["moments"] if m["phase"] == "optimizer_step")["components"]
    assert s["weights"] == 4 * LLAMA2_7B_P // 8 == 3_369_207_808
    assert s["gradients"] == 4 * LLAMA2_7B_P // 8
    assert s["optimizer_states"] == 8 * LLAMA2_7B_P // 8
    assert s["optimizer_temporaries"] == 4 * LLAMA2_7B_P // 8
    assert sum(s.values()) - s["cuda_workspaces"] == 20 * LLAMA2_7B_P // 8
    # the FSDP buffers of the backward: root (embed, lm_head 32000x4096 each, norm 4096) and one layer, in bf16
    layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    root = 2 * 32000 * 4096 + 4096
    top = data["moments"][2]["components"]        # backward of the top decoder layer
    assert top["gathered_weights"] == 2 * (root + layer)
    assert top["communication_buffers"] == 2 * layer            # the next layer's prefetched all-gather (bf16)
    bottom = data["moments"][3]["components"]     # bottom layer: the layer above is still being reduce-scattered
    assert bottom["communication_buffers"] == 4 * layer          # reduce-scatter input in fp32 (reduce_dtype)
    # the counters come from the allocation schedule: allocated >= the largest moment, reserved >= allocated
    assert data["peak_allocated_bytes"] >= max(m["allocated_bytes"] for m in data["moments"])
    assert data["peak_reserved_bytes"] >= data["peak_allocated_bytes"]


# --- GPT-2 single GPU: weights, AdamW, activations by hand --------------------------------------------------------

GPT2_P = 124_439_808


def test_gpt2_single_fp32_adamw_step():
    r = estimate(TrainingSetup("gpt2", batch_size=1, seq_len=128, precision="fp32"))
    s = step(r)
    assert s["weights"] == 4 * GPT2_P and s["gradients"] == 4 * GPT2_P
    assert s["optimizer_states"] == 8 * GPT2_P and s["optimizer_temporaries"] == 4 * GPT2_P
    assert r.peak_phase == "optimizer_step"
    tensors = sum(v for k, v in r.components.items()
                  if k not in ("block_rounding", "allocator_overhead", "cuda_context"))
    assert tensors == 20 * GPT2_P + WORKSPACE_A100
    # the allocator hands out whole blocks: a large block is split only when > 1 MiB would remain (148 tensors,
    # one 2 MiB small-pool segment per pool at most), so rounding stays below 1 MiB per tensor
    assert 0 <= r.peak_allocated_bytes - tensors < 148 * 4 * 1024**2


def test_gpt2_activations_fp32_by_hand():
    """GPT-2 block in fp32, SDPA (flash), dropout 0.1 everywhere (CUDA: bool masks), gelu_new as HF writes it.

    Kept per layer, T tokens, h = 768, i = 3072, 12 heads:
      ln_1 input x 4Th + mean/rstd 2*4T; c_attn input (ln_1 output) 4Th; qkv output (q, k, v views) 12Th;
      SDPA output 4Th + logsumexp 4*12*T; resid dropout mask T*h; ln_2 input 4Th + 8T; c_fc input 4Th;
      gelu_new: x, tanh, 1+tanh, 0.5x, product = 5 * 4Ti; second resid dropout mask T*h.
    """
    b, s, h, i, heads = 2, 256, 768, 3072, 12
    t = b * s
    per_layer = (4 * t * h + 8 * t) + 4 * t * h + 12 * t * h + (4 * t * h + 4 * heads * t) + t * h \
        + (4 * t * h + 8 * t) + 4 * t * h + 20 * t * i + t * h
    embed = t * h                                   # embedding dropout mask
    head = 4 * t * h + 8 * t + 4 * t * h            # ln_f input and stats, lm_head input
    r = estimate(TrainingSetup("gpt2", batch_size=b, seq_len=s, precision="fp32", optimizer="sgd"))
    loss_backward = r.moments[1]["components"]
    assert loss_backward["activations"] == 12 * per_layer + embed + head
    assert loss_backward["logits_and_loss"] == 3 * 4 * t * 50257


# --- OPT-125m under DDP: gradient buckets -------------------------------------------------------------------------

def test_opt125m_ddp_buckets():
    p = 125_239_296
    r = estimate(TrainingSetup("facebook/opt-125m", method="ddp", gpus=4, precision="fp32", seq_len=128))
    s = step(r)
    assert s["communication_buffers"] == 4 * p          # gradient_as_bucket_view=False: a second fp32 copy
    assert sum(s.values()) == 24 * p + WORKSPACE_A100


# --- Qwen2.5-0.5B under TP=2: column/row shards, tied vocab-parallel embedding ------------------------------------

def test_qwen25_05b_tp2_weights_by_hand():
    h, kv, i, vocab, layers = 896, 128, 4864, 151936, 24
    q_local = (h // 2) * h + h // 2               # q_proj weight rows split, bias split
    kv_local = 2 * ((kv // 2) * h + kv // 2)      # k_proj, v_proj
    o_local = h * (h // 2)                        # o_proj: input features split, no bias
    mlp_local = 2 * (i // 2) * h + h * (i // 2)   # gate, up by rows; down by columns
    norms = 2 * h                                 # replicated
    layer = q_local + kv_local + o_local + mlp_local + norms
    embed = (vocab // 2) * h                      # tied with lm_head: one tensor, vocab split
    total_local = layers * layer + embed + h
    r = estimate(TrainingSetup("Qwen/Qwen2.5-0.5B", method="tp", gpus=2, precision="bf16", seq_len=256))
    assert step(r)["weights"] == 2 * total_local
    # the vocab-parallel embedding's gradient is replicated (full size) under DTensor: not smaller than the shard
    assert step(r)["gradients"] >= 2 * total_local


# --- BLOOM-560m under FSDP on 3 GPUs: FSDP2 pads dim 0 to a multiple of 3 ---------------------------------------

def test_bloom560m_fsdp3_padding_by_hand():
    h, vocab, layers = 1024, 250880, 24
    pad = lambda dim0, rest=1: math.ceil(dim0 / 3) * rest   # noqa: E731
    layer = (pad(h) * 2                                      # input_layernorm weight, bias
             + pad(3 * h, h) + pad(3 * h)                    # query_key_value
             + pad(h, h) + pad(h)                            # dense
             + pad(h) * 2                                    # post_attention_layernorm
             + pad(4 * h, h) + pad(4 * h)                    # dense_h_to_4h
             + pad(h, 4 * h) + pad(h))                       # dense_4h_to_h
    root = pad(vocab, h) + 2 * pad(h) + 2 * pad(h)           # word_embeddings (tied lm_head), 2 layernorms
    r = estimate(TrainingSetup("bigscience/bloom-560m", method="fsdp", gpus=3, precision="bf16", seq_len=128))
    assert step(r)["weights"] == 2 * (layers * layer + root)


# --- Mistral-7B with checkpointing: one layer input per layer ---------------------------------------------------

def test_mistral_grad_ckpt_keeps_layer_inputs():
    b, s, h = 1, 2048, 4096
    full = estimate(TrainingSetup("mistralai/Mistral-7B-v0.1", method="fsdp", gpus=8, batch_size=b, seq_len=s))
    ckpt = estimate(TrainingSetup("mistralai/Mistral-7B-v0.1", method="fsdp", gpus=8, batch_size=b, seq_len=s,
                                  grad_ckpt=True))
    # FSDP mixed precision: bf16 stream, so each checkpointed layer keeps 2*b*s*h bytes
    loss_full = full.moments[1]["components"]["activations"]
    loss_ckpt = ckpt.moments[1]["components"]["activations"]
    assert loss_ckpt < loss_full / 5
    assert loss_ckpt >= 32 * 2 * b * s * h


def test_offload_optimizer_drops_states():
    r = estimate(TrainingSetup("gpt2", precision="fp32", seq_len=128, offload_optimizer=True))
    assert step(r)["optimizer_states"] == 0 and step(r)["optimizer_temporaries"] == 0
    assert any("CPU" in n for n in r.notes)


# --- invariants ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,gpus", [("single", 1), ("ddp", 4), ("fsdp", 4), ("zero2", 4), ("tp", 4),
                                         ("fsdp+tp", 8)])
def test_monotone_in_batch_and_sequence(method, gpus):
    def peak(b, s):
        return estimate(TrainingSetup("meta-llama/Llama-3.2-1B", method=method, gpus=gpus, batch_size=b,
                                      seq_len=s)).peak_reserved_bytes
    assert peak(1, 512) <= peak(2, 512) <= peak(4, 512) <= peak(8, 512)
    assert peak(2, 256) <= peak(2, 1024) <= peak(2, 4096)


@pytest.mark.parametrize("model", ["meta-llama/Llama-2-7b-hf", "facebook/opt-1.3b", "bigscience/bloom-1b1"])
def test_more_gpus_never_raise_per_gpu_memory(model):
    def peak(method, gpus, tp=None):
        return estimate(TrainingSetup(model, method=method, gpus=gpus, tp=tp, batch_size=2,
                                      seq_len=512)).peak_allocated_bytes
    fsdp = [peak("fsdp", n) for n in (2, 4, 8, 16, 32)]
    assert fsdp == sorted(fsdp, reverse=True)
    refusal = tp_refusal_of(load_anatomy(model).model_type)
    if refusal is not None:   # no TP plan for the family (bloom): every engine refuses it with the same line
        with pytest.raises(LlmemError, match="no TP plan|not supported"):
            peak("tp", 2)
        return
    tp = [peak("tp", n) for n in (2, 4, 8)]
    assert tp == sorted(tp, reverse=True)


def test_components_sum_to_counters():
    r = estimate(TrainingSetup("meta-llama/Llama-3.1-8B", method="fsdp", gpus=8, seq_len=4096, batch_size=2))
    comps = r.components
    allocated = sum(v for k, v in comps.items() if k not in ("allocator_overhead", "cuda_context"))
    assert allocated == r.peak_allocated_bytes
    # the reserved peak on the GPU: capped where the allocator releases its cache (here the uncapped peak, 89.4
    # GiB, is over the A100's 79.15 GiB while 74.6 GiB are allocated)
    assert allocated + comps["allocator_overhead"] == r.reserved_on_device_bytes
    assert r.reserved_on_device_bytes < r.peak_reserved_bytes
    assert sum(comps.values()) == r.device_used_bytes
    assert r.fits and r.device_used_bytes <= resolve_gpu("A100-80GB").memory_bytes


def _tp_for(model: str) -> int | None:
    from llmem.model.anatomy import load_anatomy

    a = load_anatomy(model)
    return next((t for t in (8, 4, 2, 5, 3, 6, 7) if a.num_heads % t == 0 and a.num_kv_heads % t == 0), None)


@pytest.mark.parametrize("model", catalog_params())
def test_every_catalog_model_every_method_and_precision(model):
    tp = _tp_for(model)
    for precision in PRECISIONS:
        layouts = [("single", 1, None, None), ("ddp", 8, None, None), ("fsdp", 8, None, None),
                   ("zero2", 8, None, None)]
        refusal = tp_refusal_of(load_anatomy(model).model_type)
        if refusal is not None:   # the family has no TP plan: refused, as the trace and measure refuse it
            with pytest.raises(LlmemError) as exc:
                estimate(TrainingSetup(model, method="tp", gpus=2, precision=precision, seq_len=512))
            assert str(exc.value) == refusal or "does not divide" in str(exc.value)   # heads checked first
        elif tp is None:   # multi-query attention (one kv head): no tensor-parallel split exists
            with pytest.raises(LlmemError, match="does not divide"):
                estimate(TrainingSetup(model, method="tp", gpus=2, precision=precision, seq_len=512))
        else:
            layouts += [("tp", tp, tp, tp), ("fsdp+tp", 2 * tp, tp, tp)]
        for method, gpus, tp_degree, per_node in layouts:
            r = estimate(TrainingSetup(model, method=method, gpus=gpus, tp=tp_degree, gpus_per_node=per_node,
                                       precision=precision, seq_len=512))
            assert r.peak_allocated_bytes > 0 and r.peak_reserved_bytes >= r.peak_allocated_bytes


@pytest.mark.parametrize("kwargs,match", [
    ({"batch_size": 0}, "batch-size"), ({"seq_len": -1}, "seq-len"), ({"precision": "int3"}, "precision"),
    ({"optimizer": "adam9"}, "optimizer"), ({"attn": "flash9"}, "attention"),
])
def test_bad_setups(kwargs, match):
    with pytest.raises(LlmemError, match=match):
        TrainingSetup("gpt2", **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"method": "tp", "gpus": 3}, "does not divide"),
    ({"method": "fsdp+tp", "gpus": 8, "tp": 3}, "does not divide"),
    ({"method": "single", "gpus": 2}, "one GPU"),
    ({"method": "tp", "gpus": 16, "gpus_per_node": 8}, "inside a node"),
])
def test_impossible_layouts(kwargs, match):
    with pytest.raises(LlmemError, match=match):
        estimate(TrainingSetup("meta-llama/Llama-2-7b-hf", **kwargs))


# --- LoRA: frozen base in the compute dtype, adapters trained -----------------------------------------------------

def test_lora_all_linear_llama31_8b_by_hand():
    # per layer: r * (in + out) for q, k, v, o, gate, up, down with h 4096, kv 1024, i 14336
    r, h, kv, i = 16, 4096, 1024, 14336
    per_layer = r * ((h + h) + (h + kv) * 2 + (h + h) + (h + i) * 3)
    adapters = 32 * per_layer
    assert adapters == 41_943_040                       # what peft prints for this model and config
    base = 8_030_261_248
    res = estimate(TrainingSetup("meta-llama/Llama-3.1-8B", precision="bf16-mixed", seq_len=512,
                                 lora_rank=r, lora_targets="all-linear"))
    assert res.setup.trainable_params == adapters
    s = step(res)
    assert s["weights"] == 2 * base + 4 * adapters       # frozen base in bf16, adapters in fp32
    assert s["gradients"] == 4 * adapters
    assert s["optimizer_states"] == 8 * adapters and s["optimizer_temporaries"] == 4 * adapters


def test_lora_bad_targets_and_tp():
    with pytest.raises(LlmemError, match="not found"):
        estimate(TrainingSetup("gpt2", lora_rank=8, lora_targets="q_proj"))      # GPT-2 has c_attn, not q_proj
    with pytest.raises(LlmemError, match="tensor parallelism"):
        estimate(TrainingSetup("meta-llama/Llama-2-7b-hf", method="tp", gpus=2, lora_rank=8))


@pytest.mark.parametrize("kw, words", [({"lora_rank": 8}, "LoRA / peft with tensor parallelism"),
                                       ({"fused_ce": True}, "--fused-ce with tensor parallelism")])
def test_resolved_method_check_refuses_peft_and_fused_ce_with_tp_in_every_engine(kw, words):
    """One check (config.check_optimizer_method) for estimate, the planner's quick search and the trace."""
    from llmem.estimator.engine import quick_peak_allocated
    from llmem.model.anatomy import load_anatomy
    from llmem.runtime.trace import trace
    from llmem.setup.gpus import resolve_gpu

    setup = TrainingSetup("tiny-llama", method="tp", gpus=2, precision="bf16", **kw)
    for run in (lambda: estimate(setup), lambda: trace(setup),
                lambda: quick_peak_allocated(resolve(setup, load_anatomy("tiny-llama"), resolve_gpu("H100-80GB")))):
        with pytest.raises(LlmemError, match=words):
            run()


def test_offloaded_optimizer_host_bytes_are_fp32_states_and_master_of_the_trained_share():
    from dataclasses import replace

    from llmem.estimator.states import offloaded_optimizer_host_bytes
    from llmem.model.anatomy import load_anatomy
    from llmem.setup.layout import Layout

    a = load_anatomy("gpt2")
    single = Layout("single", 1, 1, 1)
    full = TrainingSetup(model="gpt2", precision="bf16", offload_optimizer=True)
    # 124,439,808 parameters (GPT-2 small, tied): AdamW's two fp32 states + an fp32 master copy, whatever the
    # training precision
    assert offloaded_optimizer_host_bytes(assemble(full, a, resolve_gpu(full.gpu), single)) == 124_439_808 * 4 * 3
    # LoRA r8 on c_attn: only the adapters are trained, 12 layers x 8 x (768 + 2304)
    lora = replace(full, lora_rank=8, lora_targets="c_attn")
    assert offloaded_optimizer_host_bytes(assemble(lora, a, resolve_gpu(lora.gpu), single)) == 12 * 8 * (768 + 2304) * 12
