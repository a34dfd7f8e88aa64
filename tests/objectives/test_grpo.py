"""--objective grpo (TRL's GRPOTrainer with transformers' generate): the KV cache by hand and against a real CPU
generate, the phases and which one is the answer, GRPOConfig's defaults, the refusals."""

from __future__ import annotations

import pytest

from llmem import TrainingSetup, estimate
from llmem.errors import LlmemError
from llmem.estimator.generation import decode_totals, generation_kv_bytes, kv_cache_bytes
from llmem.model.resolved import resolve
from llmem.setup.generation import GENERATION_DEFAULTS, completion_length, prompt_length
from llmem.setup.objectives import REF_ADAPTERS_OFF, REF_COPY, REF_NONE, reference_mode


def _grpo(**kw) -> TrainingSetup:
    base = dict(objective="grpo", batch_size=4, seq_len=32, num_generations=4, max_completion_length=8)
    return TrainingSetup("tiny-llama", **{**base, **kw})


def test_kv_cache_bytes_by_hand():
    """tiny-llama (4 layers, 8 KV heads of 64) generating 8 tokens after a 24-token prompt for 4 completions, bf16:
    the cache holds 24 + 8 - 1 = 31 tokens (the last sampled token is never fed): 2 x 4 x 4 x 8 x 64 x 31 x 2 B."""
    assert kv_cache_bytes(4, 4, 8, 64, 31, 2) == 1_015_808
    assert generation_kv_bytes(resolve(_grpo())) == 1_015_808
    # GQA: Qwen2.5-7B's 28 layers, 4 KV heads of 128, one completion of 1024 + 1024 tokens in bf16
    assert kv_cache_bytes(28, 1, 4, 128, 2047, 2) == 2 * 28 * 4 * 128 * 2047 * 2 == 117_383_168


def test_kv_cache_matches_a_real_cpu_generate():
    """transformers' generate on the CPU (2 layers, 2 KV heads of 16, fp32): its DynamicCache's keys and values
    hold what kv_cache_bytes counts for prompt + new tokens - 1."""
    torch = pytest.importorskip("torch")
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, 128, (3, 7))
    config = GenerationConfig(max_new_tokens=5, min_new_tokens=5, do_sample=False, eos_token_id=2, pad_token_id=0,
                              return_dict_in_generate=True, use_cache=True)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    cache = getattr(out, "cache", None) or out.past_key_values
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert out.sequences.shape == (3, 12)
    assert held == kv_cache_bytes(2, 3, 2, 16, 7 + 5 - 1, 4) == 16_896


def test_decode_steps_laid_out():
    """One forward per token up to 64 decode steps; beyond, 64 strided steps ending at prompt + completion - 1."""
    assert decode_totals(24, 8) == list(range(24, 32))
    long = decode_totals(100, 1025)
    assert len(long) == 65 and long[0] == 100 and long[-1] == 100 + 1024 and long[1] == 116


def test_grpo_config_defaults():
    """GRPOConfig's (trl 1.16) defaults that decide memory, read from the installed trl."""
    trl = pytest.importorskip("trl")
    config = {f: trl.GRPOConfig.__dataclass_fields__[f].default for f in
              ("num_generations", "max_completion_length", "beta", "num_iterations", "loss_type")}
    d = GENERATION_DEFAULTS["grpo"]
    assert config == {"num_generations": d.num_generations, "max_completion_length": d.max_completion_length,
                      "beta": d.beta, "num_iterations": d.num_iterations, "loss_type": d.loss_type}
    s = TrainingSetup("tiny-llama", objective="grpo", batch_size=8, seq_len=1024)
    assert (completion_length(s), prompt_length(s)) == (512, 512)


def test_reference_by_beta_and_peft():
    """beta 0 (GRPOConfig's default): no reference; beta > 0: a copy, or under LoRA the policy's adapters off."""
    assert reference_mode(_grpo()) == REF_NONE
    assert reference_mode(_grpo(beta=0.04)) == REF_COPY
    assert reference_mode(_grpo(beta=0.04, lora_rank=8)) == REF_ADAPTERS_OFF


