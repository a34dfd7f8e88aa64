"""--ac-policy op: torchtitan's op-level selective activation checkpointing (llmem.setup.checkpointing,
llmem.runtime.selective_ac, llmem.memory.activations.selective), its bytes worked by hand from the layer's matmul
order, checked against what torch's selective checkpoint really stores, and its refusals."""

from __future__ import annotations

import json

import pytest
import torch
from sac_recording import stored_under_op_sac

from llmem.errors import LlmemError
from llmem.estimator.engine import estimate
from llmem.memory.activations.profile import activation_profile
from llmem.memory.activations.selective import saved_matmuls
from llmem.model.resolved import resolve
from llmem.planner.timing import step_flops
from llmem.setup.training import TrainingSetup


def _profile(model: str, **kw):
    r = resolve(TrainingSetup(model=model, gpu="H100-80GB", batch_size=2, seq_len=256, **kw))
    return r, activation_profile(r)


def test_tiny_llama_layer_keeps_every_other_mm_and_sdpa():
    """tiny-llama (h 512, i 1376, 8 heads of 64, no biases): its linears run aten.mm in the order q, k, v, o, gate,
    up, down; the 1st, 3rd, 5th and 7th are saved: q, v, gate, down. At 2 x 256 = 512 tokens in bf16 (autocast):
    q 512*512*2, v 512*512*2, gate 512*1376*2, down 512*512*2, plus SDPA's output 512*512*2 and fp32 logsumexp
    2*8*256*4. down_proj is the layer's last op with saved inputs, so the recompute stops before it: its stored
    output is never read."""
    _, act = _profile("tiny-llama", precision="bf16-mixed", ac_policy="op")
    assert [m.rsplit(".", 1)[1] for m in act.selective.saved_mm] == ["q_proj", "v_proj", "gate_proj", "down_proj"]
    kept = 524_288 + 524_288 + 1_409_024 + 524_288 + 524_288 + 16_384
    assert act.selective_kept_bytes == kept == 3_522_560
    assert act.selective_held_bytes == 524_288
    assert act.ckpt_input_bytes == 512 * 512 * 4              # the fp32 stream, as under full checkpointing
    assert act.checkpoint_saved == 512 * 512 * 4 + kept


def test_qwen2_biased_projections_run_addmm():
    """tiny-qwen2: q/k/v have biases, so at::linear runs addmm for them (not on the save list, not counted); the
    mms are o, gate, up, down and the 1st and 3rd are saved: o (512 tokens x 512 x 2 B) and up (512 x 1408 x 2 B),
    with SDPA's output and logsumexp (8 query heads)."""
    _, act = _profile("tiny-qwen2", precision="bf16", ac_policy="op")
    assert [m.rsplit(".", 1)[1] for m in act.selective.saved_mm] == ["o_proj", "up_proj"]
    assert act.selective_kept_bytes == 524_288 + 1_441_792 + 524_288 + 2 * 8 * 256 * 4
    assert act.selective_held_bytes == 0     # o_proj's output is read by the recompute; down_proj is recomputed


def test_op_policy_lies_between_none_and_full_by_the_kept_bytes():
    """Four tiny-llama layers: at the loss backward (its peak) the op policy holds 4 x 3,522,560 B more than full
    checkpointing, and less than no checkpointing."""
    base = dict(model="tiny-llama", gpu="H100-80GB", precision="bf16-mixed", optimizer="sgd", batch_size=2,
                seq_len=256)
    none = estimate(TrainingSetup(**base)).peak_allocated_bytes
    full = estimate(TrainingSetup(**base, grad_ckpt=True)).peak_allocated_bytes
    op = estimate(TrainingSetup(**base, ac_policy="op")).peak_allocated_bytes
    assert full < op < none
    assert op - full == 4 * 3_522_560


