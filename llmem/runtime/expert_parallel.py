"""Expert parallelism on the runtime floor: torchtitan's all-to-all token dispatch in the traced step.

Expert parallelism in the real step, as torchtitan 0.3.0 runs it (models/common/token_dispatcher.py
AllToAllTokenDispatcher, distributed/fsdp.py apply_fsdp_to_decoder), applied to transformers 5.24's
`@use_experts_implementation` experts modules (integrations/moe.py grouped_mm_experts_forward):

- each experts module keeps rank 0's experts / ep local experts (torchtitan's Shard(0) over the ep mesh, held here as
  the local slice, which is what the DTensor's local tensor is), and FSDP2 shards them over the efsdp mesh through
  `shard_placement_fn` (a ShardPlacementResult per expert parameter: the block's experts form their own
  FSDPParamGroup), the dense parameters over dp as without ep, with torchtitan's explicit forward prefetch (each
  layer all-gathers the next: `forward_prefetch`);
- its forward is HF's grouped_mm forward with torchtitan's dispatch and combine around the grouped GEMMs: the T*k
  routed rows sorted by expert (HF), the tokens-per-expert counts exchanged (all_to_all_single, no grad), the rows
  dispatched by all_to_all_single_autograd, permuted rank-major -> expert-major (torchtitan's _permute), the local
  experts' grouped GEMMs (HF's _grouped_linear), un-permuted (torchtitan's _unpermute), combined by a second
  all_to_all_single_autograd, then HF's routing weights, inverse permutation and sum per token.

What cannot run on fake tensors is emulated and stated: the all-to-all splits are data (the routing's counts), so
the rank sends its T*k rows split evenly over the ep ranks and receives `received_rows` (balanced, or scaled by
--ep-imbalance). On the fake process group the collectives allocate their outputs as on a GPU (the fake mode's copy
at wait_tensor dropped, as under --cp). The activations the estimate learns from the real code
(llmem.learn) run the same forward with each all-to-all emulated by a new buffer of its output's size
(forward and backward), since the learning copy has no process group (`learning_ep`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from types import MethodType

import torch
from torch import nn

from llmem.errors import LlmemError
from llmem.setup.expert_parallel import received_rows, split_sizes

# (ep, imbalance) while llmem.learn runs its copy under --ep (no process group: emulated all-to-alls)
_LEARNING: contextvars.ContextVar[tuple[int, float] | None] = contextvars.ContextVar("llmem_learning_ep",
                                                                                     default=None)


@contextlib.contextmanager
def learning_ep(ep: int, imbalance: float) -> Iterator[None]:
    """The learning copy's step runs the EP forward with emulated all-to-alls (ep == 1: nothing)."""
    token = _LEARNING.set((ep, imbalance) if ep > 1 else None)
    try:
        yield
    finally:
        _LEARNING.reset(token)


@dataclass(frozen=True)
class ExpertParallel:
    """One rank's expert parallelism: the degree, the assumed imbalance, the ep mesh (None: emulated)."""
    ep: int
    imbalance: float
    ep_mesh: object | None = None


