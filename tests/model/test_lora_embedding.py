"""peft's LoRA on the input embedding (`--lora-targets embed_tokens,...`): the trained parameters against peft's own
model built on the meta device, what the embedding adapter keeps by hand (tiny-llama: vocab 32000, hidden 512), and
the targets still refused."""

from __future__ import annotations

import re
import warnings

import pytest

from llmem import estimate
from llmem.errors import LlmemError
from llmem.memory.activations.embedding_adapter import embedding_adapter_kept, embedding_adapters
from llmem.model.resolved import resolve
from llmem.setup.training import TrainingSetup


def lora(model: str = "tiny-llama", targets: str = "embed_tokens,q_proj", **kw) -> TrainingSetup:
    return TrainingSetup(**{"model": model, "gpu": "H100-80GB", "batch_size": 2, "seq_len": 128,
                            "precision": "bf16-mixed", "lora_rank": 8, "lora_targets": targets, **kw})


def peft_trained(model: str, targets: list[str]) -> dict[str, tuple[int, ...]]:
    """peft's own trained parameters (name -> shape) of a LoRA r8 on the meta-built model."""
    from peft import LoraConfig, get_peft_model

    from llmem.model.config import build_meta_model, resolve_config

    _, cfg = resolve_config(model, False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # peft warns about LoRA on a tied embedding
        peft_model = get_peft_model(build_meta_model(cfg, False),
                                    LoraConfig(r=8, lora_alpha=16, target_modules=targets, task_type="CAUSAL_LM"))
    return {n.removeprefix("base_model.model."): tuple(p.shape)
            for n, p in peft_model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(("model", "targets"), [
    ("tiny-llama", "embed_tokens,q_proj"),
    ("tiny-qwen2", "embed_tokens,v_proj"),          # tied input and output embeddings: the adapter on the input one
    ("tiny-qwen2", "embed_tokens,lm_head"),
    ("gpt2", "wte,c_attn"),
])
def test_trained_parameters_are_peft_own(model, targets):
    ours = {p.name: p.shape for p in resolve(lora(model, targets)).anatomy.params if p.trainable}
    assert ours == peft_trained(model, targets.split(","))


def test_the_embedding_adapter_count_by_hand():
    """A [8, 32000] + B [512, 8] on the embedding, q_proj's A [8, 512] + B [512, 8] in each of 4 layers."""
    trained = sum(p.numel for p in resolve(lora()).anatomy.params if p.trainable)
    assert trained == 8 * 32000 + 512 * 8 + 4 * (8 * 512 + 512 * 8) == 292_864


@pytest.mark.parametrize(("fields", "kept"), [
    ({}, (256 * 8 * 2, 8 * 512 * 2)),               # autocast: bf16 copies of after_A [t, r] and of B.T [r, h]
    ({"precision": "fp32"}, (256 * 8 * 4,)),        # after_A itself (B.T is a view of the parameter)
    ({"precision": "bf16"}, (256 * 8 * 4,)),        # peft's fp32 adapters on the bf16 base: after_A fp32
    ({"precision": "bf16", "adapter_dtype": "base"}, (256 * 8 * 2,)),
])
def test_what_the_embedding_adapter_keeps_by_hand(fields, kept):
    """peft's Embedding.forward: t = 2 x 128 tokens, r 8, h 512."""
    r = resolve(lora(**fields))
    adapters = embedding_adapters(r.anatomy, r.setup, r.regime, 256, gathered=False)
    assert embedding_adapter_kept(adapters) == kept


def test_the_adapter_trains_the_embedding_output():
    """With LoRA on the embedding its output has a graph: layer 0 keeps its first blocks (nothing is skipped) and
    under checkpointing no leaf of the embedding output is made; its gradients and AdamW's states are the
    adapters' (fp32 under bf16-mixed)."""
    from llmem.memory.activations.profile import activation_profile

    with_embed, without = resolve(lora(grad_ckpt=True)), resolve(lora(targets="q_proj", grad_ckpt=True))
    assert activation_profile(with_embed).first_layer_skip == 0 < activation_profile(without).first_layer_skip
    assert activation_profile(with_embed).embed_leaf_bytes == 0 < activation_profile(without).embed_leaf_bytes
    states = estimate(lora()).components["optimizer_states"] - estimate(lora(targets="q_proj")).components[
        "optimizer_states"]
    assert states == 2 * 4 * (8 * 32000 + 512 * 8)


@pytest.mark.parametrize(("targets", "message"), [
    ("embed_token,q_proj", "its input embedding embed_tokens"),
    ("re:.*norm", "not a linear of the decoder layers, the lm_head nor an input embedding"),
])
def test_what_is_refused(targets, message):
    with pytest.raises(LlmemError, match=re.escape(message)):
        resolve(lora(targets=targets))
