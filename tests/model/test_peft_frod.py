"""peft's FRoD built data-free (llmem.model.peft_data_free.frod_on_meta) against peft's own FRoD on a small model
with real random weights, its trainable set by hand, the buffers it makes in the base's dtype, its sparse S's
coalesce on fake tensors, and runtime_offload_base_weight (the adapted base weights on the host)."""

from __future__ import annotations

import json

import pytest
import torch

from llmem.errors import LlmemError
from llmem.model.anatomy import load_anatomy
from llmem.model.peft import apply_peft_config, buffer_bytes, trained_anatomy
from llmem.model.peft_data_free import DATA_FREE_NOTE
from llmem.setup.training import TrainingSetup
from llmem.validate.rows import bundled_peft_config

FROD = {"peft_type": "FROD", "task_type": "CAUSAL_LM", "target_modules": ["q_proj", "v_proj"], "sparse_rate": 0.02,
        "runtime_offload_base_weight": False, "progressbar": False}


def _small_llama():
    from transformers import LlamaConfig

    # kv heads 2 of 16: v_proj [32, 64], q_proj [64, 64]
    return LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128)


def _inventory(model) -> dict[str, tuple]:
    tensors = {f"p:{n}": (tuple(t.shape), t.dtype, t.requires_grad) for n, t in model.named_parameters()}
    tensors |= {f"b:{n}": (tuple(t.shape), t.dtype, False) for n, t in model.named_buffers()}
    return tensors


def test_data_free_frod_matches_peft_on_real_weights():
    # peft's own FRoD (QR of the stacked weights, solves against each weight) on random CPU weights, and llmem's
    # data-free build on the meta device: the same parameters and buffers (names, shapes, dtypes, trained or not)
    from peft import FrodConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    real = get_peft_model(LlamaForCausalLM(_small_llama()), FrodConfig(**{k: v for k, v in FROD.items()
                                                                         if k != "peft_type"}))
    with torch.device("meta"):
        meta = LlamaForCausalLM(_small_llama())
    built = apply_peft_config(meta, json.dumps(FROD), True)
    assert _inventory(built) == _inventory(real)
    names = _inventory(real)
    # by hand (peft/tuners/frod): V [in, in] per category, U [out, in] per module; lambda_l [in] and the sparse S's
    # values, int(in * in * sparse_rate) of them, trained per module
    assert names["b:base_model.frod_V.self_attn_v_proj.default"][0] == (64, 64)
    assert names["b:base_model.model.model.layers.1.self_attn.v_proj.frod_U.default"][0] == (32, 64)
    assert names["p:base_model.model.model.layers.1.self_attn.v_proj.frod_lambda_s_values.default"][0] == (81,)
    assert names["b:base_model.frod_s_indices.self_attn_q_proj.default"][0] == (2, 81)
    assert sum(1 for k, v in names.items() if v[2]) == 2 * 2 * 2


def test_frod_trainable_by_hand_and_noted_data_free():
    # tiny-llama: q_proj and v_proj [512, 512] in 4 layers; per module lambda_l [512] and int(512 * 512 * 0.01)
    # = 2621 values of the sparse S
    setup = TrainingSetup(model="tiny-llama", peft_config=bundled_peft_config("frod-q-v"), gpu="H100-80GB")
    a = trained_anatomy(load_anatomy("tiny-llama"), setup)
    assert sum(p.numel for p in a.params if p.trainable) == 8 * (512 + 2621) == 25_064
    assert any(DATA_FREE_NOTE in n for n in a.peft.notes)
    v = [b for b in a.buffers if ".frod_V." in b.name]
    assert len(v) == 2 and all(b.layer_index is None for b in v)      # shared per category, on the tuner


def test_frod_projections_are_stored_as_the_frozen_base():
    # U [out, in] is made in the base weight's dtype: 2 bytes under bf16-mixed, 4 under fp32; the int64 indices
    # keep their own dtype
    setup = TrainingSetup(model="tiny-llama", peft_config=bundled_peft_config("frod-q-v"), gpu="H100-80GB")
    a = trained_anatomy(load_anatomy("tiny-llama"), setup)
    u = next(b for b in a.buffers if ".frod_U." in b.name)
    idx = next(b for b in a.buffers if ".frod_s_indices." in b.name)
    assert buffer_bytes(u, setup) == 512 * 512 * 2
    assert buffer_bytes(u, TrainingSetup(model="tiny-llama", precision="fp32")) == 512 * 512 * 4
    assert buffer_bytes(idx, TrainingSetup(model="tiny-llama", precision="fp32")) == 2 * 2621 * 8


def test_fake_coalesce_keeps_the_entries_as_a_real_run():
    from llmem.runtime.ledger import TracingFakeMode

    def run():
        flat = torch.tensor([3, 17, 40, 61, 9])          # distinct positions of a [8, 8] S, as FRoD's randperm
        values = torch.ones(5, requires_grad=True)
        s = torch.sparse_coo_tensor(torch.stack([flat // 8, flat % 8]), values * 2, (8, 8)).coalesce()
        (torch.ones(3, 8) @ s.to_dense().t()).sum().backward()
        return s._nnz(), tuple(s._indices().shape), tuple(values.grad.shape)

    real = run()
    with TracingFakeMode(allow_non_fake_inputs=True):
        fake = run()
    assert fake == real == (5, (2, 5), (5,))


def _frod_anatomy(tmp_path, **fields):
    tmp_path.mkdir()
    (tmp_path / "adapter_config.json").write_text(json.dumps(FROD | fields))
    setup = TrainingSetup(model="tiny-llama", peft_config=str(tmp_path), gpu="H100-80GB")
    return trained_anatomy(load_anatomy("tiny-llama"), setup)


def test_frod_runtime_offload_keeps_the_adapted_base_weights_on_the_host(tmp_path):
    # peft/tuners/frod/layer.py Linear._apply / forward: the q_proj and v_proj base weights of the 4 layers
    # ([512, 512] each) on the host; the model's parameter count unchanged
    kept = _frod_anatomy(tmp_path / "on", runtime_offload_base_weight=False)
    off = _frod_anatomy(tmp_path / "off", runtime_offload_base_weight=True)
    assert sorted(p.name for p in off.host_params) == sorted(
        f"model.layers.{i}.self_attn.{m}.weight" for i in range(4) for m in ("q_proj", "v_proj"))
    assert sum(p.numel for p in kept.params) - sum(p.numel for p in off.params) == 8 * 512 * 512
    assert off.total_params == kept.total_params and not kept.host_params
    assert any("(2,097,152 parameters) on the host" in n for n in off.peft.notes)
    # with dropout the forward runs the base layer, which moves its weight to the device for good
    assert not _frod_anatomy(tmp_path / "drop", runtime_offload_base_weight=True, frod_dropout=0.1).host_params


def test_frod_runtime_offload_refused_under_sharded_parameters(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps(FROD | {"runtime_offload_base_weight": True}))
    setup = TrainingSetup(model="tiny-llama", peft_config=str(tmp_path), gpu="H100-80GB", method="fsdp", gpus=2)
    with pytest.raises(LlmemError, match="runtime_offload_base_weight") as info:
        trained_anatomy(load_anatomy("tiny-llama"), setup)
    assert "\n" not in str(info.value)
