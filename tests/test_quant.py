"""A bitsandbytes-quantised frozen base (--qlora NF4, --load-in-8bit LLM.int8): storage bytes worked out by hand
from bitsandbytes' layout, the set-ups llmem refuses, the emulated modules peft wraps, and the estimate against the
trace (the CI rows themselves run in test_validate)."""

from __future__ import annotations

import json

import pytest

from llmem.errors import LlmemError
from llmem.memory.quant import int8_storage_tensors, is_quantised, nf4_storage_tensors, transients
from llmem.model.anatomy import ParamInfo
from llmem.model.resolved import resolve
from llmem.setup.methods import METHODS
from llmem.setup.training import TrainingSetup

N = 4096 * 4096   # 16,777,216 elements


def test_nf4_storage_of_a_4096_square_weight_with_double_quant():
    # packed uint8: N/2 = 8,388,608; 262,144 blocks of 64 -> absmax uint8 262,144 B; nested fp32 absmax per 256
    # blocks: 1,024 x 4 = 4,096 B; the nested dynamic code fp32[256] = 1,024 B; offset fp32 = 4 B; NF4 code
    # fp32[16] = 64 B
    assert nf4_storage_tensors(N, double_quant=True) == (8_388_608, 262_144, 4_096, 1_024, 4, 64)
    total = 8_388_608 + 262_144 + 4_096 + 1_024 + 4 + 64
    assert sum(nf4_storage_tensors(N, True)) == total == 8_655_940
    # QLoRA's 4.127 bits per parameter (4 + 8/64 + 32/(64*256)), the code tables aside
    assert 8 * (total - 1_024 - 4 - 64) / N == pytest.approx(4 + 8 / 64 + 32 / (64 * 256))


def test_nf4_storage_of_a_4096_square_weight_without_double_quant():
    # packed 8,388,608 B + fp32 absmax 262,144 x 4 = 1,048,576 B + NF4 code 64 B: 4.5 bits per parameter
    assert nf4_storage_tensors(N, double_quant=False) == (8_388_608, 1_048_576, 64)
    assert sum(nf4_storage_tensors(N, False)) == 9_437_248


def test_nf4_storage_rounds_partial_blocks_up():
    # 1376 x 512 = 704,512 elements: 352,256 packed B, 11,008 blocks, ceil(11,008 / 256) = 43 nested blocks
    assert nf4_storage_tensors(1376 * 512, True) == (352_256, 11_008, 43 * 4, 1_024, 4, 64)
    assert nf4_storage_tensors(65, False) == (33, 2 * 4, 64)


def test_int8_storage_is_the_int8_weight_and_row_scales():
    assert int8_storage_tensors(4096, 4096) == (16_777_216, 16_384)
    assert int8_storage_tensors(14336, 4096) == (14336 * 4096, 14336 * 4)


def test_dequantisation_transients_by_hand():
    # nf4 + double quant, bf16, 4096x4096: forward fp32 absmax and absmax + offset (262,144 x 4 B each) and the
    # bf16 weight (2 x N B); backward one fp32 absmax and the weight
    tr = transients((4096, 4096), "nf4", True, tokens=4096, compute_bytes=2, input_fp16=False)
    assert tr.forward == (1_048_576, 1_048_576, 33_554_432)
    assert tr.backward == (1_048_576, 33_554_432)
    assert transients((4096, 4096), "nf4", False, 4096, 2, False).forward == (33_554_432,)
    # int8, bf16 input of 1024 tokens into a 4096 -> 1024 linear: fp16 copy 1024x4096x2, CA int8 1024x4096,
    # SCA fp32 1024x4, int32 product 1024x1024x4; backward: the weight in bf16 and SCB/127 in fp32
    tr8 = transients((1024, 4096), "int8", True, tokens=1024, compute_bytes=2, input_fp16=False)
    assert tr8.forward == (8_388_608, 4_194_304, 4_096, 4_194_304)
    assert tr8.backward == (8_388_608, 4_096)
    assert transients((1024, 4096), "int8", True, 1024, 2, input_fp16=True).forward[0] == 4_194_304


def test_which_parameters_are_quantised():
    lin = ParamInfo("model.layers.0.self_attn.q_proj.weight", (64, 64), "float32", "Linear", 0, None)
    bias = ParamInfo("model.layers.0.self_attn.q_proj.bias", (64,), "float32", "Linear", 0, None)
    head = ParamInfo("lm_head.weight", (100, 64), "float32", "Linear", None, None)
    tied = ParamInfo("lm_head.weight", (100, 64), "float32", "Linear", None, "model.embed_tokens.weight")
    norm = ParamInfo("model.norm.weight", (64,), "float32", "LlamaRMSNorm", None, None)
    lora = ParamInfo("model.layers.0.self_attn.q_proj.lora_A.default.weight", (8, 64), "float32", "Linear", 0, None)
    assert is_quantised(lin, "nf4") and is_quantised(lin, "int8")
    assert not is_quantised(lin, "none")
    assert not any(is_quantised(p, "nf4") for p in (bias, head, tied, norm, lora))


