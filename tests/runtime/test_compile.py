"""--compile: what a compiled decoder layer keeps for backward, learned through the trace's machinery (the ledger's
lifetimes of the real step on fake tensors), is what autograd itself is handed to save (saved-tensor hooks around
the same compiled layer, an independent record); and the set-ups --compile is not modelled with are refused in one
line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import llmem
from llmem.errors import LlmemError
from llmem.estimator.engine import estimate
from llmem.learn.shallow_copy import learned_activations
from llmem.model.resolved import resolve
from llmem.runtime.compile import compile_layers
from llmem.setup.training import user_setup

B, S = 2, 128
TINY_LLAMA = Path(llmem.__file__).parent / "model" / "catalog" / "tiny" / "tiny-llama.json"


def _saved_by_autograd(compiled: bool, setup=None) -> list[int]:
    """The bytes of each storage autograd is handed to save in decoder layer 1's forward (bf16, SDPA), parameters
    and the batch-free rotary cos / sin left out; `setup`: its quantised base and adapters built as the step builds
    them (torchao's NF4 emulation, peft)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmem.runtime.build import apply_peft, materialize
    from llmem.runtime.distributed import layer_list
    from llmem.runtime.quant_kernels import quantize_base, wrap_quant_adapters

    fields = json.loads(TINY_LLAMA.read_text())
    cfg = AutoConfig.for_model(**{k: v for k, v in fields.items() if k != "architectures"})
    cfg._attn_implementation = "sdpa"
    saved: dict[int, int] = {}
    inside = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if inside[0] and id(storage) not in params and t.shape[0] != 1:
            saved[id(storage)] = storage.nbytes()
        return t

    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):      # built on the meta device, as the step builds it, then made fake
            model = AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    if setup is not None:
        quantize_base(model, setup, fake=True)
        model = apply_peft(model, setup)
        wrap_quant_adapters(model, setup)
    with FakeTensorMode():
        materialize(model, "cpu")
        if compiled:
            compile_layers(model)
        params = {id(p.untyped_storage()) for p in model.parameters()} \
            | {id(b.untyped_storage()) for b in model.buffers()}
        layer = layer_list(model)[1]
        layer.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda m, a, o: inside.__setitem__(0, False))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=torch.randint(0, cfg.vocab_size, (B, S)))
    return sorted(saved.values())


def _learned_kept(compiled: bool, **fields) -> list[int]:
    r = resolve(user_setup(model="tiny-llama", batch_size=B, seq_len=S, precision="bf16", compile=compiled, **fields))
    recipe = learned_activations(r).recipe(B, S)
    # CUDA's flash kernel's RNG seed and offset (8 and 16 bytes, the trace's emulation of the kernel) aside
    return sorted(int(n) for b in recipe.blocks for n in b.tensors if n >= 1024)


def test_a_compiled_layer_keeps_what_autograd_saves(monkeypatch):
    monkeypatch.setenv("LLMEM_LEARN", "auto")      # the tests' default is never (tests/conftest.py)
    kept = _learned_kept(compiled=True)
    assert kept == _saved_by_autograd(compiled=True)
    # the partitioner recomputes what eager autograd keeps (the MLP's activation among them): less is kept
    assert sum(kept) < sum(_saved_by_autograd(compiled=False))


@pytest.mark.slow     # two compiles and a learning run: 45 s on 2 cores (its CI row runs in every CI run)
def test_a_compiled_layer_over_torchao_nf4_keeps_what_autograd_saves(monkeypatch):
    """torchtune's QLoRA compiled: dynamo traces the NF4 dequantisation into the layer's graph, and the partitioner
    keeps each base linear's dequantised bf16 weight for backward (tiny-llama at 2 x 128 tokens: 4 x [512, 512] and
    3 x [1376, 512], no [256, *] tensor of those sizes) on top of what the unquantised compiled layer keeps."""
    monkeypatch.setenv("LLMEM_LEARN", "auto")
    fields = dict(quant_base="torchao-nf4", lora_rank=8, adapter_dtype="base")
    setup = user_setup(model="tiny-llama", batch_size=B, seq_len=S, precision="bf16", compile=True, **fields)
    kept = _learned_kept(compiled=True, **fields)
    saved = _saved_by_autograd(compiled=True, setup=setup)
    assert kept == saved
    dense = _saved_by_autograd(compiled=True, setup=user_setup(model="tiny-llama", batch_size=B, seq_len=S,
                                                               precision="bf16", lora_rank=8, adapter_dtype="base"))
    extra = list(saved)
    for n in dense:
        extra.remove(n)
    assert sorted(extra) == [512 * 512 * 2] * 4 + [1376 * 512 * 2] * 3


@pytest.mark.parametrize("flags, refused", [
    ({"method": "tp", "gpus": 2}, "--compile with tensor / pipeline / context / expert parallelism or DeepSpeed"),
    ({"method": "ds-zero2", "gpus": 2, "precision": "bf16-mixed"}, "--compile with tensor / pipeline"),
    ({"ac_policy": "op"}, "--compile is modelled on a full fine-tune or peft adapters"),
    ({"lora_rank": 8, "quant_base": "nf4"}, "--compile is modelled on a full fine-tune or peft adapters"),
])
def test_what_compile_is_not_modelled_with_is_one_line(flags, refused):
    with pytest.raises(LlmemError) as exc:
        estimate(user_setup(model="tiny-llama", compile=True, seq_len=64, **flags))
    assert str(exc.value).startswith(refused) and "\n" not in str(exc.value)


def test_compile_needs_learning(monkeypatch):
    monkeypatch.setenv("LLMEM_LEARN", "never")
    with pytest.raises(LlmemError, match=r"^--compile needs the activations learned from the real compile pipeline"):
        estimate(user_setup(model="tiny-llama", compile=True, seq_len=64))


def test_the_plans_exports_do_not_drop_compile():
    from llmem.planner.export import check_exportable

    with pytest.raises(LlmemError, match=r"cannot express --compile"):
        check_exportable(user_setup(model="tiny-llama", compile=True, method="fsdp", gpus=2), kind="torchtitan")


def test_a_deep_model_compiles_one_graph_for_all_its_layers(tmp_path_factory):
    """Past dynamo's recompile limit (8) a per-layer graph would be a hard failure under fullgraph: the layers share
    one graph (their layer_idx a symbolic int; llmem builds with use_cache=False)."""
    import torch._dynamo.utils
    from micro_model import MICRO, write_config

    from llmem.runtime.trace import trace

    config = write_config(tmp_path_factory, {**MICRO, "num_hidden_layers": 12})
    torch._dynamo.utils.counters.clear()
    result = trace(user_setup(model=config, compile=True, precision="bf16", seq_len=64), iterations=1)
    assert result.peak_allocated_bytes > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