def test_phases_and_the_answer():
    """A full fine-tune of tiny-llama: training holds the gradients on top of what generation holds, so it is the
    answer; each phase holds at least the weights (fp32, 45,421,056 parameters: two 32000 x 512 tables, 4 layers of
    3,163,136, the final norm) and a reference copy adds them once more in every phase."""
    weights = (2 * 32000 * 512 + 4 * (4 * 512 * 512 + 3 * 512 * 1376 + 2 * 512) + 512) * 4
    plain = estimate(_grpo(optimizer="sgd"))
    ref = estimate(_grpo(optimizer="sgd", beta=0.04))
    for r, resident in ((plain, weights), (ref, 2 * weights)):
        names = [p.name for p in r.phases]
        assert names == ["generation", "scoring", "training"]
        assert [p.name for p in r.phases if p.is_peak] == ["training"]
        assert max(p.allocated_bytes for p in r.phases) == r.peak_allocated_bytes
        assert all(p.allocated_bytes >= resident for p in r.phases)
    # the reference copy's weights in the generation phase (whole allocator blocks: within 0.5 %)
    gen = [next(p for p in r.phases if p.name == "generation").allocated_bytes for r in (plain, ref)]
    assert 0 <= gen[1] - gen[0] - weights < 0.005 * weights
    assert plain.to_dict()["phases"][2]["is_peak"] is True


def test_generation_is_the_answer_for_a_deep_cache():
    """Llama-2-7B (32 layers, MHA: 32 KV heads of 128) under LoRA in pure bf16 with checkpointing, 8 completions of
    3072 + 1024 prompt tokens: the cache (2 x 32 x 8 x 4096 x 4095 x 2 B = 16.0 GiB) outweighs training's
    checkpointed inputs (half its bytes per token): generation is the peak, the cache inside it."""
    s = TrainingSetup("meta-llama/Llama-2-7b-hf", objective="grpo", precision="bf16", lora_rank=16, grad_ckpt=True,
                      batch_size=8, seq_len=4096, num_generations=8, max_completion_length=3072)
    cache = 2 * 32 * 8 * 4096 * 4095 * 2
    assert generation_kv_bytes(resolve(s)) == cache
    r = estimate(s, draft=True)
    gen = next(p for p in r.phases if p.name == "generation")
    assert gen.is_peak and gen.components["activations"] >= cache


@pytest.mark.parametrize("kw, words", [
    (dict(use_vllm=True, vllm_gpu_memory_utilization=0.0), "--vllm-gpu-memory-utilization must lie in"),
    (dict(num_generations=3), "must divide the generation batch"),
    (dict(num_generations=1, batch_size=4), "--num-generations must be >= 2"),
    (dict(max_completion_length=32), "--seq-len 32 is the prompt plus"),
    (dict(beta=-0.1), "--beta must be >= 0"),
    (dict(method="ds-zero3", gpus=2, use_vllm=True), "under DeepSpeed"),
    (dict(prompt_len=8), "--prompt-len with --objective grpo"),
    (dict(loss_type="sigmoid"), "unknown --loss-type 'sigmoid'"),
])
def test_refusals(kw, words):
    with pytest.raises(LlmemError, match=words):
        _grpo(**kw)


def test_generation_options_belong_to_grpo():
    for kw in (dict(num_generations=4), dict(max_completion_length=8), dict(beta=0.1), dict(use_vllm=True)):
        with pytest.raises(LlmemError, match="belongs to --objective grpo"):
            TrainingSetup("tiny-llama", objective="dpo", seq_len=256, **kw)


def test_global_batch_across_gpus():
    """GRPOConfig: generation_batch_size = per_device_train_batch_size x processes must hold whole groups."""
    TrainingSetup("tiny-llama", "ddp", 2, objective="grpo", batch_size=2, seq_len=32, num_generations=4,
                  max_completion_length=8)
    with pytest.raises(LlmemError, match="--gpus 2 x --batch-size 1 x steps_per_generation 1 = 2 completions"):
        TrainingSetup("tiny-llama", "ddp", 2, objective="grpo", batch_size=1, seq_len=32, num_generations=4,
                      max_completion_length=8)


def test_the_planner_searches_batches_grpoconfig_accepts():
    """num_generations must divide gpus x batch: with 8 generations a GPU's batch steps by 8 alone, 4 on two GPUs,
    1 on eight, 8 on three (gcd 1); KTO's pairs by 2."""
    from llmem.planner.plan import plan
    from llmem.setup.objectives import batch_multiple

    assert [batch_multiple("grpo", n) for n in (1, 2, 8, 3)] == [8, 4, 1, 8]
    assert batch_multiple("grpo", 2, generations=6) == 3 and batch_multiple("kto", 4) == 2
    p = plan(TrainingSetup("tiny-llama", objective="grpo", batch_size=4, seq_len=64, max_completion_length=8,
                           num_generations=4))
    assert p.recommended is not None and p.recommended.max_batch_size % 4 == 0
