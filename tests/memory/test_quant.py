"""A quantised frozen base (--qlora bitsandbytes NF4, --load-in-8bit LLM.int8, --qlora-torchao torchao's NF4Tensor):
storage bytes worked out by hand from each library's layout (and FSDP2's shards of it), the set-ups llmem refuses,
the kbit upcast, the emulated modules peft wraps, and the estimate against the trace (the CI rows themselves run in
test_validate)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from llmem.errors import LlmemError
from llmem.memory.quant import (
    QuantArgs,
    allocated,
    check_quantisable,
    gathered_tensors,
    int8_storage_tensors,
    is_quantised,
    nf4_storage_tensors,
    storage_tensors,
    torchao_dequantise_events,
    torchao_nf4_storage_tensors,
    transients,
)
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
    tr = transients((4096, 4096), "nf4", QuantArgs(True, 2), tokens=4096, input_fp16=False)
    assert allocated(tr.forward) == (1_048_576, 1_048_576, 33_554_432)
    assert allocated(tr.backward) == (1_048_576, 33_554_432)
    assert allocated(transients((4096, 4096), "nf4", QuantArgs(False, 2), 4096, False).forward) == (33_554_432,)
    # int8, bf16 input of 1024 tokens into a 4096 -> 1024 linear: fp16 copy 1024x4096x2, CA int8 1024x4096,
    # SCA fp32 1024x4, int32 product 1024x1024x4; backward: the weight in bf16 and SCB/127 in fp32
    tr8 = transients((1024, 4096), "int8", QuantArgs(True, 2), tokens=1024, input_fp16=False)
    assert allocated(tr8.forward) == (8_388_608, 4_194_304, 4_096, 4_194_304)
    assert allocated(tr8.backward) == (8_388_608, 4_096)
    assert allocated(transients((1024, 4096), "int8", QuantArgs(True, 2), 1024, input_fp16=True).forward)[0] \
        == 4_194_304


def test_nf4_packed_in_the_compute_dtype_for_fsdp_holds_the_same_bytes():
    """bnb_4bit_quant_storage=bf16 (FSDP-QLoRA): _quantize_4bit's out is [(n + 1) // 4, 1] bf16 = n / 2 bytes."""
    assert nf4_storage_tensors(N, True, storage_bytes=2) == nf4_storage_tensors(N, True)
    bf16 = QuantArgs(True, 2, 2)
    # over 2 FSDP2 shards: the packed weight [4,194,304, 1] bf16 is split (2,097,152 rows x 2 B each), its
    # QuantState (absmax uint8, nested absmax, dynamic code, offset, NF4 code) stays whole on every rank
    assert storage_tensors((4096, 4096), "nf4", bf16, shards=2) == (4_194_304, 262_144, 4_096, 1_024, 4, 64)
    assert gathered_tensors((4096, 4096), "nf4", bf16, 2) == (8_388_608,)
    # 3 shards: dim 0 padded to a multiple of 3 (FSDP2): ceil(4,194,304 / 3) = 1,398,102 rows each
    assert storage_tensors((4096, 4096), "nf4", bf16, shards=3)[0] == 1_398_102 * 2
    assert gathered_tensors((4096, 4096), "nf4", bf16, 3) == (1_398_102 * 3 * 2,)


def test_torchao_nf4_tensor_storage_by_hand():
    """NF4Tensor.from_tensor (torchao 0.18; to_nf4(w, 64, 256) as torchtune calls it) of a [2048, 8192] bf16 weight,
    n = 16,777,216: quantized_data uint8 [n/2], quantized_scalers int8 [n/64], quantization_factor bf16 [n/16384],
    scaler_mean bf16 0-d, the nf4 table bf16 [16]."""
    n = 2048 * 8192
    assert torchao_nf4_storage_tensors(n, 2) == (8_388_608, 262_144, 2_048, 2, 32)
    # fp32 model: the factor, the mean and the table in fp32
    assert torchao_nf4_storage_tensors(n, 4) == (8_388_608, 262_144, 4_096, 4, 64)
    # what torchao 0.18's to_nf4 made for a [1024, 512] bf16 weight on fake tensors (inner tensors' nbytes)
    assert torchao_nf4_storage_tensors(1024 * 512, 2) == (262_144, 8_192, 64, 2, 32)
    # 4 + 8/64 + 16/16384 bits per parameter, the scalars aside
    assert 8 * sum(torchao_nf4_storage_tensors(n, 2)[:3]) / n == pytest.approx(4 + 8 / 64 + 16 / 16384)
    # FSDP2 over 2 ranks splits the three inner tensors, keeps scaler_mean and nf4 whole; gathers the three
    args = QuantArgs(dtype_bytes=2)
    assert storage_tensors((2048, 8192), "torchao-nf4", args, shards=2) == (4_194_304, 131_072, 1_024, 2, 32)
    assert gathered_tensors((2048, 8192), "torchao-nf4", args, 2) == (8_388_608, 262_144, 2_048)


