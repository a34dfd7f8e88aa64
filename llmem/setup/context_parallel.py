"""Context parallelism on the set-up floor: what --cp accepts and refuses, the tokens a rank holds.

Context parallelism (--cp N) as torchtitan runs it with torch's ring attention
(torch/distributed/tensor/experimental/_context_parallel/_attention.py): each rank holds seq_len / cp tokens
(the head-tail load balancer's 2 x cp chunks, two per rank), SDPA's flash / efficient / cuDNN kernels are
dispatched to the ring, and FSDP2 shards over dp_shard x cp (torchtitan's ParallelDims: the "fsdp" mesh folds
dp_shard and cp).

What llmem models of it, and the one-line refusal of the rest: one row per refusal."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmem.errors import LlmemError
from llmem.setup.checkpointing import ac_policy
from llmem.setup.methods import canonical_method

CP_METHODS = ("fsdp",)      # FSDP2 over dp_shard x cp; fsdp+tp, ddp and pipeline stages under CP are not modelled

# (does the set-up have it, the one line naming the problem and the fix)
CP_REFUSALS: tuple[tuple[Callable[[Any], bool], Callable[[Any], str]], ...] = (
    (lambda s: canonical_method(s.method) not in CP_METHODS,
     lambda s: f"--cp runs under --method fsdp (FSDP2 over dp_shard x cp) only, got {s.method}"),
    (lambda s: s.seq_len % (2 * s.cp) != 0,
     lambda s: f"--cp {s.cp} splits --seq-len into 2 x {s.cp} chunks (torch's head-tail load balancing): choose a "
               f"--seq-len divisible by {2 * s.cp}, got {s.seq_len}"),
    (lambda s: not s.attention_spec.calls_torch_sdpa,
     lambda s: f"--cp dispatches SDPA's flash / efficient / cuDNN kernels to the ring only (--attn sdpa); "
               f"--attn {s.attn} is not modelled under context parallelism"),
    (lambda s: not s.precision_spec.low_precision,
     lambda s: f"--cp with --precision {s.precision}: fp32 attention may take SDPA's math path, which the ring "
               "does not dispatch; use bf16 / fp16 compute (e.g. --precision bf16-mixed)"),
    (lambda s: s.packing,
     lambda s: "--cp with --packing: the ring attention takes no mask (its attn_bias is refused): drop --packing"),
    (lambda s: s.pp > 1 or s.dp_replicate > 1 or s.tp not in (None, 1),
     lambda s: "--cp with --pp, --dp-replicate or --tp is not modelled: drop them (FSDP2 over dp_shard x cp)"),
    (lambda s: s.objective_spec.runs_trainer,
     lambda s: f"--cp with --objective {s.objective} is not modelled: use the sft objective"),
    (lambda s: s.peft or s.quant_spec.quantised,
     lambda s: "--cp with adapters or a quantised base is not modelled: drop --lora-rank / --peft-config / --qlora"),
    (lambda s: s.offload_activations or s.offload_param or s.offload_optimizer or s.optimizer_in_backward,
     lambda s: "--cp with offloading or the optimizer in backward is not modelled: drop --offload-* / "
               "--optimizer-in-backward"),
    (lambda s: ac_policy(s.ac_policy).selective or s.ckpt_every > 1 or s.fused_ce,
     lambda s: "--cp with selective checkpointing, --grad-ckpt-every or --fused-ce is not modelled: use full "
               "--grad-ckpt or none"),
)


def check_context_parallel(setup: Any) -> None:
    """Refuse what llmem does not model of --cp, in one line each (LlmemError: the CLI's exit 2)."""
    if setup.cp < 1:
        raise LlmemError(f"--cp must be >= 1, got {setup.cp}")
    if setup.cp == 1:
        return
    for applies, message in CP_REFUSALS:
        if applies(setup):
            raise LlmemError(message(setup))


def local_seq_len(seq_len: int, cp: int) -> int:
    """The tokens per sample one rank runs: seq_len / cp (two of the 2 x cp head-tail chunks,
    _HeadTailLoadBalancer in torch's _load_balancer.py)."""
    return seq_len // cp


def cp_note(cp: int, seq_len: int, engine: str) -> str:
    """What a --cp result says of itself (`seq_len`: the whole sample's)."""
    how = ("torch's ring attention ran on fake tensors (its all-gather, merge and backward buffers as torch "
           "allocates them; the fake mode's copy at each collective's wait_tensor dropped)" if engine == "trace" else
           "the ring attention's buffers per call from torch's code: the gathered K/V, the fp32 merge, the "
           "backward's fp32 accumulators and rotated K/V gradients")
    return (f"--cp {cp}: each rank runs {seq_len // cp} of the {seq_len} tokens per sample (head-tail load "
            f"balancing), FSDP2 shards over dp x cp; {how}; rotate method all-gather (torch's default)")