def ep_plan(layout, setup, device_type: str) -> ExpertParallel | None:
    """The step's expert parallelism: the layout's (with its (efsdp, ep) mesh), the learning copy's, or None."""
    if layout.ep > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (layout.expert_shard_degree, layout.ep),
                                mesh_dim_names=("efsdp", "ep"))
        return ExpertParallel(layout.ep, setup.ep_imbalance, mesh)
    learning = _LEARNING.get()
    return ExpertParallel(*learning) if learning else None


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """transformers' grouped-GEMM experts modules (their 3-D weights carry the experts on dim 0)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Experts") and hasattr(m, "num_experts")
            and hasattr(m, "down_proj")]


def apply_expert_parallel(model: nn.Module, plan: ExpertParallel, fake: bool) -> None:
    """Rank 0's local experts (on the meta model, before it is materialised) and the EP forward on each experts
    module."""
    if not fake:
        raise LlmemError("--ep is traced on fake tensors only (llmem trace / estimate): measure does not run the "
                         "expert-parallel all-to-all")
    modules = experts_modules(model)
    if not modules:
        raise LlmemError("--ep: this model has no transformers grouped-GEMM experts module to shard")
    for m in modules:
        experts = m.num_experts
        if experts % plan.ep:
            raise LlmemError(f"--ep {plan.ep} does not divide the model's {experts} routed experts")
        local = experts // plan.ep
        for name, p in list(m._parameters.items()):
            if p is not None and p.dim() >= 1 and p.shape[0] == experts:
                m._parameters[name] = nn.Parameter(p.detach()[:local], requires_grad=p.requires_grad)
        m.num_experts = local          # HF's count, the local one (the histogram bins span local x ep)
        m._llmem_ep = plan
        m.forward = MethodType(ep_experts_forward, m)


def expert_placement(layer: nn.Module, efsdp_mesh):
    """fully_shard's shard_placement_fn for one decoder layer under --ep (torchtitan's apply_fsdp_to_decoder): its
    routed experts' parameters Shard(0) on the efsdp mesh, the rest FSDP2's default; None without experts."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Shard

    expert_params = {id(p) for m in layer.modules() if getattr(m, "_llmem_ep", None) for p in
                     m.parameters(recurse=False)}
    if not expert_params:
        return None
    info = _get_mesh_info(efsdp_mesh, None)

    def placement(param: nn.Parameter):
        return ShardPlacementResult(placement=Shard(0), mesh_info=info) if id(param) in expert_params else None

    return placement


def efsdp_mesh_of(model: nn.Module):
    """The efsdp mesh the model's experts were set up with (None: no --ep)."""
    plan = next((m._llmem_ep for m in model.modules() if getattr(m, "_llmem_ep", None)), None)
    return plan.ep_mesh["efsdp"] if plan is not None and plan.ep_mesh is not None else None


# ------------------------------------------------------------------------------------------ the all-to-alls
class _EmulatedAllToAll(torch.autograd.Function):
    """all_to_all_single_autograd without a process group: a new buffer of the output's rows, and in backward one
    of the input's (what the collective allocates; its contents are the other ranks')."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_rows: int) -> torch.Tensor:
        ctx.in_rows = x.shape[0]
        return x.new_empty((out_rows, *x.shape[1:]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.new_empty((ctx.in_rows, *grad.shape[1:])), None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], plan: ExpertParallel) -> torch.Tensor:
    if plan.ep_mesh is None:
        return _EmulatedAllToAll.apply(x, sum(out_splits))
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(x, out_splits, in_splits, plan.ep_mesh["ep"])


def _exchange_counts(counts: torch.Tensor, plan: ExpertParallel) -> torch.Tensor:
    """torchtitan's _token_count_exchange: all_to_all_single of the (ep, experts / ep) tokens-per-expert."""
    if plan.ep_mesh is None:
        return counts.new_empty(counts.shape)
    from torch.distributed._functional_collectives import all_to_all_single, wait_tensor

    return wait_tensor(all_to_all_single(counts, None, None, plan.ep_mesh["ep"]))


# ------------------------------------------------------------------------------------------ the forward
def _permute(routed: torch.Tensor, counts: torch.Tensor, ep: int):
    """torchtitan's AllToAllTokenDispatcher._permute: rank-major (e, r) segments to expert-major, its index kept for
    the un-permute; the local experts' token counts."""
    e = counts.shape[0] // ep
    total = routed.shape[0]
    t_mat = counts.view(ep, e)
    input_starts = (counts.cumsum(0) - counts).view(ep, e)
    segment_lens = t_mat.t().reshape(-1)
    input_starts = input_starts.t().reshape(-1)
    seg_ids = torch.arange(segment_lens.shape[0], device=routed.device).repeat_interleave(segment_lens,
                                                                                           output_size=total)
    output_starts = segment_lens.cumsum(0) - segment_lens
    permuted_indices = input_starts[seg_ids] + torch.arange(total, device=routed.device) - output_starts[seg_ids]
    return routed.shape, routed[permuted_indices, :], permuted_indices, t_mat.sum(0)