def _tiny_config(tmp_path, **over) -> str:
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
           "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
           "vocab_size": 256, "max_position_embeddings": 128, "tie_word_embeddings": False, **over}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_kept_bytes_match_what_torch_stores(tmp_path, monkeypatch):
    """The real thing: a 1-layer Llama (GQA, 4 heads of 16, 2 kv heads) runs forward and backward in bf16 on fake
    tensors under transformers' checkpointing with llmem's context_fn and CUDA's SDPA kernel choice (sm90: flash,
    as GQA rules out cuDNN); the tensors torch's selective checkpoint stores (MUST_SAVE outputs, RNG scalars aside)
    add up to the estimate's kept bytes, and the backward runs."""
    from transformers import LlamaConfig

    path = _tiny_config(tmp_path)
    stored = stored_under_op_sac(monkeypatch, LlamaConfig(**json.loads(open(path).read())),
                                 lambda t: t.numel() * t.element_size() if t.numel() > 2 else None)
    r = resolve(TrainingSetup(model=path, gpu="H100-80GB", precision="bf16", ac_policy="op", batch_size=2,
                              seq_len=32))
    act = activation_profile(r)
    # q 64 tokens x 64, v 64 x 32, gate 64 x 160, down 64 x 64 (bf16), SDPA's out 64 x 64 and lse 2 x 4 x 32 fp32
    assert sum(stored) == act.selective_kept_bytes == 2 * 64 * (64 + 32 + 160 + 64 + 64) + 4 * 2 * 4 * 32


def test_policy_gives_the_gradients_of_no_checkpointing():
    """A real CPU step (fp32, CPU kernels): the gradients under --ac-policy op's context_fn equal those without
    checkpointing, so the policy hands back the outputs it stored, in order."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmem.runtime.build import enable_checkpointing

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=64, max_position_embeddings=64)
    plain = LlamaForCausalLM(config)
    sac_model = LlamaForCausalLM(config)
    sac_model.load_state_dict(plain.state_dict())
    enable_checkpointing(sac_model, 1, "op")
    plain.train()
    sac_model.train()
    ids = torch.randint(0, 64, (2, 16))
    for m in (plain, sac_model):
        m(input_ids=ids, labels=ids).loss.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), sac_model.named_parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_recompute_flops_skip_the_saved_matmuls():
    """tiny-llama's layer: 4 x 512^2 + 3 x 512 x 1376 = 3,162,112 matmul weights; saved q, v (512^2 each), gate and
    down (512 x 1376 each) = 1,933,312, so the recompute runs 1,228,800 (k, o, up) x 2 FLOPs per token per layer
    and no attention."""
    r, _ = _profile("tiny-llama", precision="bf16-mixed", ac_policy="op")
    assert [m.rsplit(".", 1)[1] for m in saved_matmuls(r.anatomy)] == ["q_proj", "v_proj", "gate_proj", "down_proj"]
    op = step_flops(r.anatomy, 512, 256, grad_ckpt=True, causal_skip=True, selective=True)
    full = step_flops(r.anatomy, 512, 256, grad_ckpt=True, causal_skip=True)
    assert op.recompute == 4 * 2 * 1_228_800 * 512
    assert op.forward == full.forward and op.backward == full.backward and op.recompute < full.recompute


@pytest.mark.parametrize("kw, words", [
    (dict(ac_policy="memory-budget"), "min-cut partitioner"),
    (dict(ac_policy="selective"), "unknown --ac-policy"),
    (dict(ac_policy="op", ckpt_every=2), "drop --grad-ckpt-every"),
])
def test_setup_refusals(kw, words):
    with pytest.raises(LlmemError, match=words):
        TrainingSetup(model="tiny-llama", **kw)


@pytest.mark.parametrize("kw, words", [
    (dict(model="tiny-llama", lora_rank=8), "peft adapters"),
    (dict(model="tiny-llama", method="tp", gpus=2), "tensor parallelism"),
    (dict(model="tiny-llama", attn="eager"), "--attn eager"),
    (dict(model="gpt2"), "Llama, Mistral and Qwen2"),
    (dict(model="tiny-qwen3"), "learned from the real code"),     # LLMEM_LEARN=never here
    (dict(model="tiny-llama", offload_activations=True), "--offload-activations"),
])
def test_what_is_not_modelled_is_refused(kw, words):
    with pytest.raises(LlmemError, match=words):
        estimate(TrainingSetup(gpu="H100-80GB", ac_policy="op", seq_len=64, **kw))


def test_op_implies_checkpointing():
    s = TrainingSetup(model="tiny-llama", ac_policy="op")
    assert s.grad_ckpt and s.ckpt_every == 1
