"""Expert parallelism on the set-up floor: what --ep accepts and refuses, and the routing it assumes.

Expert parallelism (--ep N) as torchtitan 0.3.0 runs it under FSDP2 (torchtitan/distributed/parallel_dims.py,
distributed/fsdp.py apply_fsdp_to_decoder, models/common/token_dispatcher.py AllToAllTokenDispatcher):

- ep borrows its ranks from FSDP2's: dp_shard x cp = efsdp x ep. The routed experts' 3-D weights are Shard(0) over
  the ep ranks (experts / ep local experts per rank), then FSDP2 shards those over efsdp = dp_shard x cp / ep (a
  per-parameter mesh: the block's experts form their own FSDPParamGroup); every other parameter is sharded over
  dp_shard x cp as without ep.
- Each MoE layer's tokens: the local tokens' T x top_k routed rows are sorted by expert, their counts exchanged
  (all_to_all_single of tokens-per-expert), the rows dispatched by all_to_all_single to the ranks owning their
  experts, permuted rank-major -> expert-major, run through the grouped GEMMs, un-permuted and sent back by a
  second all_to_all_single (combine) before the router's weighting and the sum per token.
- The rows a rank receives depend on the routing, which no tool can know before the run: llmem assumes balanced
  routing (each rank receives T x top_k rows), scaled by --ep-imbalance (the busiest rank receives that factor
  times the balanced rows), a stated assumption in every result.

What llmem models of it, and the one-line refusal of the rest: one row per refusal."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from llmem.errors import LlmemError
from llmem.setup.checkpointing import ac_policy
from llmem.setup.methods import canonical_method

EP_METHODS = ("fsdp",)       # FSDP2 x EP; DDP, DeepSpeed, fsdp+tp and single-GPU EP are not modelled



def ep_mesh_refusal(method: str, tp: int | None, replicas: int, pp: int, cp: int) -> str | None:
    """Why --ep cannot run on this method and mesh (the one line naming the fix), or None: FSDP2 alone, without
    PP, HSDP, TP or CP (the set-up's check and llmem.setup.layout's both ask it)."""
    if canonical_method(method) not in EP_METHODS:
        return f"--ep runs under --method fsdp (FSDP2 x EP, torchtitan's layout) only, got {method}"
    if pp > 1 or replicas > 1 or tp not in (None, 1) or cp > 1:
        return "--ep with --pp, --dp-replicate, --tp or --cp is not modelled: drop them (FSDP2 over dp_shard, " \
               "experts over efsdp x ep)"
    return None


def _mesh_refusal(s) -> str | None:
    return ep_mesh_refusal(s.method, s.tp, s.dp_replicate, s.pp, s.cp)


# (does the set-up have it, the one line naming the problem and the fix)
EP_REFUSALS: tuple[tuple[Callable[[Any], bool], Callable[[Any], str]], ...] = (
    (lambda s: _mesh_refusal(s) is not None, _mesh_refusal),
    (lambda s: s.peft or s.quant_spec.quantised,
     lambda s: "--ep with adapters or a quantised base is not modelled: drop --lora-rank / --peft-config / --qlora"),
    (lambda s: s.objective_spec.runs_trainer,
     lambda s: f"--ep with --objective {s.objective} is not modelled: use the sft objective"),
    (lambda s: s.offload_activations or s.offload_param or s.offload_optimizer or s.optimizer_in_backward,
     lambda s: "--ep with offloading or the optimizer in backward is not modelled: drop --offload-* / "
               "--optimizer-in-backward"),
    (lambda s: ac_policy(s.ac_policy).selective or s.ckpt_every > 1 or s.fused_ce or s.packing,
     lambda s: "--ep with selective checkpointing, --grad-ckpt-every, --fused-ce or --packing is not modelled: "
               "use full --grad-ckpt or none, drop --fused-ce / --packing"),
    (lambda s: s.gpus % s.ep != 0 or s.gpus // s.ep < 1,
     lambda s: f"--ep {s.ep} does not divide the {s.gpus} FSDP2 ranks (dp_shard x cp = efsdp x ep, torchtitan's "
               f"ParallelDims): choose an --ep that divides --gpus"),
)


def check_expert_parallel(setup: Any) -> None:
    """Refuse what llmem does not model of --ep, in one line each (LlmemError: the CLI's exit 2)."""
    if setup.ep < 1:
        raise LlmemError(f"--ep must be >= 1, got {setup.ep}")
    if not (math.isfinite(setup.ep_imbalance) and setup.ep_imbalance >= 1.0):
        raise LlmemError(f"--ep-imbalance is the busiest rank's share over the balanced one: >= 1.0, got "
                         f"{setup.ep_imbalance}")
    if setup.ep == 1:
        if setup.ep_imbalance != 1.0:
            raise LlmemError("--ep-imbalance applies under expert parallelism: add --ep N (> 1) or drop it")
        return
    for applies, message in EP_REFUSALS:
        if applies(setup):
            raise LlmemError(message(setup))


def check_ep_model(ep: int, experts: int | None, fsdp_ranks: int) -> None:
    """The model side: a routed MoE whose experts split evenly over the ep ranks (torchtitan's Shard(0)), and no
    more FSDP2 ranks than experts (beyond that torchtitan's apply_fsdp_to_decoder shards them on dim 1)."""
    if ep == 1:
        return
    if experts is None:
        raise LlmemError(f"--ep {ep} shards routed experts, and this model is dense (no num_experts / "
                         "num_local_experts / n_routed_experts in its config): drop --ep")
    if experts % ep:
        raise LlmemError(f"--ep {ep} does not divide the model's {experts} routed experts: choose an --ep that "
                         f"divides {experts}")
    if fsdp_ranks > experts:
        raise LlmemError(f"--ep {ep} on {fsdp_ranks} FSDP2 ranks, more than the {experts} routed experts: torchtitan "
                         "then shards the experts on dim 1 (Shard(1) over efsdp), which is not modelled; use at most "
                         f"{experts} GPUs")


IMBALANCE_STEP = 64    # --ep-imbalance is taken in 1/64ths: the learning copy's tokens (multiples of 64) x it stay whole


def effective_imbalance(imbalance: float) -> float:
    """--ep-imbalance as llmem applies it: rounded up to a multiple of 1/64, so that the rows the learning copy
    receives (llmem.learn: its tokens are multiples of 64) are exact and the fitted sizes linear in them."""
    return math.ceil(imbalance * IMBALANCE_STEP - 1e-9) / IMBALANCE_STEP


def received_rows(tokens: int, top_k: int, ep: int, imbalance: float) -> int:
    """The routed rows the busiest rank receives for its local experts per MoE layer: balanced, each of the ep
    ranks sends it tokens x top_k / ep rows; `imbalance` (in 1/64ths, `effective_imbalance`) scales that."""
    rows = tokens * top_k
    return rows if ep == 1 else math.ceil(rows * effective_imbalance(imbalance) - 1e-9)


def split_sizes(rows: int, ep: int) -> list[int]:
    """`rows` split over the ep ranks as evenly as integers allow (the emulated all-to-all splits)."""
    base, extra = divmod(rows, ep)
    return [base + (1 if i < extra else 0) for i in range(ep)]


def ep_note(ep: int, efsdp: int, imbalance: float, engine: str) -> str:
    """What an --ep result says of itself."""
    how = ("the dispatch / combine all_to_all_single ran on the fake process group with emulated splits (the "
           "routing's counts are data, which fake tensors do not have)" if engine == "trace" else
           "the dispatch / combine all-to-all buffers (received rows x hidden in the compute dtype) and the grouped "
           "GEMMs at the rank's received rows, learned from the same EP forward on the copy (its all-to-alls "
           "emulated by buffers of their outputs' size)")
    used = effective_imbalance(imbalance)
    taken = f" (taken as {used:g}, a multiple of 1/{IMBALANCE_STEP})" if used != imbalance else ""
    balance = "balanced routing (each rank receives tokens x top_k rows)" if imbalance == 1.0 else \
        f"routing imbalance {imbalance:g}{taken}: the busiest rank receives {used:g} x the balanced tokens x top_k rows"
    return (f"--ep {ep}: 1 / {ep} of the routed experts per rank (Shard(0) over ep), FSDP2 shards "
            f"them over efsdp {efsdp} and the dense parameters over dp; {balance} (--ep-imbalance, a stated "
            f"assumption); {how}; torchtitan's explicit FSDP2 forward prefetch (each layer all-gathers the next)")