def test_torchao_dequantisation_peak_by_hand():
    """get_original_weight of a [1024, 512] bf16 weight (n = 524,288): at torch.stack the two int64 nibble planes
    (4n each), the two looked-up planes, the two scaled planes (n each), the dequantised scalers (n/32) and the
    stacked weight (2n) are live: 14n + n/32 = 7,356,416 B, what torchao 0.18 allocated above its inputs on fake
    tensors; only the weight (2n) is left."""
    n = 1024 * 512
    live = peak = 0
    sizes: dict[int, int] = {}
    for sign, tag, size in torchao_dequantise_events(n, 2):
        if sign > 0:
            sizes[tag] = size
            live += size
            peak = max(peak, live)
        else:
            live -= sizes.pop(tag)
    assert peak == 14 * n + n // 32 == 7_356_416
    assert list(sizes.values()) == [2 * n]


def test_torchao_refuses_weights_it_cannot_quantise_or_shard():
    lin = ParamInfo("model.layers.0.mlp.gate_proj.weight", (1376, 512), "float32", "Linear", 0, None)
    check_quantisable(lin, "torchao-nf4")                   # 704,512 = 43 x 16,384
    with pytest.raises(LlmemError, match="43 scale blocks"):  # 43 factors do not split over 2 ranks
        check_quantisable(lin, "torchao-nf4", shards=2)
    odd = ParamInfo("model.layers.0.mlp.gate_proj.weight", (100, 64), "float32", "Linear", 0, None)
    with pytest.raises(LlmemError, match="64 x 256"):
        check_quantisable(odd, "torchao-nf4")
    check_quantisable(odd, "nf4", shards=2)                 # bitsandbytes pads: no condition


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
    ({"quant_base": "torchao-nf4"}, "--lora-rank"),
    ({"quant_base": "fp4", "lora_rank": 8}, "nf4"),
    ({"quant_base": "int8", "lora_rank": 8, "precision": "bf16"}, "bf16-mixed"),
    ({"quant_base": "int8", "lora_rank": 8, "adapter_dtype": "base"}, "int8"),
    ({"quant_base": "torchao-nf4", "lora_rank": 8, "precision": "bf16-mixed"}, "no autocast"),
    ({"quant_base": "torchao-nf4", "lora_rank": 8, "precision": "fp16", "adapter_dtype": "base"}, "fp16"),
    ({"quant_base": "torchao-nf4", "lora_rank": 8, "precision": "bf16"}, "--adapter-dtype base"),
    ({"quant_base": "torchao-nf4", "lora_rank": 8, "precision": "bf16", "adapter_dtype": "base",
      "double_quant": False}, "no-double-quant"),
    ({"lora_rank": 8, "kbit_upcast": False}, "quantised base only"),
    ({"quant_base": "nf4", "lora_rank": 8, "precision": "bf16", "attn": "flash"}, "no-kbit-upcast"),
])
def test_refused_set_ups(kw, words):
    with pytest.raises(LlmemError, match=words):
        TrainingSetup(model="tiny-llama", **kw)


def test_pure_low_precision_qlora_is_accepted():
    """bitsandbytes NF4 under pure bf16 / fp16 (no autocast), torchtune's torchao QLoRA in bf16 and fp32."""
    for kw in ({"precision": "bf16"}, {"precision": "fp16"}, {"precision": "bf16", "kbit_upcast": False},
               {"precision": "bf16", "adapter_dtype": "base"}):
        TrainingSetup(model="tiny-llama", lora_rank=8, quant_base="nf4", **kw)
    ao = TrainingSetup(model="tiny-llama", lora_rank=8, quant_base="torchao-nf4", precision="bf16",
                       adapter_dtype="base")
    assert not ao.kbit_upcasts and ao.stored_bytes(False) == 2       # torchtune has no kbit upcast
    TrainingSetup(model="tiny-llama", lora_rank=8, quant_base="torchao-nf4", precision="fp32")