def test_estimate_weights_of_tiny_llama_qlora_by_hand():
    """tiny-llama: 4 layers, hidden 512, MLP 1376, 8 heads of 64 (q, k, v, o are 512x512), vocab 32000."""
    from llmem.estimator.states import model_states

    setup = TrainingSetup(model="tiny-llama", precision="bf16-mixed", lora_rank=16, lora_targets="all-linear",
                          quant_base="nf4")
    ms = model_states(resolve(setup))
    sq = 131_072 + 4_096 + 16 * 4 + 1_024 + 4 + 64          # 512x512: 262,144 elements, 4,096 blocks
    mlp = 352_256 + 11_008 + 43 * 4 + 1_024 + 4 + 64        # 1376x512: 704,512 elements, 11,008 blocks
    quantised = 4 * (4 * sq + 3 * mlp)
    # embed, lm_head and 9 norms: fp32, as prepare_model_for_kbit_training upcasts them
    frozen_fp32 = 4 * (2 * 32000 * 512 + 4 * 2 * 512 + 512)
    # adapters fp32: q,k,v,o 16x512 + 512x16; gate, up 16x512 + 1376x16; down 16x1376 + 512x16
    adapters = 4 * 4 * (4 * 16_384 + 3 * (8_192 + 22_016))
    assert ms.weights == quantised + frozen_fp32 + adapters
    # autocast casts the fp32 adapters and the fp32 lm_head to bf16; bitsandbytes dequantises the base itself
    assert ms.autocast_weight_copies == adapters // 2 + 32000 * 512 * 2
    no_dq = TrainingSetup(model="tiny-llama", precision="bf16-mixed", lora_rank=16, lora_targets="all-linear",
                          quant_base="nf4", double_quant=False)
    ms2 = model_states(resolve(no_dq))
    assert ms2.weights - ms.weights == 4 * (4 * (4_096 * 3 - 16 * 4 - 1_024 - 4) + 3 * (11_008 * 3 - 43 * 4 - 1_028))


@pytest.mark.parametrize("kw, words", [
    ({"quant_base": "nf4"}, "--lora-rank"),
    ({"quant_base": "int8"}, "--lora-rank"),
    ({"quant_base": "nf4", "lora_rank": 8, "precision": "bf16"}, "bf16-mixed"),
    ({"quant_base": "fp4", "lora_rank": 8}, "nf4"),
])
def test_refused_set_ups(kw, words):
    with pytest.raises(LlmemError, match=words):
        TrainingSetup(model="tiny-llama", **kw)


@pytest.mark.parametrize("method, words", [("fsdp", "FSDP2"), ("zero2", "FSDP2"), ("tp", "tensor parallelism|TP")])
def test_methods_refused_once_resolved(method, words):
    """Built without error (a planner can make the set-up), refused by estimate and trace for the method."""
    from llmem.estimator.engine import estimate
    from llmem.runtime.trace import trace
    from llmem.setup.support import check_support

    setup = TrainingSetup(model="tiny-llama", method=method, gpus=2, lora_rank=8, quant_base="nf4", seq_len=32)
    with pytest.raises(LlmemError, match=words):
        check_support(setup, METHODS[method])
    with pytest.raises(LlmemError, match=words):
        estimate(setup)
    with pytest.raises(LlmemError, match=words):
        trace(setup)
    check_support(TrainingSetup(model="tiny-llama", method="ddp", gpus=2, lora_rank=8, quant_base="nf4"), METHODS["ddp"])


def test_trace_refuses_conv1d_models():
    from llmem.runtime.trace import trace

    with pytest.raises(LlmemError, match="Conv1D"):
        trace(TrainingSetup(model="gpt2", precision="bf16-mixed", seq_len=32, lora_rank=8, lora_targets="c_attn",
                            quant_base="nf4"))


