"""What a decoder layer keeps under torchtitan's op-level selective activation checkpointing (--ac-policy op).

torchtitan/distributed/activation_checkpoint.py (`_apply_op_sac`) runs each block under torch.utils.checkpoint with
`create_selective_checkpoint_contexts(policy)` (torch/utils/checkpoint.py): the forward's outputs of the ops in its
save list are kept (MUST_SAVE) in the checkpoint's storage, everything else is recomputed in backward. The list
saves aten.mm except every second one of a forward (the 1st, 3rd, ... are saved), the SDPA kernels' outputs, max,
abs and reduce_scatter. So between forward and backward a layer keeps, besides its input (as under full
checkpointing, llmem.memory.activations.profile):
- the output of every other plain matmul in forward order. nn.Linear without a bias is aten.mm (on the 2-D view
  of its input); with a bias, at::linear takes addmm (`_flatten_nd_linear`), which is not on the list and is not
  counted (Qwen2's q/k/v). Some of these outputs are tensors the layer's backward keeps anyway (SDPA's v, SiLU's
  gate, the gate x up product's up: the recipe's `Block.outputs`); the others (q_proj's, o_proj's, down_proj's)
  are extra bytes;
- the SDPA kernel's whole output tuple: the attention output and its fp32 logsumexp (the recipe's tensors; the
  RNG state scalars are below what the estimate counts).
In backward the recompute hands the stored outputs back instead of running their ops: the kept recipe tensors are
not made again, an extra one dies as soon as the recompute has read it, and the recompute stops early
(`early_stop`) once the layer's last saved tensor is packed - at the last linear's input - so the last linear's
stored output is never read and lives until the layer's backward ends.

Worked here from the llama_like recipe (Llama, Mistral, Qwen2: separate projections, a dense gated MLP); for the
other families it is learned with the layer (llmem.learn.selective_read: which op made each tensor, the same rule
applied), under SDPA or flash attention; the rest is refused with one line (`selective_layer`).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.errors import LlmemError
from llmem.memory.activations.blocks import Block, Dims, block_owner
from llmem.model.anatomy import ModelAnatomy
from llmem.model.families import family_of
from llmem.model.sharding import MATMUL_KINDS
from llmem.setup.attention import AttentionSpec
from llmem.setup.precision import Regime


@dataclass(frozen=True)
class SelectiveLayer:
    """One decoder layer under op-level SAC: what its forward leaves in the checkpoint's storage."""
    stored: tuple[tuple[int, int], ...]          # (block, tensor index) of recipe tensors kept from the forward
    extra: tuple[tuple[int, int, bool], ...]     # (block made in, bytes, read by the recompute) of other outputs
    saved_mm: tuple[str, ...]                    # the linears whose mm output is saved, forward order

    def kept_bytes(self, blocks: tuple[Block, ...]) -> int:
        """Bytes the layer keeps besides its input between forward and backward."""
        return sum(blocks[j].tensors[k] for j, k in self.stored) + sum(n for _, n, _ in self.extra)

    @property
    def held_bytes(self) -> int:
        """Stored outputs the recompute never reads (after the early stop): live through the layer's backward."""
        return sum(n for _, n, read in self.extra if not read)


def saved_matmuls(anatomy: ModelAnatomy) -> tuple[str, ...]:
    """The decoder layer's linears (module names within the layer, forward = module order) whose output the policy
    saves: those without a bias run aten.mm; the 1st, 3rd, ... of them are saved."""
    layer = [p for p in anatomy.params if p.layer_index == 0]
    names = {p.name for p in layer}
    plain = [p.name.rsplit(".", 1)[0] for p in layer if p.module_kind in MATMUL_KINDS and p.name.endswith(".weight")
             and p.name.rsplit(".", 1)[0] + ".bias" not in names]
    return tuple(name for n, name in enumerate(plain, start=1) if n % 2 == 1)


def hand_selective_refusal(anatomy: ModelAnatomy) -> str | None:
    """Why the hand recipes' model of the policy does not reach this family's layer (None: it does)."""
    spec = family_of(anatomy.model_type)
    if spec.recipe != "llama_like" or spec.fused_projections or spec.experts or spec.post_norms:
        return (f"--ac-policy op is modelled for Llama, Mistral and Qwen2 layers, not {anatomy.model_type}; use "
                "--grad-ckpt")
    return None


def selective_refusal(anatomy: ModelAnatomy, attn: AttentionSpec, learned: bool, why_not_learned: str = "") -> str | None:
    """Why the estimate cannot model op-level SAC on this model (None: it can). `learned`: the layer, and what the
    policy keeps of it, are learned from the real code (llmem.memory.activations.learned.LearnedSelective)."""
    if attn.keeps_scores:
        return (f"--ac-policy op is modelled under SDPA / flash attention; {anatomy.architecture} runs eager "
                "attention; use --grad-ckpt")
    if learned:
        return None
    if family_of(anatomy.model_type).recipe is None or why_not_learned:
        return (f"--ac-policy op on {anatomy.model_type} needs what its layers keep learned from the real code, "
                f"which was not done ({why_not_learned or 'LLMEM_LEARN=never'}); use --grad-ckpt")
    return hand_selective_refusal(anatomy)


def selective_layer(anatomy: ModelAnatomy, blocks: tuple[Block, ...], d: Dims, r: Regime, attn: AttentionSpec,
                    learned: SelectiveLayer | None = None, why_not_learned: str = "") -> SelectiveLayer:
    """The layer's stored outputs under torchtitan's op-level policy (see the module docstring): the learned ones
    where the layer is learned, else worked from the hand recipe's blocks."""
    why = selective_refusal(anatomy, attn, learned is not None, why_not_learned)
    if why:
        raise LlmemError(why)
    if learned is not None:
        return learned
    outputs = {name: (j, k) for j, b in enumerate(blocks) for name, k in b.outputs}
    layer_linears = [p for p in anatomy.params if p.layer_index == 0 and p.module_kind in MATMUL_KINDS
                     and p.name.endswith(".weight")]
    last = layer_linears[-1].name.rsplit(".", 1)[0]
    by_module = {p.name.rsplit(".", 1)[0]: p for p in layer_linears}
    stored: list[tuple[int, int]] = []
    extra: list[tuple[int, int, bool]] = []
    names = saved_matmuls(anatomy)
    for module in names:
        short = module.rsplit(".", 1)[-1]
        if short in outputs:
            stored.append(outputs[short])
        else:
            p = by_module[module]
            extra.append((block_owner(blocks, p.name), d.t * p.out_features * r.mm, module != last))
    # the SDPA kernel's output and logsumexp: the attention block's tensors after q, k, v
    attention = next(j for j, b in enumerate(blocks) if b.name == "attention")
    stored += [(attention, 3), (attention, 4)]
    return SelectiveLayer(tuple(sorted(set(stored))), tuple(extra), names)
