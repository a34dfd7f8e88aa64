"""What a step schedule reads and never changes: the set-up, the parameters' facts (llmem.estimator.param_facts),
the step's shapes and the engine's choices (FSDP2 or not, reshard after forward, the optimizer in backward), with
the size rules the events share (a unit's bytes, autocast's weight copies, what is offloaded).

Known Limitations: tensors under 64 KiB are left out of the schedules of models above a billion parameters
(SMALL_TENSOR_BYTES), a choice made here for every event.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from llmem.estimator.param_facts import ParamFacts, param_facts
from llmem.estimator.post_forward import post_forward_ranks
from llmem.estimator.states import cpu_offload, steps_on_host
from llmem.memory.activations.blocks import Block
from llmem.memory.activations.ckpt_offload import OffloadedCheckpoint, offloaded_checkpoint
from llmem.memory.activations.profile import ActivationProfile, sequence_tokens
from llmem.memory.activations.quantised import fp32_behind_quant
from llmem.memory.quant import QuantArgs, Transients, quant_args, transients
from llmem.model.anatomy import ParamInfo
from llmem.model.resolved import ResolvedSetup
from llmem.model.sharding import MATMUL_KINDS, is_embedding, is_lm_head
from llmem.model.vision import PEFT_PREFIX, under
from llmem.setup.layout import Layout
from llmem.setup.optimizers import OptimizerSpec
from llmem.setup.precision import Regime
from llmem.setup.training import TrainingSetup

SMALL_TENSOR_BYTES = 64 * 1024


@dataclass(frozen=True)
class StepFacts:
    """The step's facts, fixed at construction (an engine may choose its own `fsdp` and `reshard`)."""
    setup: TrainingSetup
    layout: Layout
    act: ActivationProfile
    regime: Regime
    optimizer: OptimizerSpec
    params: ParamFacts                 # per parameter: shards, gathers, blocks (llmem.estimator.param_facts)
    root: list[ParamInfo]              # the root module's parameters (embeddings, final norm, lm_head)
    layers: int                        # the decoder layers laid out (the first ones: the others are identical)
    hidden_size: int
    vocab_size: int
    workspace_bytes: int               # cuBLAS's workspace
    t: int                             # tokens of the micro-batch (virtual tokens included)
    tv: int                            # tokens x vocabulary: the logits' elements
    fsdp: bool                         # FSDP2 units shard the model states
    shards: int                        # FSDP2's DTensor shards of dim 0
    cpu_offload: bool                  # FSDP2's CPUOffloadPolicy: sharded parameters, gradients, optimizer on host
    host_step: bool                    # the optimizer steps on the host
    reshard: bool                      # reshard_after_forward
    post_forward_ranks: int | None     # --reshard-after-forward N (llmem.estimator.post_forward)
    gather_bytes: int                  # MixedPrecisionPolicy's param_dtype
    reduce_bytes: int                  # ... and reduce_dtype
    quant_args: QuantArgs              # the quantised base's storage (llmem.memory.quant)
    quant_tmp: dict[str, Transients]   # its dequantisation transients per quantised linear
    fp32_behind_quant: bool
    in_backward: bool                  # --optimizer-in-backward on the device

    # ---------------------------------------------------------------------------------------- sizes and rules
    def unit_bytes(self, unit: list[ParamInfo], per: int, only_trainable: bool = False) -> int:
        return sum(self.params.unsharded[p.name] for p in unit if p.trainable or not only_trainable) * per

    def gathered_bytes(self, unit: list[ParamInfo]) -> int:
        """A unit's all-gather output (FSDP2 gathers mixed dtypes as one uint8 buffer of the same bytes)."""
        return sum(sum(self.params.gather_sizes[p.name]) for p in unit)

    def casts(self, p: ParamInfo) -> bool:
        """Autocast makes a low-precision copy of this weight (one stored in that dtype needs none: a frozen one, or
        a trained one TRL's QLoRA cast made bf16; nor does a quantised one: bitsandbytes dequantises it itself)."""
        return self.params.element_bytes[p.name] != self.regime.mm and not self.params.quantised[p.name]

    def cast_weights(self, params: list[ParamInfo]) -> list[ParamInfo]:
        """The weights whose autocast copies a block's linears keep for backward (none outside autocast, nor in a
        compiled layer: its graph's own casts are learned with it)."""
        if not self.regime.autocast or self.act.compiled:
            return []
        return [p for p in params if self.autocast_copied(p) and not p.name.endswith("bias")]

    def autocast_copied(self, p: ParamInfo) -> bool:
        """Autocast makes this matmul parameter's low-precision copy where its linear runs (casts), the schedule
        laying it out: not a cross-layer adapter part one layer holds (ParamFacts.shared_parts), which every layer
        reads through its own tuner layer's ops (Lily's `lily_B.weight.reshape(...)`, cast there, per layer): the
        learned layer's blocks hold that copy already."""
        return p.module_kind in MATMUL_KINDS and self.casts(p) and p.name not in self.params.shared_parts

    def cast_bytes(self, params: list[ParamInfo]) -> list[int]:
        """The autocast weight copies a block's linears keep for backward."""
        return [self.params.tp_local[p.name] * self.regime.mm for p in self.cast_weights(params)]

    def offloaded(self, i: int) -> bool:
        """Layer i's saved tensors live on the host between forward and backward (a checkpointed layer's input
        is held by the checkpoint itself, on the device)."""
        return self.act.offload and not self.act.checkpointed(i)

    def gathered_input(self, b: Block) -> bool:
        """--sequence-parallel: whether block b keeps the all-gathered norm output its linears read (the block
        whose forward temporaries are the gather buffers, llmem.memory.activations.blocks gathered_input). In a
        checkpointed layer's first forward (under no_grad: torch/utils/checkpoint.py
        _checkpoint_without_reentrant_generator keeps nothing) the [t, h] tensor dies once its linears have read it
        (laid out as the next block's tensors are made), not at the layer's end with the block's other tensors."""
        return self.setup.sequence_parallel and bool(b.temps) and bool(b.tensors)

    def replicated_grad(self, p: ParamInfo) -> bool:
        """--tp: an untied vocab-parallel embedding's gradient comes out of embedding_dense_backward whole, [vocab, h]
        (torch/distributed/tensor/_ops/_embedding_ops.py embedding_dense_backward_strategy: Shard(1), Partial or
        Replicate, never the weight's Shard(0))."""
        return p.name in self.params.vocab_parallel and p.tied_to is None

    def unit(self, unit_key: int | None) -> list[ParamInfo]:
        """A decoder layer's parameters (None: the root's)."""
        return self.params.by_layer.get(unit_key, [])

    @cached_property
    def ckpt_offload(self) -> OffloadedCheckpoint | None:
        """--ckpt-offload: the library's offloaded checkpoint over this step's layer inputs (None: none)."""
        return offloaded_checkpoint(self.setup.ckpt_offload, self.act.ckpt_input_bytes, self.regime.res)

    @property
    def embed_leaf_apart(self) -> bool:
        """A frozen embedding's output laid out on its own (ActivationProfile.embed_leaf_apart), also under an
        offloaded checkpoint: layer 0's input goes to the host while its AccumulateGrad node holds it."""
        return self.act.embed_leaf_apart or self.ckpt_offload is not None

    @cached_property
    def own_units(self) -> dict[str, list[ParamInfo]]:
        """--shard-embeddings under FSDP2: "embed" and "head", units of their own (none otherwise)."""
        return own_units(self.root, self.fsdp and self.setup.shard_embeddings)

    @cached_property
    def vision_params(self) -> frozenset[str]:
        """A vision-language model's root parameters whose gradients its vision side's backward makes (the encoder's
        and the merger's: llmem.estimator.schedule.vision), not the head's."""
        prefixes = tuple(m + "." for m in self.act.vision.modules) if self.act.vision is not None else ()
        return frozenset(p.name for p in self.root if prefixes
                         and p.name.removeprefix(PEFT_PREFIX).startswith(prefixes))

    @cached_property
    def vision_units(self) -> dict[str, list[ParamInfo]]:
        """FSDP2 on a vision-language model: the tower's units (VisionStep.units, accelerate's auto-wrap of the
        model's `_no_split_modules`: the encoder's blocks, Gemma 3's patch embedding) with their parameters, in
        forward order; {} otherwise."""
        vision = self.act.vision
        if not self.fsdp or vision is None:
            return {}
        return {u: [p for p in self.root if under(p.name.removeprefix(PEFT_PREFIX), u)] for u in vision.units}

    @cached_property
    def root_unit(self) -> list[ParamInfo]:
        """The root FSDP2 unit's parameters: the root module's less those of the units of their own (the
        embedding's and lm_head's under --shard-embeddings, a vision tower's)."""
        own = {p.name for unit in (*self.own_units.values(), *self.vision_units.values()) for p in unit}
        return [p for p in self.root if p.name not in own] if own else self.root


