"""--ac-policy op (torchtitan's op-level selective checkpointing) on families whose activations are learned from the
real code (llmem.learn.selective_read): which outputs the policy keeps, worked by hand from each layer's op order,
checked against what torch's selective checkpoint really stores; the learned result's own cache key; the
refusals that stay."""

from __future__ import annotations

import json

import pytest
from sac_recording import stored_under_op_sac

from llmem.errors import LlmemError
from llmem.estimator.engine import estimate, rank_step
from llmem.memory.activations import learned as lm
from llmem.model.resolved import resolve
from llmem.setup.training import TrainingSetup


@pytest.fixture(autouse=True)
def _learning_on(monkeypatch):
    monkeypatch.setenv(lm.LEARN_ENV, "auto")


def _act(model: str, **kw):
    setup = TrainingSetup(model=model, gpu="H100-80GB", **{"precision": "bf16-mixed", "optimizer": "sgd",
                                                          "batch_size": 2, "seq_len": 256, "ac_policy": "op", **kw})
    return rank_step(resolve(setup))


@pytest.mark.slow   # ~10 s on 2 cores (learning tiny-qwen3); the micro Qwen3 below and the CI matrix's row run by default
def test_qwen3_keeps_every_other_mm_and_the_sdpa_outputs():
    """tiny-qwen3 (h 512, 8 query heads and 4 kv heads of 64, MLP 1536, no biases) at 2 x 256 = 512 tokens in bf16:
    its linears run aten.mm in the order q, k, v, o, gate, up, down; the 1st, 3rd, 5th and 7th are saved. q's
    output (512 x 512 x 2 B) is normed and rotated on, so the layer frees it in forward: an extra, read by the
    recompute. v's (512 x 256 x 2 B) is SDPA's v and gate's (512 x 1536 x 2 B) SiLU's input: kept anyway. down's
    (512 x 512 x 2 B) comes after the layer's last kept tensor (its input): the recompute stops before it, so it is
    never read. SDPA (sm90 flash, GQA) keeps its output (512 x 512 x 2 B), its fp32 logsumexp (2 x 8 x 256 x 4 B)
    and its RNG state (16 + 8 B)."""
    r, act = _act("tiny-qwen3")
    assert [s.split(":")[0] for s in lm.learned_for(r).selective.saved if s.endswith(": mm")] == [
        "self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.down_proj"]
    kept = 524_288 + 262_144 + 1_572_864 + 524_288 + 524_288 + 16_384 + 16 + 8
    assert act.selective_kept_bytes == kept == 3_424_280
    assert act.selective_held_bytes == 524_288
    assert act.checkpoint_saved == 512 * 512 * 4 + kept       # the fp32 residual stream, as under --grad-ckpt


def test_biased_linears_run_addmm():
    """tiny-phi: every linear has a bias, so at::linear runs addmm (not on the save list): the layer keeps SDPA's
    outputs only (sm90 cuDNN, 8 heads of 64: 512 x 512 x 2 B, logsumexp 2 x 8 x 256 x 4 B, its philox seed and
    offset, one int64 each)."""
    r, act = _act("tiny-phi")
    assert lm.learned_for(r).selective.described == "self_attn (aten::_scaled_dot_product_cudnn_attention)"
    assert act.selective_kept_bytes == 524_288 + 16_384 + 16
    assert act.selective_held_bytes == 0


MICRO_QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
               "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
               "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
               "tie_word_embeddings": False, "use_sliding_window": False}


def test_kept_bytes_match_what_torch_stores(tmp_path, monkeypatch):
    """The real thing: a 2-layer Qwen3 runs forward and backward in bf16 on fake tensors under transformers'
    checkpointing with llmem's context_fn and CUDA's SDPA kernel choice (sm90: cuDNN, no GQA); the outputs torch's
    selective checkpoint stores add up to what the learned layers keep under the policy."""
    from transformers import AutoConfig

    path = tmp_path / "config.json"
    path.write_text(json.dumps(MICRO_QWEN3))
    stored = stored_under_op_sac(monkeypatch, AutoConfig.from_pretrained(str(tmp_path)),
                                 lambda t: t.untyped_storage().nbytes())
    _, act = _act(str(path), precision="bf16", batch_size=2, seq_len=32)
    # q 64 tokens x 64 (an extra), v 64 x 64, gate 64 x 160, down 64 x 64 (bf16); SDPA's out 64 x 64, logsumexp
    # 2 x 4 x 32 fp32 and its philox seed and offset (one int64 each)
    assert sum(stored) == 2 * act.selective_kept_bytes == 2 * (2 * 64 * (64 + 64 + 160 + 64 + 64) + 4 * 2 * 4 * 32
                                                              + 16)


def test_the_selective_layer_has_its_own_cache_key():
    """The learned result for --ac-policy op carries what the policy keeps, under a key of its own: the key of the
    same set-up without it is unchanged (no ac_policy field), so the cache files already learned stay valid."""
    op = resolve(TrainingSetup(model="tiny-qwen3", gpu="H100-80GB", precision="bf16-mixed", ac_policy="op"))
    full = resolve(TrainingSetup(model="tiny-qwen3", gpu="H100-80GB", precision="bf16-mixed", grad_ckpt=True))
    assert lm.learning_key(op)["ac_policy"] == "op" and "ac_policy" not in lm.learning_key(full)
    assert lm.key_hash(lm.learning_key(op)) != lm.key_hash(lm.learning_key(full))
    sel = lm.LearnedSelective(((5, 1), (8, 1)), ((1, (0.0, 0.0, 0.0, 1024.0, 0.0), True),), ("q: mm", "v: mm"))
    assert lm.LearnedSelective.from_json(json.loads(json.dumps(sel.to_json()))) == sel
    assert sel.at(2, 256).extra == ((1, 524_288, True),)


@pytest.mark.parametrize("kw, words", [
    (dict(model="tiny-gpt-oss"), "runs eager attention"),      # gpt-oss's attention sinks: HF runs it eagerly
    (dict(model="tiny-qwen3", learn="never"), "LLMEM_LEARN=never"),
])
def test_what_stays_refused(kw, words, monkeypatch):
    kw = dict(kw)
    if kw.pop("learn", None):
        monkeypatch.setenv(lm.LEARN_ENV, "never")
    with pytest.raises(LlmemError, match=words):
        estimate(TrainingSetup(gpu="H100-80GB", ac_policy="op", seq_len=64, **kw))