@pytest.mark.parametrize("quant, method, words", [
    ("int8", "fsdp", "cannot shard LLM.int8"), ("int8", "zero2", "cannot shard LLM.int8"),
    ("nf4", "tp", "tensor parallelism|TP"), ("torchao-nf4", "fsdp+tp", "tensor parallelism|TP"),
])
def test_methods_refused_once_resolved(quant, method, words):
    """Built without error (a planner can make the set-up), refused by estimate and trace for the method."""
    from llmem.estimator.engine import estimate
    from llmem.runtime.trace import trace
    from llmem.setup.support import QUANTISED_BASE, Case, check_support

    kw = {"precision": "bf16", "adapter_dtype": "base"} if quant == "torchao-nf4" else {}
    setup = TrainingSetup(model="tiny-llama", method=method, gpus=4, lora_rank=8, quant_base=quant, seq_len=32, **kw)
    assert re.search(words, QUANTISED_BASE.refusal(Case(setup, METHODS[method])))    # the feature's own row
    with pytest.raises(LlmemError, match=words):
        check_support(setup, METHODS[method])
    with pytest.raises(LlmemError, match=words):
        estimate(setup)
    with pytest.raises(LlmemError, match=words):
        trace(setup)


@pytest.mark.parametrize("quant, method", [("nf4", "ddp"), ("nf4", "fsdp"), ("nf4", "zero2"), ("int8", "ddp"),
                                           ("torchao-nf4", "fsdp"), ("torchao-nf4", "ddp")])
def test_methods_accepted(quant, method):
    from llmem.setup.support import check_support

    kw = {"precision": "bf16", "adapter_dtype": "base"} if quant == "torchao-nf4" else {}
    check_support(TrainingSetup(model="tiny-llama", method=method, gpus=2, lora_rank=8, quant_base=quant, **kw),
                  METHODS[method])


def test_torchao_over_fsdp_refused_where_nf4_tensor_cannot_split():
    """tiny-llama's MLP weights [1376, 512] have 43 quantization factors: NF4Tensor's nf4_split asserts on 2 ranks
    (the estimate and the trace refuse alike); tiny-mistral's [1792, 512] have 56."""
    from llmem.estimator.engine import estimate
    from llmem.runtime.trace import trace

    kw = {"method": "fsdp", "gpus": 2, "lora_rank": 8, "quant_base": "torchao-nf4", "precision": "bf16",
          "adapter_dtype": "base", "seq_len": 32}
    for engine in (estimate, trace):
        with pytest.raises(LlmemError, match="43 scale blocks"):
            engine(TrainingSetup(model="tiny-llama", **kw))
    assert estimate(TrainingSetup(model="tiny-mistral", **kw)).peak_allocated_bytes > 0


def test_kbit_upcast_off_drops_the_upcast_parameters_to_the_compute_dtype():
    """--no-kbit-upcast: the 2 x 32000 x 512 embedding and lm_head and the 9 norms of 512 stay bf16, 2 bytes each
    fewer than prepare_model_for_kbit_training's fp32; the bf16 lm_head needs no autocast copy any more."""
    from llmem.estimator.states import model_states

    kw = {"model": "tiny-llama", "precision": "bf16-mixed", "lora_rank": 16, "lora_targets": "all-linear",
          "quant_base": "nf4"}
    on = model_states(resolve(TrainingSetup(**kw)))
    off = model_states(resolve(TrainingSetup(kbit_upcast=False, **kw)))
    upcast = 2 * 32000 * 512 + 9 * 512
    assert on.weights - off.weights == upcast * 2 == 65_545_216
    assert on.autocast_weight_copies - off.autocast_weight_copies == 32000 * 512 * 2
    assert on.gradients == off.gradients and on.optimizer_states == off.optimizer_states


