"""The step's allocation schedule: the sequence of tensor allocations and frees one training step makes on rank 0,
written from the same model states and activation recipes the moments use, for the allocator model to replay.

`max_memory_allocated` counts whole allocator blocks and `max_memory_reserved` counts segments, so both depend on
the order and the sizes of the step's tensors, not only on their sum. `StepSchedule` writes two iterations of
forward, loss, backward, optimizer step and zero_grad: parameters, DDP's buckets, FSDP2's all-gather and
reduce-scatter buffers on their own streams, the tensors each block keeps for backward, autocast's weight copies,
bitsandbytes' dequantisation transients, gradients, optimizer states and the step's temporaries. It plays the
recipe; its parts own the events (FSDP2 units, gradients, the optimizer, blocks, layers, head and loss: this
package's modules), each naming the PyTorch behaviour it lays out, and what is live is one `StepState`.

Known Limitations: the first `layers` decoder layers only (llmem.estimator.engine extrapolates the others); two
iterations (the second is the steady state); rank 0's view (the other ranks are alike but for the pipeline's,
llmem.estimator.pipeline).
"""

from __future__ import annotations

from llmem.estimator.ddp_buckets import reducer_bucket_bytes
from llmem.estimator.events import Schedule
from llmem.estimator.objective_steps import objective_events
from llmem.estimator.objectives import objective_view
from llmem.estimator.schedule.blocks import BlockEvents
from llmem.estimator.schedule.embedding_adapter import embedding_adapter_backward
from llmem.estimator.schedule.facts import SMALL_TENSOR_BYTES, StepFacts, step_facts
from llmem.estimator.schedule.gradients import Gradients
from llmem.estimator.schedule.head import HeadEvents
from llmem.estimator.schedule.layers import LayerEvents
from llmem.estimator.schedule.optimizer import OptimizerEvents
from llmem.estimator.schedule.state import ForwardLive, StepState, UnitKey
from llmem.estimator.schedule.units import FsdpUnits
from llmem.estimator.schedule.vision import VisionEvents
from llmem.estimator.states import fsdp_shards
from llmem.memory.activations.embedding_adapter import embedding_adapters
from llmem.memory.activations.profile import ActivationProfile
from llmem.memory.quant import storage_tensors
from llmem.model.anatomy import ParamInfo
from llmem.model.peft import buffer_bytes
from llmem.model.resolved import ResolvedSetup
from llmem.model.sharding import is_embedding


