"""The time a generation objective's step adds before its training (--objective grpo, transformers' generate): the
time model of llmem.planner.timing, extended.

* prefill: the prompts' forward, FLOP-bound: 2 x P_matmul x (batch x prompt tokens) plus the forward attention
  FLOPs per token (at the whole sequence's length: an upper bound), at the step's rate (peak x MFU);
* decode: max_completion_length - 1 steps of one token per sequence; each step is memory-bound: it reads every
  weight (in its stored bytes; under *-mixed autocast also writes and reads the trained weights' compute-dtype
  copies) and the KV
  cache (on average half its final size) at the GPU's memory bandwidth, or FLOP-bound when that is longer;
* scoring: beta > 0 runs the reference's forward over the batch (the training forward's FLOPs).
* --use-vllm: vLLM generates the batch in waves of as many sequences as its KV cache holds at once
  (VllmPool.concurrent_sequences: the scheduler admits a sequence while blocks remain, llmem.memory.vllm), each
  wave's prefill at FLOPs and its decode steps reading vLLM's own weights (the checkpoint dtype, adapters merged:
  TRL's _move_model_to_vllm) and the wave's paged KV cache at the memory bandwidth; so a larger pool (more KV
  blocks) means fewer, bigger waves. Under vllm_mode server the engine is on other GPUs, timed as one engine per
  training rank with room for the whole batch (its capacity is not known here: an assumption). Sleep mode's
  wake-up / sleep copies are not timed.
Every completion runs to max_completion_length (the longest step). Sampling, rewards and host round trips are not
timed.

TRL generates and scores once per steps_per_generation micro-steps (`_prepare_inputs` refills `_buffered_inputs`
with the generation batch, --batch-size x steps_per_generation rows per GPU, then serves one --batch-size slice a
step): the batch's generation is timed above at its own rows (one decode step reads the weights once for all of
them), its scoring as steps_per_generation chunks of --batch-size (the reference's forward each), and each
micro-step is charged 1 / steps_per_generation of the sum (amortised).
"""

from __future__ import annotations

from llmem.estimator.generation import attention_dims, colocated_pool
from llmem.model.resolved import ResolvedSetup
from llmem.setup.generation import completion_length, prompt_length, steps_per_generation, vllm_mode
from llmem.setup.objectives import REF_NONE, objective_spec, reference_mode

VLLM_SERVER_DTYPE_BYTES = 2       # the server's weights and KV cache: bf16, every catalog LLM's checkpoint dtype


def generation_time_s(r: ResolvedSetup, micro_batch: int, matmul_params: float, rate_flops_per_s: float,
                      attention_flops_per_token: float, forward_s: float) -> float:
    """Seconds of generation and scoring per micro-step, amortised (0 for an objective without them): the
    generation batch of `micro_batch` x steps_per_generation rows generated at once and scored in chunks of
    `micro_batch`, divided by steps_per_generation (module docstring). `matmul_params` the weights that multiply
    activations per token, `attention_flops_per_token` the forward attention FLOPs per token, `forward_s` the
    training forward's time (one chunk's reference forward)."""
    setup = r.setup
    if not objective_spec(setup.objective).generates:
        return 0.0
    steps = steps_per_generation(setup)
    rows = micro_batch * steps
    scoring_s = steps * forward_s if reference_mode(setup) != REF_NONE else 0.0
    if vllm_mode(setup) is not None:
        generate_s = vllm_generation_s(r, rows, matmul_params, rate_flops_per_s, attention_flops_per_token)
    else:
        generate_s = transformers_generation_s(r, rows, matmul_params, rate_flops_per_s, attention_flops_per_token)
    return (generate_s + scoring_s) / steps


