"""A colocated vLLM engine's GPU memory (TRL's `vllm_mode="colocate"`): not run by llmem (vLLM is not installed and
needs a GPU), modelled from vLLM's documented accounting as TRL configures it.

TRL 1.16 (trl/generation/vllm_generation.py) builds `LLM(model, tensor_parallel_size, gpu_memory_utilization,
max_model_len, max_num_seqs, enable_sleep_mode, max_num_batched_tokens=4096, distributed_executor_backend=
"external_launcher")` in each training process. vLLM (v1 GPU worker, `determine_available_memory`) then takes
`requested = gpu_memory_utilization x total device memory` as its budget, loads its own copy of the weights (model
dtype, split over its tensor-parallel ranks), profiles one forward of `max_num_batched_tokens` dummy tokens for the
activation peak, counts the memory torch does not see (NCCL, cuBLAS workspaces) and CUDA graphs, and gives the rest
to the KV cache in blocks of `block_size` tokens (16 by default), every layer's K and V per block. At start-up it
refuses when the KV cache cannot hold one `max_model_len` sequence, and when the device has less free memory than
`requested`. With sleep mode (`vllm_enable_sleep_mode`) TRL puts the engine to sleep at level 2 after each
generation (weights and KV cache released to the driver) and wakes it for the next: the pool is resident only while
generating; without it the pool stays allocated through training.

Known Limitations: the activation peak of the profile run is modelled as the forward's largest live intermediate
(the gated MLP's two [tokens, intermediate] projections and its output, plus the residual stream), the sampler's
fp32 logits of `max_num_seqs` rows beside it; CUDA graphs and the non-torch memory are stated constants (vLLM
measures both on the device). These are assumptions, said so in the estimate's notes; the KV-cache and weight
terms are exact arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.errors import LlmemError

BLOCK_SIZE_TOKENS = 16                     # vLLM CacheConfig.block_size default (CUDA)
TRL_MAX_NUM_BATCHED_TOKENS = 4096          # vllm_generation.py: "misled by the high default value (i.e., 32768)"
CUDA_GRAPH_BYTES = 512 * 1024**2           # assumption: captured graphs' pool at TRL's batch sizes (vLLM measures it)
NON_TORCH_BYTES = 256 * 1024**2            # assumption: NCCL and cuBLAS workspaces outside torch's allocator
PEFT_PREFIX = "lora_"                      # LoraModel.prefix: the adapters TRL's weight sync skips (merged first)
SLEEP_LEVEL = 2                            # TRL's llm.sleep(level=2): weights and KV cache both released


@dataclass(frozen=True)
class VllmModel:
    """What vLLM's memory depends on, per model (numbers, so this module needs no model code)."""
    params: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2                   # vLLM loads in the checkpoint's dtype (bf16 for every catalog LLM)


