"""Pipeline parallelism on the runtime floor: torch's PipelineStage and schedule run the traced step.

Pipeline parallelism in the real step: one rank's stage(s) of the HF model, split as torchtitan splits it, run by
torch's own PipelineStage(s) and schedule (torch/distributed/pipelining) on the fake process group.

The stage is the model with only its decoder layers (torchtitan's _split_module: the others deleted), the embedding
on the first stage, the final norm and lm_head on the last (elsewhere nn.Identity / None), its forward the stage's
part of the HF forward (input ids or the previous stage's hidden states in, hidden states or logits out). The loss
is the HF model's own loss_function on the last stage's logits, as the schedule's loss_fn. Under a looped schedule
(Interleaved1F1B) the rank's model keeps the layers of all its stages and each stage is a StageChunk over it, the
schedule torch's _PipelineScheduleRuntime over the rank's stages.

Two things of torch's pipelining cannot run on a fake process group and fake tensors, and are replaced:
- the P2P warm-up vote (`_PipelineSchedule._warmup_p2p`: a recv from the neighbour, then `.item()` on it, which a
  fake tensor refuses with DataDependentOutputException) is given its outcome, STATIC inference mode;
- so the stage is given its input / output shapes (PipelineStage's static mode): torchtitan's dynamic metadata
  inference (`recv_object_list` of the neighbour's shapes, which the fake process group leaves unset, and one extra
  forward / backward of micro-batch 0 on the first step) is not run.
The P2P sends and receives themselves run (no-ops on the fake process group); the schedule's order, its recv
buffers, fwd_cache, gradient accumulation over micro-batches and FSDP2's no-sync are torch's.

Under TP x PP the rank's split model is parallelized with the TP plan on the tp dimension of the (pp, dp, tp) mesh
before FSDP2 (llmem.runtime.distributed.apply_method), as torchtitan's pipeline_llm hands each model chunk to
parallelize_llama; under --sequence-parallel the stages exchange the residual stream's local Shard(1) shard
(boundary_in / boundary_out), as torchtitan's blocks return local tensors.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
from torch import nn

from llmem.runtime.build import causal_lm
from llmem.setup.pipeline import StageSplit, pipeline_schedule, rank_splits, stages_per_rank

EMULATION_NOTE = ("pipeline: torch's PipelineStage and {schedule} on the fake process group; its P2P warm-up vote "
                  "and shape inference (which need a peer) replaced by static shapes: torchtitan's extra forward / "
                  "backward of micro-batch 0 at the first step is not traced; a looped schedule's stages on a rank "
                  "run over the rank's one split model (torchtitan: a model copy each, which differs only in the "
                  "rotary embedding's buffer)")


def stage_split(setup, num_layers: int, rank: int) -> tuple[StageSplit, ...]:
    """The stages rank `rank` runs: one (GPipe, 1F1B), or its chunks r, r + pp, ... (Interleaved1F1B)."""
    return rank_splits(num_layers, setup.pp, stages_per_rank(setup.pp_schedule, setup.pp_virtual_stages), rank)


def split_model(model: nn.Module, splits: tuple[StageSplit, ...]) -> None:
    """Keep only the rank's modules (on meta, before materialising): torchtitan's _split_module on an HF causal LM,
    the decoder layers of all the rank's stages in one layer list. One stage: the model's forward becomes the
    stage's part of the HF forward; several: each stage's module is a StageChunk over the model (PipelineRunner)."""
    lm = causal_lm(model)
    base = lm.get_decoder()
    base.layers = nn.ModuleList([base.layers[i] for s in splits for i in s.layers])
    if not splits[0].embedding:
        base.embed_tokens = None
    if not splits[-1].head:
        base.norm = nn.Identity()
        lm.lm_head = nn.Identity()
    if len(splits) > 1:
        return
    forward_of_class = type(lm).forward
    split = splits[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kw = {"input_ids": x} if split.embedding else {"inputs_embeds": boundary_in(self, x)}
        if split.head:
            return forward_of_class(self, **kw).logits
        return boundary_out(base(**kw).last_hidden_state)

    lm.forward = types.MethodType(forward, lm)


def boundary_in(lm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A received residual stream under --sequence-parallel: the local [micro-batch, seq / tp, hidden] shard as the
    Shard(1) DTensor the stage's layers take (torchtitan's blocks take the local shard, SequenceParallel's
    _prepare_input_fn makes the same DTensor; HF's model reads the sequence length off it). A view, no copy."""
    mesh = lm.__dict__.get("_llmem_sp_mesh")
    if mesh is None:
        return x
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(x, mesh, (Shard(1),), run_check=False)