def _dispatch(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, plan: ExpertParallel):
    """HF's sort by expert, then torchtitan's count exchange, dispatch all-to-all and permute."""
    num_top_k = top_k_index.size(-1)
    expert_ids_g, perm = torch.sort(top_k_index.reshape(-1))
    selected = hidden_states[perm // num_top_k]                         # (T*k, D), HF's selected_hidden_states_g
    histc_input = expert_ids_g.float() if hidden_states.device.type in ("cpu", "mps") else expert_ids_g.int()
    tokens_per_expert = torch.histc(histc_input, bins=self.num_experts * plan.ep, min=0,
                                    max=self.num_experts * plan.ep - 1).to(torch.int64)
    with torch.no_grad():
        counts = _exchange_counts(tokens_per_expert.view(plan.ep, -1), plan).reshape(-1)
    # the splits are the routing's data: emulated, balanced or scaled by the stated imbalance
    in_splits = split_sizes(selected.shape[0], plan.ep)
    out_splits = split_sizes(received_rows(hidden_states.shape[0], num_top_k, plan.ep, plan.imbalance), plan.ep)
    routed = _all_to_all(selected, out_splits, in_splits, plan)
    shape, routed, permuted_indices, local_counts = _permute(routed, counts, plan.ep)
    return routed, local_counts, perm, (shape, permuted_indices, in_splits, out_splits)


def _combine(y: torch.Tensor, meta, plan: ExpertParallel) -> torch.Tensor:
    """torchtitan's _unpermute and combine all-to-all: the expert outputs back to the rows' ranks."""
    shape, permuted_indices, in_splits, out_splits = meta
    out = y.new_empty(shape)
    out[permuted_indices, :] = y
    return _all_to_all(out, in_splits, out_splits, plan)


def ep_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' grouped_mm_experts_forward over the rank's local experts, with torchtitan's dispatch and
    combine (module docstring); `self.num_experts` is the local count (set by apply_expert_parallel)."""
    from transformers.integrations.moe import _grouped_linear

    plan: ExpertParallel = self._llmem_ep
    num_tokens, hidden_dim = hidden_states.shape[0], hidden_states.shape[-1]
    num_top_k = top_k_index.size(-1)
    routed, local_counts, perm, meta = _dispatch(self, hidden_states, top_k_index, plan)
    sample_weights_g = top_k_weights.reshape(-1)[perm]
    offsets = torch.cumsum(local_counts, dim=0, dtype=torch.int32)
    rows = routed.shape[0]
    local_ids = torch.arange(local_counts.shape[0], device=routed.device).repeat_interleave(
        local_counts, output_size=rows) if self.has_bias else None
    up = self.gate_up_proj if self.has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[local_ids] if self.has_bias else None
    proj_out = _grouped_linear(routed, up, offsets, bias=up_bias, is_transposed=self.is_transposed)
    proj_out = self._apply_gate(proj_out) if self.has_gate else self.act_fn(proj_out)
    down_bias = self.down_proj_bias[local_ids] if self.has_bias else None
    proj_out = _grouped_linear(proj_out, self.down_proj, offsets, bias=down_bias, is_transposed=self.is_transposed)
    if self.has_post_expert_norm:
        proj_out = self.post_expert_norm(proj_out)
    combined = _combine(proj_out, meta, plan)
    weighted_out = combined * sample_weights_g.unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
    weighted_out = weighted_out[inv_perm]
    return weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


def forward_prefetch(model: nn.Module, layers) -> None:
    """torchtitan's explicit forward prefetching under EP (apply_fsdp_to_decoder: "D2H syncs in EP could interfere
    with implicit prefetching"): the root (its embeddings) prefetches layer 0, each layer the next; the last
    layer's target, the norm and lm_head, is the root here, gathered already. Backward keeps FSDP2's implicit
    prefetch, the same previous-layer order as torchtitan's explicit list."""
    layers = list(layers)
    if layers:
        model.set_modules_to_forward_prefetch([layers[0]])
    for layer, following in zip(layers, layers[1:], strict=False):
        layer.set_modules_to_forward_prefetch([following])