@dataclass(frozen=True)
class VllmPool:
    """One GPU's colocated vLLM engine: its budget and what fills it (bytes)."""
    pool_bytes: int                        # gpu_memory_utilization x device memory: vLLM's requested memory
    weights_bytes: int
    activation_peak_bytes: int
    cuda_graph_bytes: int
    non_torch_bytes: int
    kv_cache_bytes: int                    # the rest, rounded down to whole blocks
    block_bytes: int                       # one block of block_size tokens, K and V of every layer
    num_blocks: int
    block_size: int
    sleeps: bool                           # released between generations (TRL's sleep level 2)

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV cache holds at once (all sequences together)."""
        return self.num_blocks * self.block_size

    @property
    def resident_in_training_bytes(self) -> int:
        """What the engine keeps on the GPU while the trainer steps: nothing asleep, the whole pool awake."""
        return 0 if self.sleeps else self.pool_bytes

    def concurrent_sequences(self, tokens_per_sequence: int) -> int:
        """Sequences of that length generated at once (vLLM queues the rest: slower, not out of memory)."""
        per_seq_blocks = -(-tokens_per_sequence // self.block_size)
        return self.num_blocks // per_seq_blocks


def kv_block_bytes(m: VllmModel, tp: int = 1, block_size: int = BLOCK_SIZE_TOKENS) -> int:
    """K and V of block_size tokens in every layer, this rank's kv heads (vLLM's FullAttentionSpec.page_size_bytes
    x num_layers: 2 x block_size x kv_heads x head_dim x dtype per layer)."""
    kv_heads = max(1, m.num_kv_heads // tp)          # vLLM replicates kv heads when tp exceeds them
    return 2 * block_size * kv_heads * m.head_dim * m.dtype_bytes * m.num_layers


def profile_activation_bytes(m: VllmModel, tp: int = 1, tokens: int = TRL_MAX_NUM_BATCHED_TOKENS,
                             max_num_seqs: int = 256) -> int:
    """The profile run's peak (an assumption, module docstring): at the MLP the residual stream, the fused
    gate/up projection output [tokens, 2 x intermediate / tp] and the activation [tokens, intermediate / tp]; the
    sampler's fp32 logits and their softmax for max_num_seqs rows of the vocabulary."""
    mlp = tokens * (m.hidden_size + 3 * m.intermediate_size // tp) * m.dtype_bytes
    sampler = 2 * max_num_seqs * m.vocab_size * 4
    return max(mlp, sampler)


def vllm_pool(m: VllmModel, device_bytes: int, gpu_memory_utilization: float, max_model_len: int, *,
              tp: int = 1, max_num_seqs: int = 256, sleep: bool = False,
              block_size: int = BLOCK_SIZE_TOKENS) -> VllmPool:
    """The pool vLLM builds on one GPU (module docstring); LlmemError when vLLM would refuse to start."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise LlmemError(f"--vllm-gpu-memory-utilization must lie in (0, 1], got {gpu_memory_utilization}")
    pool = int(gpu_memory_utilization * device_bytes)
    weights = -(-m.params // tp) * m.dtype_bytes
    act = profile_activation_bytes(m, tp, max_num_seqs=max_num_seqs)
    kv_room = pool - weights - act - CUDA_GRAPH_BYTES - NON_TORCH_BYTES
    block = kv_block_bytes(m, tp, block_size)
    blocks = max(0, kv_room) // block
    need = -(-max_model_len // block_size)
    if blocks < need:
        room = max(0, kv_room) / 1024**3
        raise LlmemError(f"vLLM would not start: gpu_memory_utilization {gpu_memory_utilization:g} x "
                         f"{device_bytes / 1024**3:.1f} GiB leaves {room:.2f} GiB for the KV cache after its "
                         f"weights ({weights / 1024**3:.2f} GiB) and activations, fewer than the {need} blocks of one "
                         f"{max_model_len}-token sequence: raise --vllm-gpu-memory-utilization")
    return VllmPool(pool, weights, act, CUDA_GRAPH_BYTES, NON_TORCH_BYTES, blocks * block, block, blocks,
                    block_size, sleep)


# ------------------------------------------------------------------------------------------------- server mode
# vllm_mode="server": the weights reach the server by TRL's VLLMClient.update_named_params, which hands the
# trainer's (name, full tensor) iterator to vLLM's packed_nccl_broadcast_producer (vllm/distributed/weight_transfer/
# packed_tensor.py, vLLM 0.33, the defaults TRL keeps): each chunk consumes tensors until their bytes exceed the
# buffer size (pack_tensors: the one that crosses it is included), torch.cat's them into one uint8 buffer, broadcasts
# it on one of num_buffers side streams, and keeps it in flight until that stream comes round again.
PACKED_BUFFER_BYTES = 1024 * 1024 * 1024     # DEFAULT_PACKED_BUFFER_SIZE_BYTES
PACKED_NUM_BUFFERS = 2                       # DEFAULT_PACKED_NUM_BUFFERS: double buffering


def packed_groups(tensor_bytes: list[int], buffer_bytes: int = PACKED_BUFFER_BYTES) -> list[list[int]]:
    """The tensors (their indices, in order) each packed buffer takes: pack_tensors' rule (append, then stop once
    the total exceeds buffer_bytes)."""
    groups: list[list[int]] = []
    group: list[int] = []
    total = 0
    for i, n in enumerate(tensor_bytes):
        group.append(i)
        total += n
        if total > buffer_bytes:
            groups.append(group)
            group, total = [], 0
    return groups + ([group] if group else [])


def packed_chunks(tensor_bytes: list[int], buffer_bytes: int = PACKED_BUFFER_BYTES) -> list[int]:
    """The packed buffers' sizes, in order (packed_groups')."""
    return [sum(tensor_bytes[i] for i in g) for g in packed_groups(tensor_bytes, buffer_bytes)]


def packed_broadcast_peak(tensor_bytes: list[int], buffer_bytes: int = PACKED_BUFFER_BYTES,
                          num_buffers: int = PACKED_NUM_BUFFERS) -> tuple[int, int]:
    """The producer's peak when every tensor is made for it (FSDP2's full_tensor): (the chunk's tensors, the
    packed buffers) at torch.cat, its packed copy beside the num_buffers - 1 previous chunks still in flight."""
    chunks = packed_chunks(tensor_bytes, buffer_bytes)
    at = [(c, c + sum(chunks[max(0, i - num_buffers + 1):i])) for i, c in enumerate(chunks)]
    return max(at, key=sum, default=(0, 0))