def transformers_generation_s(r: ResolvedSetup, rows: int, matmul_params: float, rate_flops_per_s: float,
                              attention_flops_per_token: float) -> float:
    """transformers' generate of `rows` completions at once (module docstring): the prompts' prefill at FLOPs, then
    max_completion_length - 1 decode steps, each reading the weights once and the rows' KV cache."""
    setup = r.setup
    p, c = prompt_length(setup), completion_length(setup)
    prefill_s = rows * p * (2 * matmul_params + attention_flops_per_token) / rate_flops_per_s
    weights_bytes = sum(q.numel * setup.stored_bytes(q.trainable) for q in r.anatomy.params)
    if setup.mixed:           # autocast's copies of the trained fp32 weights, written then read (each forward)
        weights_bytes += 2 * setup.compute_bytes * sum(q.numel for q in r.anatomy.params if q.trainable
                                                       and len(q.shape) >= 2)
    config = r.anatomy.config or {}
    heads = config.get("num_attention_heads", 1)
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or r.anatomy.hidden_size // heads
    kv_bytes_per_token = 2 * r.anatomy.num_layers * kv * head_dim * setup.compute_bytes * rows
    bandwidth = r.gpu.memory_gbps * 1e9
    decode_s = 0.0
    if c > 1:
        mean_cache = kv_bytes_per_token * (p + c / 2)
        memory_s = (weights_bytes + mean_cache) / bandwidth
        flops_s = rows * 2 * matmul_params / rate_flops_per_s
        decode_s = (c - 1) * max(memory_s, flops_s)
    return prefill_s + decode_s


def amortised_note(setup, micro_batch: int) -> str:
    """What the plan says of the generation's time when one generation batch serves several micro-steps."""
    steps = steps_per_generation(setup)
    return (f"generation and scoring amortised: one generation batch of {micro_batch * steps} completions per GPU "
            f"(batch {micro_batch} x steps_per_generation {steps}) every {steps} micro-steps, each micro-step "
            f"charged 1/{steps} of its time (in the step time and tokens/s)")


def vllm_waves(r: ResolvedSetup, micro_batch: int) -> tuple[int, int]:
    """(sequences vLLM generates at once, waves) for the rank's `micro_batch` completions: the colocated pool's
    concurrent sequences of --seq-len tokens (at most the batch: TRL's max_num_seqs), the whole batch in server
    mode (module docstring)."""
    pool = colocated_pool(r)
    at_once = micro_batch if pool is None else max(1, min(micro_batch, pool.concurrent_sequences(r.setup.seq_len)))
    return at_once, -(-micro_batch // at_once)


def vllm_generation_s(r: ResolvedSetup, micro_batch: int, matmul_params: float, rate_flops_per_s: float,
                      attention_flops_per_token: float) -> float:
    """vLLM's generation of the rank's completions (module docstring): waves of prefill at FLOPs and decode at the
    memory bandwidth, over vLLM's weights (the colocated pool's; in server mode the base's parameters in bf16) and
    the wave's KV cache (the pool's block bytes per token; server: K and V of every layer in bf16)."""
    setup = r.setup
    p, c = prompt_length(setup), completion_length(setup)
    pool = colocated_pool(r)
    if pool is not None:
        weights_bytes, kv_bytes_per_token = pool.weights_bytes, pool.block_bytes / pool.block_size
    else:
        kv, head_dim = attention_dims(r.base)
        weights_bytes = r.base.total_params * VLLM_SERVER_DTYPE_BYTES
        kv_bytes_per_token = 2 * r.base.num_layers * kv * head_dim * VLLM_SERVER_DTYPE_BYTES
    at_once, waves = vllm_waves(r, micro_batch)
    bandwidth = r.gpu.memory_gbps * 1e9
    prefill_s = micro_batch * p * (2 * matmul_params + attention_flops_per_token) / rate_flops_per_s
    decode_s = 0.0
    if c > 1:
        memory_s = (weights_bytes + at_once * kv_bytes_per_token * (p + c / 2)) / bandwidth
        flops_s = at_once * 2 * matmul_params / rate_flops_per_s
        decode_s = waves * (c - 1) * max(memory_s, flops_s)
    return prefill_s + decode_s