def test_fsdp_qlora_states_by_hand():
    """tiny-llama, FSDP2 over 2 GPUs, bf16-mixed, NF4 r16 all-linear, no kbit upcast: the packed weights (bf16
    storage) and the bf16 frozen rest sharded by dim 0, the QuantState whole; a layer gathered in bf16."""
    from llmem.estimator.states import model_states

    setup = TrainingSetup(model="tiny-llama", method="fsdp", gpus=2, precision="bf16-mixed", lora_rank=16,
                          lora_targets="all-linear", quant_base="nf4", kbit_upcast=False)
    ms = model_states(resolve(setup))
    state_sq = 4_096 + 16 * 4 + 1_024 + 4 + 64            # 512x512: absmax uint8, nested, code, offset, NF4 code
    state_mlp = 11_008 + 43 * 4 + 1_024 + 4 + 64           # 1376x512
    # packed bf16 rows: 262,144 / 4 = 65,536 and 704,512 / 4 = 176,128, half of each on this rank, 2 B a row
    quantised = 4 * (4 * (32_768 * 2 + state_sq) + 3 * (88_064 * 2 + state_mlp))
    frozen = 2 * 16_000 * 512 * 2 + 9 * 256 * 2            # embedding, lm_head and norms: bf16, half the rows
    # fp32 adapters, half the rows of each: q, k, v, o A [16, 512] -> 8 rows, B [512, 16] -> 256; gate, up B
    # [1376, 16] -> 688; down A [16, 1376] -> 8 rows of 1376
    adapters = 4 * 4 * (4 * (8 * 512 + 256 * 16) + 2 * (8 * 512 + 688 * 16) + (8 * 1376 + 256 * 16))
    assert ms.weights == quantised + frozen + adapters
    # one layer all-gathered: the packed weights whole (bf16), its two norms and its adapters in bf16
    layer = 4 * 131_072 + 3 * 352_256 + 2 * 512 * 2 + 2 * (4 * 2 * 16 * 512 + 3 * (16 * 512 + 16 * 1376))
    assert ms.fsdp_layer_gathered == layer
    assert ms.fsdp_root_gathered == (2 * 32_000 * 512 + 512) * 2


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
        LinearNF4Emulated,
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
    # FSDP-QLoRA: the packed weight in bf16 (bnb_4bit_quant_storage), [4,194,304, 1], the same bytes
    packed = Linear4bitEmulated(lin, torch.bfloat16, True, torch.bfloat16).weight
    assert packed.dtype == torch.bfloat16 and tuple(packed.shape) == (4_194_304, 1)
    # torchao's NF4Tensor of [4096, 4096] bf16: 8,388,608 + 262,144 + 1,024 x 2 + 2 + 32 bytes, the three FSDP2
    # shards as parameters
    ao = LinearNF4Emulated(lin, torch.bfloat16)
    assert sum(t.numel() * t.element_size() for t in [*ao.parameters(), *ao.buffers()]) == 8_652_834
    assert [n for n, _ in ao.named_parameters()] == ["weight", "quantized_scalers", "quantization_factor"]

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
    # --no-kbit-upcast: a bf16 norm stays bf16; peft's adapters are never upcast (they come after the recipe's step)
    wrap_quant_adapters(peft_model, replace(setup, kbit_upcast=False))
    model.model.norm.weight.data = model.model.norm.weight.data.to(torch.bfloat16)
    wrap_quant_adapters(peft_model, replace(setup, kbit_upcast=False))
    assert model.model.norm.weight.dtype == torch.bfloat16


def test_peft_puts_adapters_over_nf4_in_the_model_dtype():
    """peft's _move_adapter_to_device_of_base_layer casts adapters to the base layer's dtype when it is a float one
    (bitsandbytes' Linear4bit: its compute_dtype; an NF4Tensor: its own dtype); autocast_adapter_dtype=True (peft's
    default) then upcasts them to fp32, torchtune keeps them in the model dtype."""
    import torch
    from peft import LoraConfig, get_peft_model

    from llmem.runtime.build import meta_model_for
    from llmem.runtime.quant_kernels import quantize_base

    for quant, upcast, dtype in (("torchao-nf4", False, torch.bfloat16), ("nf4", False, torch.bfloat16),
                                 ("nf4", True, torch.float32)):
        setup = TrainingSetup(model="tiny-llama", precision="bf16", lora_rank=8, quant_base=quant,
                              adapter_dtype="base")
        model = meta_model_for(setup).to(torch.bfloat16)
        quantize_base(model, setup, fake=True)
        peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj"], task_type="CAUSAL_LM"),
                                    autocast_adapter_dtype=upcast)
        assert {p.dtype for p in peft_model.parameters() if p.requires_grad} == {dtype}, quant