class StepSchedule:
    """Two iterations of forward, loss, backward, optimizer step and zero_grad, as rank 0 runs them.

    `layers` keeps only the first decoder layers (the others are identical), for extrapolation. `facts` are fixed
    at construction, `state` is what is live; the parts (`units`, `gradients`, `optimizer`, `blocks`,
    `layer_events`, `head`) write the events, reaching the overridable steps (llmem.estimator.schedule.hooks)
    through this object.
    """

    def __init__(self, r: ResolvedSetup, act: ActivationProfile, layers: int | None = None) -> None:
        trained = r.setup.objective_spec.runs_trainer   # TRL's trainers (llmem.estimator.objectives)
        if trained:
            r, act = objective_view(r, act)       # chosen and rejected: twice the sequences
        self.facts: StepFacts = self.step_facts(r, act, layers)
        # Above a billion parameters, tensors under 64 KiB (biases, norm weights and their states, per-token
        # statistics) are < 0.01 % of the step; leaving them out halves the events to replay.
        self.sch = Schedule(min_bytes=SMALL_TENSOR_BYTES if r.anatomy.total_params >= 1e9 else 1)
        self.state = StepState()
        self.units = FsdpUnits(self, self.state)
        self.gradients = Gradients(self.facts, self.sch, self.state)
        self.optimizer = OptimizerEvents(self.facts, self.sch, self.state)
        self.blocks = BlockEvents(self.facts, self.sch, self.state)
        self.layer_events = LayerEvents(self, self.state, self.blocks, self.units)
        self.head = HeadEvents(self, self.state)
        self.vision = VisionEvents(self, self.units)    # a vision-language step's batch and vision side
        self.objective = objective_events(self, r) if trained else None   # TRL's trainers' steps
        # peft's LoRA on the input embedding (llmem.estimator.schedule.embedding_adapter)
        self.embed_adapters = embedding_adapters(r.anatomy, r.setup, r.regime, self.facts.t, self.facts.fsdp)

    def step_facts(self, r: ResolvedSetup, act: ActivationProfile, layers: int | None) -> StepFacts:
        """The step's facts (an engine that runs its own way adjusts them)."""
        return step_facts(r, act, layers)

    # ------------------------------------------------------------------------------------------ the recipe
    def build(self, iterations: int = 2) -> Schedule:
        """The step's schedule, laid out once (the builder's parts are let go of after it: drop_parts)."""
        try:
            self.lay_out(iterations)
            return self.sch
        finally:
            self.drop_parts()

    def lay_out(self, iterations: int) -> None:
        self.setup_phase()
        for it in range(iterations):
            self.forward(it)
            self.backward(it)
            self.optimizer_step(it)

    def drop_parts(self) -> None:
        """Cut the parts' references back to this builder (the hooks they call): built (or abandoned at
        LiveBytesOver), the builder is then no cycle, and its schedule's events are freed as soon as the caller
        drops them rather than at the cyclic garbage collector's next pass (a fifth of a plan's time went there).
        The parts' own values stay readable."""
        parts = [v for v in vars(self).values() if hasattr(v, "__dict__")]
        parts += [v for part in parts for v in vars(part).values() if hasattr(v, "__dict__")]    # (a part's part)
        for part in parts:
            for name in [n for n, v in vars(part).items() if v is self]:
                delattr(part, name)

    def setup_phase(self) -> None:
        """Parameters (bitsandbytes' storage for a quantised base) and DDP's gradient buckets."""
        sch, f = self.sch, self.facts
        sch.phase = "setup:setup"
        for p in f.params.kept:
            sch.own(p.layer_index)
            if f.params.quantised[p.name]:   # the quantised storage: packed weight and quantisation constants
                for n in storage_tensors(p.shape, f.setup.quant_base, f.quant_args, p.module_kind == "Conv1D",
                                         fsdp_shards(f.layout), offloaded=f.cpu_offload):
                    sch.alloc(n, "weights")
            elif not f.cpu_offload:          # CPUOffloadPolicy: every sharded parameter is on the host
                sch.alloc(f.params.shard_numel[p.name] * f.params.element_bytes[p.name], "weights")
        sch.own(None)
        for b in f.params.buffers:                  # an adapter's buffers: whole on every rank, in their own dtype
            sch.alloc(buffer_bytes(b, f.setup), "weights")
        if f.layout.spec.gradient_buckets:
            self.ddp_buckets()
        self.vision.batch()

    def ddp_buckets(self) -> None:
        """The reducer's buckets as DDP's constructor allocates them (llmem.estimator.ddp_buckets: one per dtype,
        the trained parameters' element width standing for their dtype)."""
        params = self.facts.params
        sizes = [params.shard_numel[p.name] * params.element_bytes[p.name] for p in params.trainable]
        for size in reducer_bucket_bytes(sizes, [params.element_bytes[p.name] for p in params.trainable]):
            self.sch.alloc(size, "communication_buffers")

    def forward(self, it: int) -> None:
        sch, alloc, f = self.sch, self.sch.alloc, self.facts
        act = f.act
        if self.objective is not None and it == 0:    # the reference copy's weights and the batch, before the step
            self.objective.reference_weights()
            self.objective.batch()
        sch.phase = f"it{it}:forward"
        if self.objective is not None:    # forwards before the policy's own (KTO's KL sequences)
            self.objective.before_forward()
        self.vision.units.cast_inputs()             # (FSDP2's cast of a vision-language batch's pixel values)
        self.unshard_forward(None, f.root_unit)     # the root is not resharded after forward (FSDP2 default)
        self.units.prefetch_forward(0)
        fwd = self.state.forward = ForwardLive()
        self.state.iteration = it
        if "embed" in f.own_units:
            self.own_forward("embed")
        self.vision.forward()
        fwd.embed_keys = [self.model_kept(n) for n in act.embed_tensors]
        if "embed" in f.own_units:
            self.own_post_forward("embed")
        if act.offload:
            sch.free_all(fwd.embed_keys)
        if f.embed_leaf_apart:
            fwd.embed_keys.append(alloc(act.embed_leaf_bytes, "activations") if act.embed_leaf_bytes else -1)
        if f.ckpt_offload is not None and not act.embed_leaf_bytes:   # a trained embedding's output: layer 0's input
            fwd.passed = alloc(f.ckpt_offload.input_bytes, "activations")
        fwd.shared_keys = sch.alloc_many(act.shared_tensors, "activations")
        mask_key = alloc(act.mask_bytes, "activations") if act.mask_bytes else -1
        if not f.own_units:             # (the embedding's unit: at layer 0's first matmul, once it is gathered)
            self.ensure_workspace()
        for i in range(f.layers):
            self.forward_layer(i)
        sch.own(None)
        if not f.own_units:             # (the lm_head's unit: its all-gather frees the last layer's)
            self.release_forward_gathers()
        sch.free(mask_key)              # the packed mask dies with the model's forward
        if f.ckpt_offload is not None:  # the last layer's output is the final norm's input, laid out by the head
            sch.free(fwd.passed)
            fwd.passed = -1
        self.head_forward()
        if f.own_units:                 # the root's post-forward, after the loss: the lm_head's all-gather output
            self.release_forward_gathers()
        self.vision.units.release_cast()
        sch.free(fwd.passed)            # the final norm has read the last layer's output
        sch.free_all(fwd.bias_cache)    # autocast exit clears its cache; saved weight copies stay referenced
        if act.offload and not act.grad_ckpt:
            # the model's forward drops its rotary cos/sin and the layers' copies are on the host; checkpointed
            # layers' recompute partials (HF passes them as keywords) hold them on the device until their backward
            sch.free_all(fwd.shared_keys)
        sch.free_all(fwd.cache)
        sch.free(fwd.logits)            # the model output is dropped before backward
        self.vision.forward_returned()  # (with what a vision-language model's output holds)

    def backward(self, it: int) -> None:
        sch, f = self.sch, self.facts
        sch.phase = f"it{it}:backward"
        layers = f.layers
        if "head" in f.own_units:   # the root's pre-backward hook gathers the lm_head's unit, last before it
            self.prefetch("head", f.own_units["head"])
        elif not getattr(self.objective, "loss_outside_model", False):   # TRL's ORPO / CPO: at the logits' gradient
            self.prefetch(layers - 1, f.unit(layers - 1))   # the root's pre-backward hook gathers it
        sch.mark("lm_head and loss")
        self.head_backward(it)
        if not f.own_units:      # (the lm_head's unit: its reduce-scatter input, freed at the next one)
            self.state.units.pending_rs = []
        for i in reversed(range(layers)):
            self.backward_layer(i, it)
        sch.own(None)
        fwd = self.state.forward
        if f.embed_leaf_apart and f.act.embed_leaf_bytes:   # AccumulateGrad: its .grad
            fwd.embed_keys.append(sch.alloc(f.act.embed_leaf_bytes, "activations"))
        # embedding backward: the gradient of the embedding output (the residual stream's dtype) is live
        embeds = [p for p in f.root if p.trainable and is_embedding(p)]
        if embeds and "embed" in f.own_units:     # its pre-backward hook, on the embedding's output
            self.unshard_backward("embed", f.own_units["embed"])
        # (a vision-language model's: the scatter's backward makes it, then the merger's and the vision encoder's
        # backward run before the embedding's own: llmem.estimator.schedule.vision; with cross-attention layers
        # instead the embedding's runs first, from layer 0's input gradient, and the vision side's after it)
        after = self.vision.after_embedding
        if after:       # (the tower's own embeddings' gradients are its backward's, made after this one)
            embeds = [p for p in embeds if p.name not in f.vision_params]
        late = [] if after else self.vision.backward(it)
        adapters = self.embed_adapters
        stream_grad = sch.alloc(f.t * f.hidden_size * f.regime.res, "activations") \
            if (embeds or adapters) and (after or not self.vision.has_backward) else -1
        for p in embeds:
            self.make_grad(p, root_unit=True)
        embedding_adapter_backward(self, adapters, f.regime.res)
        self.flush_steps(it)
        sch.free(stream_grad)
        if after:
            late = self.vision.backward(it)
        sch.free_all(late)
        sch.free_all(fwd.embed_keys)
        sch.free_all(fwd.shared_keys)
        if f.fsdp:
            self.units.root_post_backward()
            self.vision.units.final_callback()     # a vision tower's units, after the root's

    def optimizer_step(self, it: int) -> None:
        """optimizer.step() (its states at the first step, its temporaries as its row describes them), then
        zero_grad(set_to_none=True)."""
        self.sch.phase = f"it{it}:optimizer_step"
        self.sch.mark("optimizer step")
        self.optimizer.step(it)

    def model_kept(self, size: int) -> int:
        """A tensor the model's own ops keep for backward (the root's cast of a vision-language batch's pixel
        values under FSDP2 is one it already made: llmem.estimator.schedule.vision_units)."""
        cast = self.vision.units.take_cast(size, kept=True)
        return cast if cast is not None else self.sch.alloc(size, "activations")

    # ------------------------------------------------------------------------------------------ the parts' steps
    def forward_layer(self, i: int) -> None:
        self.layer_events.forward(i)

    def backward_layer(self, i: int, it: int) -> None:
        self.layer_events.backward(i, it)

    def head_forward(self) -> None:
        if self.objective is not None:    # TRL's fused head and the reference forward
            return self.objective.head_forward()
        self.head.forward()

    def head_backward(self, it: int) -> None:
        if self.objective is not None:    # TRL's fused head
            return self.objective.head_backward(it)
        self.head.backward(it)

    # ------------------------------------------------------------------------------------------ hooks (StepHooks)
    def unshard_forward(self, unit_key: UnitKey, unit: list[ParamInfo]) -> None:
        self.units.unshard_forward(unit_key, unit)

    def unshard_backward(self, unit_key: UnitKey, unit: list[ParamInfo]) -> None:
        self.units.unshard_backward(unit_key, unit)

    def prefetch(self, unit_key: UnitKey, unit: list[ParamInfo]) -> None:
        self.units.prefetch(unit_key, unit)

    def reshard_unit(self, unit_key: UnitKey) -> None:
        self.units.reshard_unit(unit_key)

    def release_forward_gathers(self) -> None:
        self.sch.free_all(self.state.units.last_forward_ag)

    def reduce_scatter_layer(self, i: int) -> None:
        self.units.reduce_scatter_layer(i)

    def own_forward(self, key: str) -> None:
        self.units.own_forward(key)

    def own_post_forward(self, key: str) -> None:
        self.units.own_post_forward(key)

    def own_post_backward(self, key: str) -> None:
        self.units.own_post_backward(key)

    def ensure_workspace(self) -> None:
        if self.state.workspace < 0:
            self.state.workspace = self.sch.alloc(self.facts.workspace_bytes, "cuda_workspaces")

    def make_grad(self, p: ParamInfo, root_unit: bool = False, low: int | None = None) -> None:
        self.gradients.make(p, root_unit, low)

    def hand_over_grad(self, p: ParamInfo, key: int) -> None:
        """The lm_head gradient `key` TRL's fused head hands to AccumulateGrad: held for the root's reduce-scatter
        (FSDP2) or the optimizer step."""
        self.gradients.hand_over(p, key)

    def head_backward_params(self) -> list[ParamInfo]:
        return self.gradients.head_params()

    def flush_steps(self, it: int) -> None:
        self.optimizer.flush_steps(it)

    # ---------------------------------------------- TRL's trainers: what an engine does its own way (DeepSpeed's)
    def reference_numels(self) -> list[int]:
        """The reference copy's parameters on this rank: FSDP2's shards (trl's prepare_fsdp), whole without it."""
        return [self.facts.params.shard_numel[p.name] for p in self.facts.params.kept]

    def reference_fetch(self, where) -> None:
        """The reference's own engine gathering its modules in its no-grad forward: none in PyTorch's step (FSDP2's
        reference is its own unit, gathered by the objective's events)."""

    def gather_for_generation(self) -> list[int]:
        """What the engine gathers around generate (TRL's unwrap_model_for_generation): nothing in PyTorch's step."""
        return []

    def release_after_generation(self, keys: list[int]) -> None:
        self.sch.free_all(keys)