def test_cli_options(capsys):
    from llmem.cli import main

    assert main(["estimate", "tiny-llama", "--qlora", "--lora-rank", "8", "--json"]) == 0
    setup = json.loads(capsys.readouterr().out)["setup"]
    assert setup["quant_base"] == "nf4" and setup["double_quant"] is True
    assert main(["estimate", "tiny-llama", "--qlora", "--no-double-quant", "--lora-rank", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setup"]["double_quant"] is False
    assert main(["estimate", "tiny-llama", "--load-in-8bit", "--lora-rank", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setup"]["quant_base"] == "int8"
    assert main(["estimate", "tiny-llama", "--qlora", "--load-in-8bit", "--lora-rank", "8"]) == 2
    assert main(["estimate", "tiny-llama", "--qlora"]) == 2
    assert main(["estimate", "tiny-llama", "--no-double-quant", "--lora-rank", "8"]) == 2
    assert "--lora-rank" in capsys.readouterr().err


def test_emulated_modules_hold_bitsandbytes_storage_and_peft_wraps_them():
    import torch
    from peft import LoraConfig, get_peft_model
    from torch import nn

    from llmem.runtime.build import meta_model_for
    from llmem.runtime.quant_kernels import (
        Linear4bitEmulated,
        Linear8bitLtEmulated,
        quantize_base,
        wrap_quant_adapters,
    )

    with torch.device("meta"):
        lin = nn.Linear(4096, 4096, bias=False)
    for dq, expected in ((True, 8_655_940), (False, 9_437_248)):
        mod = Linear4bitEmulated(lin, torch.bfloat16, dq)
        held = [*mod.parameters(), *mod.buffers()]
        assert sum(t.numel() * t.element_size() for t in held) == expected
    mod8 = Linear8bitLtEmulated(lin)
    assert sum(t.numel() * t.element_size() for t in [*mod8.parameters(), *mod8.buffers()]) == 16_793_600

    setup = TrainingSetup(model="tiny-llama", precision="bf16-mixed", lora_rank=8, lora_targets="all-linear",
                          quant_base="nf4")
    model = meta_model_for(setup)
    assert quantize_base(model, setup, fake=True) == 4 * 7          # every linear of the layers, not lm_head
    assert type(model.lm_head) is nn.Linear
    peft_model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert wrap_quant_adapters(peft_model) == 4 * 7                 # peft found them all as LoRA targets
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    # prepare_model_for_kbit_training's upcast: every floating parameter left is fp32 (here: was fp32 already;
    # a bf16 one is upcast)
    model.model.norm.weight.data = model.model.norm.weight.data.to(torch.bfloat16)
    wrap_quant_adapters(peft_model)
    assert {p.dtype for p in peft_model.parameters() if p.is_floating_point()} == {torch.float32}
    with pytest.raises(LlmemError, match="measure"):
        quantize_base(meta_model_for(setup), setup, fake=False)


def test_trace_emulates_and_estimate_agrees():
    """The trace runs peft over the emulated bitsandbytes linears; both engines say the kernels are not run."""
    from llmem.estimator.engine import estimate
    from llmem.runtime.trace import trace

    setup = TrainingSetup(model="tiny-llama", gpu="H100-80GB", precision="bf16-mixed", batch_size=1, seq_len=128,
                          lora_rank=8, quant_base="nf4")
    est, tr = estimate(setup), trace(setup)
    assert any("emulated" in n for n in tr.notes)
    assert any("modelled, not run" in n for n in est.notes)
    assert abs(est.peak_allocated_bytes - tr.peak_allocated_bytes) <= 0.02 * tr.peak_allocated_bytes
    # against the bf16 base of plain LoRA: the linears shrink to bitsandbytes' storage, while the embedding,
    # lm_head and 9 norms (2 x 32000 x 512 + 9 x 512 parameters) grow from bf16 to fp32
    plain = trace(TrainingSetup(model="tiny-llama", gpu="H100-80GB", precision="bf16-mixed", batch_size=1,
                                seq_len=128, lora_rank=8))
    linears = 4 * (4 * 512 * 512 + 3 * 1376 * 512)
    saved = plain.components["weights"] - tr.components["weights"]
    upcast = 2 * (2 * 32000 * 512 + 9 * 512)
    expected = linears * 2 - 4 * (4 * 136_324 + 3 * 364_524) - upcast
    assert saved == pytest.approx(expected, abs=28 * 6 * 512)    # each small constant rounds up to 512 B


@pytest.mark.slow
def test_llama_8b_qlora_on_an_rtx4090_estimate_matches_trace():
    """The planner's question (benchmarks/qlora.md): Llama-3.1-8B, QLoRA r16 all-linear, 4096 tokens, batch 1,
    checkpointing, one RTX 4090. The trace runs the real step (peft over emulated bitsandbytes linears) on fake
    tensors; it must fit in 24 GB and the estimate must agree within 2 %."""
    from llmem.estimator.engine import estimate
    from llmem.runtime.trace import trace

    setup = TrainingSetup(model="meta-llama/Llama-3.1-8B", gpu="RTX4090", precision="bf16-mixed", batch_size=1,
                          seq_len=4096, lora_rank=16, lora_targets="all-linear", quant_base="nf4", grad_ckpt=True)
    est, tr = estimate(setup), trace(setup)
    for counter in ("peak_allocated_bytes", "peak_reserved_bytes"):
        truth = getattr(tr, counter)
        assert abs(getattr(est, counter) - truth) <= 0.02 * truth, counter
    assert est.fits and tr.fits
