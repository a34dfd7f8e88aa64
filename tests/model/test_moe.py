"""MoE models as MoE: memory independent of the routing (transformers' grouped_mm experts), the routing assumption
stated, experts sharded by FSDP2 as any parameter, the learned copy's read layer a routed one, TP refused."""

from __future__ import annotations

import json
from math import ceil, prod

import pytest
import torch

from llmem.errors import LlmemError
from llmem.estimator.engine import estimate
from llmem.learn.shallow_copy import shallow_config
from llmem.model.anatomy import load_anatomy
from llmem.model.catalog import find_entry, load_config_dict
from llmem.model.config import build_meta_model, config_from_dict
from llmem.runtime.measure import measure_cpu_with_details
from llmem.runtime.trace import trace_with_details
from llmem.setup.training import TrainingSetup

TINY_MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 64,
            "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000, "max_position_embeddings": 512,
            "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "config.json"
    path.write_text(json.dumps(TINY_MOE))
    return str(path)


def _all_to_two_experts(monkeypatch) -> list[int]:
    """Every token routed to experts 0 and 1 (the most unbalanced routing top-2 allows), in the real router; the
    list counts the routed calls."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    original = m.Qwen3MoeTopKRouter.forward
    calls: list[int] = []

    def forward(self, hidden_states):
        logits, scores, indices = original(self, hidden_states)
        calls.append(1)
        return logits, scores, torch.arange(indices.shape[-1]).expand_as(indices).contiguous()

    monkeypatch.setattr(m.Qwen3MoeTopKRouter, "forward", forward)
    return calls


def test_memory_does_not_depend_on_the_routing(tiny_moe, monkeypatch):
    """The trace (fake tensors: no routing data at all) and the real CPU step with every token sent to two experts
    allocate the same bytes at the peak (test_engines_agree checks the trace against the real step's own routing)."""
    setup = TrainingSetup(model=tiny_moe, batch_size=2, seq_len=16, precision="bf16-mixed")
    traced, _ = trace_with_details(setup, iterations=1, cuda_kernels=False)
    calls = _all_to_two_experts(monkeypatch)
    skewed, _ = measure_cpu_with_details(setup, iterations=1)
    assert len(calls) == TINY_MOE["num_hidden_layers"]
    assert traced.peak_allocated_bytes == skewed.peak_allocated_bytes


def test_routing_assumption_is_stated(tiny_moe):
    moe = estimate(TrainingSetup(model=tiny_moe, batch_size=1, seq_len=32))
    assert any(n.startswith("MoE: 4 routed experts, top-2 per token") for n in moe.notes)
    dense = estimate(TrainingSetup(model="tiny-llama", batch_size=1, seq_len=32))
    assert not any(n.startswith("MoE:") for n in dense.notes)


def test_fsdp_shards_the_experts_as_any_parameter(tiny_moe):
    """FSDP2 shards every parameter on dim 0 (padded to a multiple of the world size): the 3-D expert weights
    [experts, out, in] split by experts; the estimate's sharded fp32 weights are that sum, worked out here."""
    anatomy = load_anatomy(tiny_moe)
    experts = [p for p in anatomy.params if ".experts." in p.name]
    assert {p.shape[0] for p in experts} == {4}
    world = 2
    by_hand = sum(ceil(p.shape[0] / world) * prod(p.shape[1:]) * 4 for p in anatomy.params)
    got = estimate(TrainingSetup(model=tiny_moe, method="fsdp", gpus=world, batch_size=1, seq_len=32,
                                 precision="bf16-mixed"))
    assert got.components["weights"] == by_hand


def test_learned_copy_reads_a_routed_layer():
    """DeepSeek-V3's first 3 layers are dense: the 2-layer copy activations are learned from keeps layer 1 routed."""
    raw = load_config_dict(find_entry("deepseek-ai/DeepSeek-V3"))
    copy = shallow_config(raw, 2)
    assert copy["num_hidden_layers"] == 2 and copy["first_k_dense_replace"] == 1
    model = build_meta_model(config_from_dict(copy, "copy"))
    assert not hasattr(model.model.layers[0].mlp, "experts") and hasattr(model.model.layers[1].mlp, "experts")


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3"])
def test_tensor_parallel_refused(model):
    with pytest.raises(LlmemError, match="experts are fused 3-D parameters"):
        estimate(TrainingSetup(model=model, method="tp", gpus=2, batch_size=1, seq_len=32))


def test_flash_refused_for_mla():
    """MLA's value heads are narrower than its query/key heads: PyTorch's flash kernel takes one head dim for all."""
    with pytest.raises(LlmemError, match="--attn flash is not modelled for deepseek_v3"):
        estimate(TrainingSetup(model="tiny-deepseek-v3", precision="bf16", attn="flash", batch_size=1, seq_len=32))