def test_torchao_trace_emulates_and_estimate_agrees():
    """torchtune's QLoRA on tiny-llama in bf16: the trace re-runs NF4Tensor's dequantisation on fake tensors."""
    from llmem.estimator.engine import estimate
    from llmem.runtime.trace import trace

    setup = TrainingSetup(model="tiny-llama", gpu="H100-80GB", precision="bf16", batch_size=1, seq_len=64,
                          lora_rank=8, lora_targets="all-linear", quant_base="torchao-nf4", adapter_dtype="base")
    est, tr = estimate(setup), trace(setup)
    assert any("torchao" in n for n in tr.notes) and any("torchtune" in n for n in est.notes)
    for counter in ("peak_allocated_bytes", "peak_reserved_bytes"):
        assert abs(getattr(est, counter) - getattr(tr, counter)) <= 0.02 * getattr(tr, counter), counter
    # the weights as torchao stores them: per layer 4 x 512x512 and 3 x 1376x512 NF4Tensors (inner tensors each
    # rounded to the allocator's 512 B), the bf16 embedding, lm_head and norms, the bf16 adapters
    def nf4(n):
        return sum(-(-b // 512) * 512 for b in torchao_nf4_storage_tensors(n, 2))
    adapters = 4 * (4 * 2 * 8 * 512 + 3 * (8 * 512 + 8 * 1376)) * 2
    rounded = 4 * (4 * nf4(512 * 512) + 3 * nf4(1376 * 512)) + 2 * 32000 * 512 * 2 + 9 * 1024
    assert tr.components["weights"] == pytest.approx(rounded + adapters, abs=4 * 7 * 2 * 512)


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


def test_planner_qlora_menus():
    """The planner's QLoRA menus: HF/TRL's recipe on replicated layouts, FSDP-QLoRA (no kbit upcast) on sharded
    ones when there are several GPUs, torchtune's for a pure bf16 set-up; each makes a valid set-up."""
    from llmem.planner.suggestions import adapter_menus

    one = {m.kind: m for m in adapter_menus(TrainingSetup(model="tiny-llama"))}
    assert list(one) == ["lora", "qlora"] and one["qlora"].sharded is None
    four = {m.kind: m for m in adapter_menus(TrainingSetup(model="tiny-llama", method="fsdp", gpus=4))}
    assert list(four) == ["lora", "qlora", "fsdp-qlora"]
    assert (four["qlora"].sharded, four["fsdp-qlora"].sharded) == (False, True)
    assert dict(four["fsdp-qlora"].changes)["kbit_upcast"] is False and "--no-kbit-upcast" in four["fsdp-qlora"].flags
    pure = {m.kind: m for m in adapter_menus(TrainingSetup(model="tiny-llama", precision="bf16"))}
    assert dict(pure["qlora"].changes)["precision"] == "bf16-mixed"      # TRL's bf16=True: autocast
    assert dict(pure["qlora-torchao"].changes) == {"quant_base": "torchao-nf4", "adapter_dtype": "base",
                                                   "lora_rank": 16, "lora_targets": "all-linear"}
    for menus, base in ((four, TrainingSetup(model="tiny-llama", method="fsdp", gpus=4)),
                        (pure, TrainingSetup(model="tiny-llama", precision="bf16"))):
        for m in menus.values():
            replace(base, **dict(m.changes))
    assert adapter_menus(TrainingSetup(model="tiny-llama", lora_rank=8, quant_base="nf4")) == []


def test_bnb_lora_under_autocast_keeps_the_attention_output_itself():
    """peft's bitsandbytes LoRA layer casts nothing under autocast (lora/bnb.py `requires_conversion`): behind the
    kbit upcast's fp32 stream, o_proj's lora_A reads the bf16 attention output as it is and keeps that tensor, so
    the o_proj block keeps only lora_B's input [t, rank] bf16; peft's plain lora.Linear casts the input to the fp32
    adapter and autocast casts it back for lora_A, which keeps that bf16 copy [t, hidden] too. tiny-llama: 2 x 256
    tokens, hidden 512, rank 16."""
    from llmem.memory.activations.profile import activation_profile

    t, hidden, rank = 2 * 256, 512, 16

    def o_proj(**kw) -> tuple[int, ...]:
        setup = TrainingSetup(model="tiny-llama", precision="bf16-mixed", batch_size=2, seq_len=256, lora_rank=rank,
                              lora_targets="all-linear", **kw)
        return next(b.tensors for b in activation_profile(resolve(setup)).blocks if b.name == "o_proj")

    assert o_proj(quant_base="nf4") == (t * rank * 2,)
    assert o_proj() == (t * hidden * 2, t * rank * 2)