def own_units(root: list[ParamInfo], shard_embeddings: bool) -> dict[str, list[ParamInfo]]:
    """torchtune's custom_sharded_layers ['tok_embeddings', 'output'] (shard_model: fully_shard on each, before the
    root): the input embedding and the untied lm_head split off the root unit, in forward order."""
    if not shard_embeddings:
        return {}
    return {"embed": [p for p in root if is_embedding(p) and p.tied_to is None],
            "head": [p for p in root if is_lm_head(p) and not is_embedding(p)]}


def step_facts(r: ResolvedSetup, act: ActivationProfile, layers: int | None = None) -> StepFacts:
    """The facts of `r`'s step over its first `layers` decoder layers (all of them by default)."""
    anatomy, setup, layout = r.anatomy, r.setup, r.layout
    depth = anatomy.num_layers if layers is None else layers
    facts = param_facts(r, act.blocks, depth, (act.kinds.cross_blocks, act.kinds.cross_layers))
    fsdp = layout.shards_model_states
    t = setup.batch_size * sequence_tokens(anatomy, setup)
    q_args = quant_args(setup, fsdp)
    host_step = steps_on_host(r)
    return StepFacts(
        setup=setup, layout=layout, act=act, regime=r.regime, optimizer=r.optimizer, params=facts,
        root=facts.by_layer.get(None, []), layers=depth, hidden_size=anatomy.hidden_size,
        vocab_size=anatomy.vocab_size, workspace_bytes=r.gpu.cublas_workspace_bytes, t=t, tv=t * anatomy.vocab_size,
        fsdp=fsdp, shards=layout.shard_degree, cpu_offload=cpu_offload(r), host_step=host_step,
        reshard=r.method.reshard_after_forward, post_forward_ranks=post_forward_ranks(r),
        gather_bytes=setup.gather_bytes, reduce_bytes=setup.reduce_bytes, quant_args=q_args,
        # (none laid out in a compiled layer: its graph's dequantisation is learned with it, learning_need)
        quant_tmp={} if act.compiled else {
            p.name: transients(p.shape, setup.quant_base, q_args, t, setup.compute_dtype == "float16",
                               p.module_kind == "Conv1D")
            for p in facts.kept if facts.quantised[p.name]},
        fp32_behind_quant=fp32_behind_quant(setup.quant_base, r.regime),
        in_backward=setup.optimizer_in_backward and not host_step,
    )