def boundary_out(y: torch.Tensor) -> torch.Tensor:
    """The stage's output as sent: the local shard of a DTensor residual stream (torchtitan's use_local_output)."""
    from torch.distributed.tensor import DTensor

    return y.to_local() if isinstance(y, DTensor) else y


class StageChunk(nn.Module):
    """One of a looped schedule's stages on this rank: its layers of the (split) model, run through the HF
    decoder's forward with the decoder's layer list (and final norm, past the last stage: Identity) swapped for the
    stage's for the call. torchtitan builds each stage as its own copy of the model; sharing the rank's one model
    differs only in the rotary embedding's inv_freq buffer (one instead of one per stage)."""

    def __init__(self, model: nn.Module, split: StageSplit, layers: range) -> None:
        super().__init__()
        lm = causal_lm(model)
        base = lm.get_decoder()
        self.layers = nn.ModuleList([base.layers[i] for i in layers])      # parameters(): the stage's
        self.split = split
        object.__setattr__(self, "_lm", lm)                                  # not a submodule
        object.__setattr__(self, "_norm", base.norm if split.head else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lm = self._lm
        base = lm.get_decoder()
        kw = {"input_ids": x} if self.split.embedding else {"inputs_embeds": boundary_in(lm, x)}
        layers, norm = base.layers, base.norm
        base.layers, base.norm = self.layers, self._norm
        try:
            if self.split.head:
                return type(lm).forward(lm, **kw).logits
            return boundary_out(base(**kw).last_hidden_state)
        finally:
            base.layers, base.norm = layers, norm


def stage_chunks(model: nn.Module, splits: tuple[StageSplit, ...]) -> list[StageChunk]:
    """The rank's stages as modules over its split model (whose layer list holds them in stage order)."""
    out, start = [], 0
    for s in splits:
        out.append(StageChunk(model, s, range(start, start + len(s.layers))))
        start += len(s.layers)
    return out


def stage_shapes(setup, resolved, split: StageSplit) -> tuple[torch.Tensor, torch.Tensor]:
    """The stage's input and output as meta tensors of one micro-batch (PipelineStage's static mode): ids into the
    first stage, the residual stream between stages (its local [mb, seq / tp, hidden] shard under
    --sequence-parallel), the logits (in the compute dtype) out of the last."""
    mb = setup.batch_size // setup.microbatches
    seq = setup.seq_len // (resolved.layout.tp if setup.sequence_parallel else 1)
    hidden = resolved.anatomy.hidden_size
    res = torch.float32 if resolved.regime.res == 4 else getattr(torch, setup.compute_dtype)
    mm = torch.float32 if resolved.regime.mm == 4 else getattr(torch, setup.compute_dtype)
    if split.embedding:
        inp = torch.empty(mb, setup.seq_len, dtype=torch.int64, device="meta")
    else:
        inp = torch.empty(mb, seq, hidden, dtype=res, device="meta", requires_grad=True)
    if split.head:
        out = torch.empty(mb, setup.seq_len, resolved.anatomy.vocab_size, dtype=mm, device="meta",
                          requires_grad=True)
    else:
        out = torch.empty(mb, seq, hidden, dtype=res, device="meta", requires_grad=True)
    return inp, out


@contextlib.contextmanager
def static_warmup() -> Iterator[None]:
    """The warm-up vote's outcome when every stage is given its shapes: STATIC (no peer to vote with)."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import InferenceMode

    def warmup(self, stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    original = schedules._PipelineSchedule._warmup_p2p
    schedules._PipelineSchedule._warmup_p2p = warmup
    try:
        yield
    finally:
        schedules._PipelineSchedule._warmup_p2p = original


class PipelineRunner:
    """The rank's stage(s) and their schedule; `iteration` runs one schedule step (every micro-batch's forward and
    backward of each stage in the schedule's order), then the optimizer step."""

    def __init__(self, step, splits: tuple[StageSplit, ...], mesh) -> None:
        from torch.distributed import pipelining

        setup, lm = step.setup, causal_lm(step.model)
        group = mesh["pp"].get_group() if mesh is not None else None
        if setup.sequence_parallel:      # the stage boundaries' residual stream: its tp shard (boundary_in)
            lm.__dict__["_llmem_sp_mesh"] = mesh["tp"]
        self.step, self.splits = step, splits
        spec = pipeline_schedule(setup.pp_schedule)
        stages = setup.pp * len(splits)
        modules = [step.model] if len(splits) == 1 else stage_chunks(step.model, splits)
        self.stages = []
        for split, module in zip(splits, modules, strict=True):
            inp, out = stage_shapes(setup, step.resolved, split)
            self.stages.append(pipelining.PipelineStage(module, split.index, stages, torch.device("cpu"),
                                                        input_args=(inp,), output_args=(out,), group=group))
        vocab = step.resolved.anatomy.vocab_size

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return lm.loss_function(logits=logits, labels=labels, vocab_size=vocab)

        # torchtitan: scale_grads=False (its loss is already divided by the global token count)
        self.schedule = getattr(pipelining, spec.torch_class)(self.stages if spec.looped else self.stages[0],
                                                              n_microbatches=setup.microbatches,
                                                              loss_fn=loss_fn, scale_grads=False)
        for stage in self.stages:
            self._wrap_stage(stage)

    def _wrap_stage(self, stage) -> None:
        """The ledger's phases follow the schedule's actions; the stage's recv buffers are communication buffers."""
        step = self.step
        region = step.hooks.category
        fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk
        prep_f, prep_b = stage._prepare_forward_infra, stage._prepare_backward_infra

        def forward_one_chunk(*a, **k):
            step._phase("forward", self.it)
            return fwd(*a, **k)

        def backward_one_chunk(*a, **k):
            step._phase("backward", self.it)
            return bwd(*a, **k)

        def prepare_forward(*a, **k):
            with region("communication_buffers"):
                return prep_f(*a, **k)

        def prepare_backward(*a, **k):
            with region("communication_buffers"):
                return prep_b(*a, **k)

        stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
        stage._prepare_forward_infra, stage._prepare_backward_infra = prepare_forward, prepare_backward

    def iteration(self, it: int) -> None:
        step, self.it = self.step, it
        ids = step.input_ids
        ctx = torch.autocast(step.device_type, dtype=step.autocast_dtype) if step.autocast_dtype is not None \
            else contextlib.nullcontext()
        step._phase("forward", it)
        # torchtitan's trainer: return_outputs=False (the last stage keeps no micro-batch's output for merging)
        with ctx, static_warmup():
            if self.splits[0].embedding:         # the first stage takes the ids (pp > 1: never the last)
                self.schedule.step(ids, return_outputs=False)
            elif self.splits[-1].head:           # the last the labels
                self.schedule.step(target=ids, losses=[], return_outputs=False)
            else:
                self.schedule.step(return_outputs=False)
        if step.autocast_policy is not None:
            step.autocast_policy.cache.clear()
        step.optimizer_step(it)


def fresh_sharding_cache() -> None:
    """Forget DTensor's cached sharding propagations (the C++ dispatch fast path's cache and
    ShardingPropagator.propagate_op_sharding's lru_cache) before a trace: their output specs hold an earlier
    trace's DeviceMesh, equal to this one's (DeviceMesh __eq__ compares ranks and layout, not process groups) but
    naming the process groups the earlier fake process group registered (another pipeline rank's under --pp with
    --tp: "Could not resolve the process group")."""
    from torch.distributed.tensor import DTensor

    torch._C._clear_DTensor_sharding_propagator_cache()
    prop = DTensor._op_dispatcher.sharding_propagator
    prop.propagate_op_sharding.cache_clear()
    prop._propagate_tensor_meta_cached.cache_clear()


def stage_row(index: int, result) -> dict:
    return {"stage": index, "peak_allocated_bytes": result.peak_allocated_bytes,
            "peak_reserved_bytes": result.peak_reserved_bytes}
