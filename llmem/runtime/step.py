"""The real fine-tuning step that `trace` and `measure` both run.

One module builds it, so the two engines run the same PyTorch code: the HF model from its config
(llmem.runtime.build), the distributed method through PyTorch's own APIs on a process group of the target world size
(llmem.runtime.distributed), the optimizer as PyTorch runs it on CUDA (llmem.runtime.optimizers), and two
iterations of forward -> loss -> backward -> optimizer.step() -> optimizer.zero_grad(set_to_none=True).

Two ways of materialising the model:
- fake: under `FakeTensorMode`, every parameter is a fake *cpu* tensor (shapes and dtypes only, no memory). A fake
  'cuda' device cannot run backward on the CPU-only torch build (the device's kernels are looked up when backward
  runs), so the CUDA behaviour that matters for memory is emulated on the CPU keys (llmem.runtime.cuda).
- real: real random-initialised tensors on a device (cpu or cuda).

Multi-GPU methods run one rank (rank 0) on a fake process group (`init_process_group("fake", store=FakeStore())`).
Under torchrun (WORLD_SIZE > 1) `measure` uses the real process group.

Every monkey-patch lives in a context manager that restores the original on exit.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmem.errors import LlmemError
from llmem.memory.activations.loss import loss_logits_bytes
from llmem.memory.quant import is_quantised, quant_args, storage_bytes
from llmem.model.resolved import ResolvedSetup, resolve
from llmem.model.vision import frozen_parts
from llmem.runtime.adapter_host_tensors import (
    adapter_index_tensors,
    hold_index_copies,
    materialize_keeping_host_reads,
    offload_base_weights,
    valued_buffers_kept,
)
from llmem.runtime.build import (
    apply_peft,
    cast_frozen,
    causal_lm,
    collect_after_dora,
    enable_checkpointing,
    init_real_weights,
    install_chunked_output,
    install_fused_ce,
    install_model_dtype_loss,
    low_dtype,
    materialize_prompt_tokens,
    meta_model_for,
    packed_position_ids,
    tie_if_needed,
    vocab_size,
)
from llmem.runtime.cuda import CudaAutocastPolicy, cuda_autocast_policy, cuda_like_dropout, cuda_like_sdpa
from llmem.runtime.distributed import (
    apply_method,
    ddp_on_fake_pg,
    device_mesh,
    device_mesh_outside_fake,
    dtensor_propagation_untracked,
    fake_process_group,
)
from llmem.runtime.expert_parallel import apply_expert_parallel, ep_plan
from llmem.runtime.offload import ActivationOffload
from llmem.runtime.optimizers import (
    HostOffloadedOptimizer,
    InBackwardOptimizer,
    make_optimizer,
)
from llmem.runtime.patches import (
    collectives_waited_in_place,
    flash_kernel_attention,
    grouped_mm_meta_any_float,
    hf_untraced_masks,
    quiet,
)
from llmem.runtime.quant_kernels import quantize_base, trainer_adapter_cast, wrap_quant_adapters
from llmem.setup.context_parallel import local_seq_len
from llmem.setup.layout import Layout
from llmem.setup.liger import applied_kernels
from llmem.setup.objectives import casts_quantised_adapters
from llmem.setup.training import TrainingSetup
from llmem.units import format_bytes


@dataclass
class StepHooks:
    """Callbacks the engines plug in. All optional."""
    on_phase: Callable[[str, int], None] | None = None          # (phase, iteration)
    region: Callable[[str | None], contextlib.AbstractContextManager] | None = None  # category override

    def category(self, name: str | None) -> contextlib.AbstractContextManager:
        """The ledger's category for the tensors made inside (`region`'s), a no-op where no engine overrides it."""
        return self.region(name) if self.region is not None else contextlib.nullcontext()


@dataclass
class TrainingStep:
    setup: TrainingSetup
    model: nn.Module            # the HF model (sharded in place under FSDP / TP)
    runner: nn.Module           # what the step calls: the model, or its DDP wrapper
    optimizer: torch.optim.Optimizer | InBackwardOptimizer
    input_ids: torch.Tensor
    resolved: ResolvedSetup     # the set-up as every engine resolves it (layout, GPU, trained anatomy)
    device_type: str
    autocast_dtype: torch.dtype | None
    hooks: StepHooks = field(default_factory=StepHooks)
    autocast_policy: CudaAutocastPolicy | None = None
    offload: ActivationOffload | None = None
    position_ids: torch.Tensor | None = None   # --packing: positions restart at each packed sample
    pipeline: Any = None        # --pp: the stage and its schedule (llmem.runtime.pipeline.PipelineRunner)
    extra_inputs: dict = field(default_factory=dict)   # a vision-language model's images, grid and 3-D positions

    @property
    def layout(self) -> Layout:
        return self.resolved.layout

    def _phase(self, name: str, it: int) -> None:
        if self.hooks.on_phase is not None:
            self.hooks.on_phase(name, it)

    # TRL's trainers on this step (llmem.runtime.objectives, generation): what an engine does its own way
    # (DeepSpeed's: llmem.runtime.deepspeed.ObjectiveOnEngine)
    def prepare_reference(self, ref: nn.Module) -> nn.Module:
        """The reference copy as the trainer holds it (trl's prepare_fsdp already applied): as it is."""
        return ref

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unwrap_for_generation(self) -> contextlib.AbstractContextManager:
        """The model generate runs on (TRL's unwrap_model_for_generation): the model itself."""
        return contextlib.nullcontext(self.model)

    def iteration(self, it: int) -> None:
        if self.pipeline is not None:       # one pipeline stage under torch's schedule (llmem.runtime.pipeline)
            return self.pipeline.iteration(it)
        if self.setup.objective_spec.runs_trainer:   # TRL's trainer step (llmem.runtime.objective_steps)
            from llmem.runtime.objective_steps import objective_iteration

            return objective_iteration(self, it)
        ids = self.input_ids
        self._phase("forward", it)
        if self.autocast_dtype is not None:
            ctx = torch.autocast(self.device_type, dtype=self.autocast_dtype)
        else:
            ctx = contextlib.nullcontext()
        offload = self.offload
        with ctx, (offload.forward() if offload is not None else contextlib.nullcontext()):
            extra = {} if self.position_ids is None else {"position_ids": self.position_ids}
            extra.update(self.extra_inputs)
            labels = extra.pop("labels", ids)     # (a vision batch's own labels where the collator masks tokens)
            loss = self.runner(input_ids=ids, labels=labels, **extra).loss   # the output (and its logits) dies here
        if self.autocast_policy is not None:
            self.autocast_policy.cache.clear()
        self._phase("backward", it)
        loss.backward()
        del loss
        self.optimizer_step(it)

    def optimizer_step(self, it: int) -> None:
        """The step's end, as every trainer runs it: the optimizer's step, then zero_grad(set_to_none=True)."""
        self._phase("optimizer_step", it)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def run(self, iterations: int = 2, progress: Callable[[str], None] | None = None) -> None:
        for it in range(iterations):
            if progress:
                progress(f"iteration {it + 1}/{iterations}")
            self.iteration(it)


def check_iterations(iterations) -> None:
    """trace and measure run whole steps: at least one (with none, the result would be the weights alone)."""
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise LlmemError(f"iterations must be a whole number >= 1, got {iterations!r}: the memory of a step is "
                         "measured by running it (2 by default: the second one holds the optimizer states)")


def host_memory_bytes() -> int:
    """This host's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_bytes_bound() -> int:
    """What trace and measure may allocate for real on the host: half its physical memory."""
    return host_memory_bytes() // 2


def real_host_bytes(resolved: ResolvedSetup, fake: bool, device_type: str) -> tuple[int, str]:
    """The bytes the step allocates for real on the host (at least), and what they are. peft initialises its
    adapters on the host before moving them to the base layer's device (meta here), also under the trace's fake
    tensors; a measure on the CPU holds the whole model, its gradients and the step's logits there too."""
    base = {p.name for p in resolved.base.params}
    added = [p for p in resolved.anatomy.params if p.name not in base]
    adapters = sum(p.own_bytes for p in added)
    if fake or device_type != "cpu":
        return adapters, "peft's adapters, initialised on the host"
    setup = resolved.setup
    low = setup.precision_spec.low_precision
    trained = 2 if low and not setup.mixed else 4          # fp32 master weights unless pure bf16 / fp16
    frozen = 2 if low else 4                # the frozen base's storage, unless quantised
    args = quant_args(setup, False)
    params = sum(p.numel * trained if p.trainable else
                 storage_bytes(p, setup.quant_base, args) if is_quantised(p, setup.quant_base) else p.numel * frozen
                 for p in resolved.anatomy.params)
    grads = sum(p.numel * trained for p in resolved.anatomy.params if p.trainable)
    # the loss's logits, [batch, seq, vocab] in the loss's dtype at least once (none under --fused-ce)
    logits = 0 if setup.fused_ce else \
        setup.batch_size * setup.seq_len * resolved.anatomy.vocab_size * loss_logits_bytes(setup, resolved.regime)
    method = resolved.method
    shards = resolved.layout.world_size if method.shards_model_states or method.has_tp else 1   # local shards only
    return max(adapters, int(params + grads) // shards + logits), "the model's weights and gradients and the logits"


def check_host_bytes(resolved: ResolvedSetup, fake: bool, device_type: str) -> None:
    """Refuse, before anything is built, a step that would allocate more than the bound on the host."""
    need, what = real_host_bytes(resolved, fake, device_type)
    bound = host_bytes_bound()
    if need > bound:
        engine = "trace" if fake else f"measure on {device_type}"
        raise LlmemError(f"{engine} would allocate {format_bytes(need)} for real on the host ({what}), over the "
                         f"bound of {format_bytes(bound)} (half this host's memory): use a smaller --lora-rank or "
                         "model, or llmem estimate (nothing allocated)")


def meta_model_stage(setup: TrainingSetup, resolved: ResolvedSetup, fake: bool, pp_rank: int):
    """The model on the meta device: its pipeline stage, its dtype, quantised base, adapters. (model, split, low)"""
    with quiet():
        model = meta_model_for(setup)
    split = None
    if resolved.layout.pp > 1:        # one pipeline stage of the model (llmem.runtime.pipeline)
        from llmem.runtime.pipeline import split_model, stage_split

        split = stage_split(setup, resolved.anatomy.num_layers, pp_rank)
        split_model(model, split)
    low = low_dtype(setup)
    if setup.precision_spec.low_precision and not setup.mixed:
        model.to(low)                 # still on meta: dtype only
    if setup.quant_spec.quantised:    # the libraries' quantised linears, emulated (llmem.runtime.quant_kernels)
        quantize_base(model, setup, fake=fake)
    if setup.peft:
        model = apply_peft(model, setup)
    if frozen_parts(setup):           # a vision-language model's frozen parts (llmem.runtime.vision)
        from llmem.runtime.vision import freeze_parts

        freeze_parts(causal_lm(model), setup)
        cast_frozen(model, setup)
    if setup.quant_spec.quantised:
        wrap_quant_adapters(model, setup)
    if casts_quantised_adapters(setup):   # TRL's trainer __init__: the adapters of a bitsandbytes model in bf16
        trainer_adapter_cast(model)
    return model, split, low


def _enter_process_group(stack: contextlib.ExitStack, layout: Layout, fake: bool, on_cuda: bool,
                         pp_rank: int) -> bool:
    """torchrun's real process group (measure, WORLD_SIZE > 1) or the fake one; whether it is real."""
    import torch.distributed as dist
    env_ws = int(os.environ.get("WORLD_SIZE", "1"))
    if not fake and env_ws > 1:
        if env_ws != layout.world_size:
            raise LlmemError(f"torchrun started {env_ws} processes but the setup needs {layout.world_size}")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if on_cuda else "gloo")
            stack.callback(dist.destroy_process_group)
        return True
    stack.enter_context(fake_process_group(layout.world_size, pp_rank * (layout.world_size // layout.pp)))
    return False


def _enter_kernels(stack: contextlib.ExitStack, setup: TrainingSetup, resolved: ResolvedSetup, fake: bool,
                   on_cuda: bool, cuda_kernels: bool, autocast_dtype) -> CudaAutocastPolicy | None:
    """CUDA's autocast, dropout and SDPA kernels emulated on the CPU, or the flash kernel on a real GPU; the
    autocast policy (None where not emulated)."""
    policy = None
    if not on_cuda:
        if autocast_dtype is not None:
            policy = stack.enter_context(cuda_autocast_policy())
        stack.enter_context(cuda_like_dropout())
        if fake and cuda_kernels:
            stack.enter_context(cuda_like_sdpa(resolved.gpu.compute_capability,
                                               "flash" if setup.attention_spec.flash_kernel else None))
    elif setup.attention_spec.flash_kernel:   # a real GPU: PyTorch's flash SDPA kernel only
        from torch.nn.attention import SDPBackend, sdpa_kernel
        stack.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION]))
    return policy


def _enter_parallelism(stack: contextlib.ExitStack, model: nn.Module, setup: TrainingSetup, layout: Layout,
                       spec, device: torch.device, fake: bool, sharded: bool, real_pg: bool):
    """The device mesh, expert parallelism, ring attention, loss_parallel and DDP on the fake group; the mesh."""
    mesh = None
    if sharded:
        stack.enter_context(dtensor_propagation_untracked())
        stack.enter_context(device_mesh_outside_fake())
        mesh = device_mesh(layout, device.type)
    ep = ep_plan(layout, setup, device.type)     # --ep (or the learning copy's): llmem.runtime.expert_parallel
    if ep is not None:
        apply_expert_parallel(model, ep, fake)
        if ep.ep_mesh is not None:
            stack.enter_context(collectives_waited_in_place())
    if layout.cp > 1:     # torch's ring attention on the cp dimension (llmem.runtime.context_parallel)
        from llmem.runtime.context_parallel import ring_attention
        stack.enter_context(ring_attention(mesh["cp"], fake))
    if setup.loss_parallel:   # HF's cross_entropy on the vocab-sharded logits, its backward too (torchtitan)
        from torch.distributed.tensor.parallel import loss_parallel
        stack.enter_context(loss_parallel())
    if spec.gradient_buckets and not real_pg:
        stack.enter_context(ddp_on_fake_pg())
    return mesh


def _enter_fake_mode(stack: contextlib.ExitStack, setup: TrainingSetup, fake: bool, fake_mode, model: nn.Module,
                     images) -> None:
    """The packing check, then (fake) HF's masks untraced, grouped_mm's meta kernel and the caller's fake mode, and
    inside it a vision-language batch's image-mask counts (llmem.runtime.vision.image_mask_counts)."""
    packing = setup.packing
    if packing and setup.attention_spec.varlen_packing and not fake:
        raise LlmemError("--packing with --attn flash needs the flash-attn package's varlen kernel (HF "
                         "flash_attention_2); llmem models it but cannot run it")
    if fake:
        # flash attention packs through cu_seqlens (varlen kernel, no mask): the same saved tensors as unpacked
        # rows, so the traced flash step gets no packed mask
        stack.enter_context(hf_untraced_masks(packed=packing and not setup.attention_spec.varlen_packing))
        stack.enter_context(grouped_mm_meta_any_float())
        stack.enter_context(fake_mode)
        stack.enter_context(adapter_index_tensors(fake_mode, model))   # FourierFT's / WaveFT's / SHiRA's indices
        if images is not None:
            from llmem.runtime.vision import image_mask_counts
            stack.enter_context(image_mask_counts(causal_lm(model), images))


def _materialised_runner(stack: contextlib.ExitStack, model: nn.Module, setup: TrainingSetup, layout: Layout,
                         mesh, region, device: torch.device, fake: bool, sharded: bool, real_pg: bool):
    """The model's parameters allocated (fake cpu, or real on `device`) and the method applied; the runner."""
    if fake:
        materialize_keeping_host_reads(model)     # FRoD's sparse sizes stay real (read on the host)
        offload_base_weights(model, region)       # FRoD's runtime_offload_base_weight: on the host
        if setup.float8_all_gather:     # torchao's float8 weights for FSDP2 (llmem.runtime.float8)
            from llmem.runtime.float8 import rewrap_float8_weights
            rewrap_float8_weights(model)
        materialize_prompt_tokens(model, "cpu")
        hold_index_copies(model, stack)       # FourierFT's / WaveFT's / SHiRA's index tensors on the device
        collect_after_dora(model, stack)
        return apply_method(model, layout, mesh, setup, region, fake_pg=True)
    if sharded:   # shard on meta, then allocate only the local shards
        apply_method(model, layout, mesh, setup, region, fake_pg=not real_pg)
    with warnings.catch_warnings(), valued_buffers_kept(model):     # FRoD's sparse S: peft's positions
        warnings.simplefilter("ignore")
        model.to_empty(device=device)
    tie_if_needed(model)
    init_real_weights(model)
    collect_after_dora(model, stack)       # measure's tracker makes the same cycle as fake tensors
    runner = model
    if not sharded:
        runner = apply_method(model, layout, mesh, setup, region, fake_pg=not real_pg)
    return runner


def _optimizer(model: nn.Module, setup: TrainingSetup, hooks: StepHooks, fake: bool):
    if setup.optimizer_in_backward:
        return InBackwardOptimizer(model, setup.optimizer, hooks.region)
    if setup.steps_on_host and fake:
        return HostOffloadedOptimizer(model, setup.optimizer)
    return make_optimizer(model, setup.optimizer)


def _inputs(model: nn.Module, setup: TrainingSetup, layout: Layout, device: torch.device, fake: bool):
    """The rank's random token ids and, with --packing, the packed rows' position ids."""
    seq = local_seq_len(setup.seq_len, layout.cp)      # the rank's tokens under --cp (seq_len without)
    ids = torch.randint(0, vocab_size(model), (setup.batch_size, seq), dtype=torch.int64,
                        device="cpu" if fake else device)
    positions = packed_position_ids(setup.batch_size, setup.seq_len, ids.device) if setup.packing else None
    return ids, positions


def _step_inputs(model: nn.Module, setup: TrainingSetup, layout: Layout, device: torch.device, fake: bool, images):
    """(token ids, packed position ids, the forward's other inputs): a vision-language model's from its batch."""
    if images is None:
        return *_inputs(model, setup, layout, device, fake), {}
    from llmem.runtime.vision import model_inputs

    ids, extra = model_inputs(images, None if fake else device)
    return ids, None, extra


def _vision_batch(stack: contextlib.ExitStack, model: nn.Module, setup: TrainingSetup, resolved: ResolvedSetup,
                  fake_mode):
    """A vision-language model's micro-batch (real ids, grid, 3-D positions: llmem.runtime.vision), built before
    the fake mode with its index values answered inside it; None for a text model."""
    from llmem.model.vision_inputs import vision_inputs

    inputs = vision_inputs(setup, resolved.base)
    if inputs is None:
        return None
    from llmem.runtime.vision import known_vision_values, vision_batch

    batch = vision_batch(causal_lm(model), setup.batch_size, inputs)
    if fake_mode is not None:       # (a real step reads its index values itself)
        stack.enter_context(known_vision_values(causal_lm(model), batch, fake_mode))
    return batch


def _activation_offload(model: nn.Module, setup: TrainingSetup) -> ActivationOffload | None:
    if not setup.offload_activations:
        return None
    lm = causal_lm(model)
    return ActivationOffload(lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None)


def _install_loss(model: nn.Module, setup: TrainingSetup, fake: bool) -> None:
    """The loss as the set-up computes it, where it is not transformers' on full fp32 logits: the fused linear
    cross-entropy, the loss on the logits' own dtype, or torchtune's chunked output (llmem.runtime.build)."""
    if setup.fused_ce:
        install_fused_ce(model)
    if setup.logits_dtype == "model":
        install_model_dtype_loss(model)
    if setup.output_chunks:
        install_chunked_output(model, setup.output_chunks, compiled=setup.compile, fake=fake)


@contextlib.contextmanager
def prepared_step(setup, *, fake: bool, device: str | torch.device = "cpu", cuda_kernels: bool = True,
                  fake_mode=None, hooks: StepHooks | None = None,
                  before_model: Callable[[], None] | None = None,
                  progress: Callable[[str], None] | None = None, pp_rank: int = 0,
                  vision_checkpointing: bool = False) -> Iterator[TrainingStep]:
    """Set up (patches, process group, model, method, optimizer, inputs), yield the step, tear down on exit.

    fake: materialise under `fake_mode` (a FakeTensorMode the caller owns; entered here) on the fake cpu device.
    cuda_kernels: with fake tensors, run the ops of CUDA's fused SDPA kernels (their meta kernels); real CPU cannot.
    before_model: called once the fake mode is entered, before any parameter exists (trackers start there).
    pp_rank: under --pp, the pipeline rank whose stage runs (rank pp_rank x world / pp of the fake process
    group: the pp dimension outermost).
    vision_checkpointing: transformers' checkpointing of a vision-language model's encoder blocks alone (its
    decoder layers not), with the input embeddings' hooks it sets (llmem.learn: the vision side under --grad-ckpt).
    """
    hooks = hooks or StepHooks()
    device = torch.device(device)
    say = progress or (lambda msg: None)
    # resolved and checked as the estimate checks it (the support tables with the model's facts, the pipeline's row
    # included), before anything is built: what the estimate refuses, the step refuses in the same line
    resolved = resolve(setup)
    if setup.pp > 1 and not fake:
        raise LlmemError("--pp is traced, not measured: torch's schedule needs its peers' P2P (use llmem trace)")
    check_host_bytes(resolved, fake, device.type)
    layout, spec = resolved.layout, resolved.method

    model, split, low = meta_model_stage(setup, resolved, fake, pp_rank)
    autocast_dtype = low if (setup.mixed and spec.autocast_under_mixed) else None
    on_cuda = device.type == "cuda"
    sharded = spec.shards_model_states or spec.has_tp

    with contextlib.ExitStack() as stack:
        stack.enter_context(quiet())
        stack.enter_context(flash_kernel_attention())   # the step's attention, where --attn flash needs it
        real_pg = False
        if not spec.one_gpu or layout.pp > 1:
            real_pg = _enter_process_group(stack, layout, fake, on_cuda, pp_rank)
        policy = _enter_kernels(stack, setup, resolved, fake, on_cuda, cuda_kernels, autocast_dtype)
        mesh = _enter_parallelism(stack, model, setup, layout, spec, device, fake, sharded, real_pg)
        images = _vision_batch(stack, model, setup, resolved, fake_mode)
        _enter_fake_mode(stack, setup, fake, fake_mode, model, images)
        if before_model is not None:
            before_model()

        if setup.grad_ckpt or vision_checkpointing:    # (llmem.learn: a vision-language encoder's alone)
            enable_checkpointing(model, setup.ckpt_every, setup.ac_policy, encoder_only=not setup.grad_ckpt,
                                 reentrant=setup.ckpt_reentrant)
        if setup.ckpt_offload_spec.active:               # Unsloth's Functions (llmem.runtime.unsloth_ckpt)
            from llmem.runtime.unsloth_ckpt import install_ckpt_offload
            install_ckpt_offload(model, setup.ckpt_offload)
        _install_loss(model, setup, fake)
        kernels = applied_kernels(setup.liger, resolved.anatomy.model_type)
        if kernels:       # Liger-Kernel's Functions over HF's modules (llmem.runtime.liger)
            from llmem.runtime.liger import install_liger, liger_rope
            install_liger(causal_lm(model), kernels)
            if "rope" in kernels:
                stack.enter_context(liger_rope(resolved.anatomy.model_type))

        if setup.float8 != "none":   # torchao's Float8Linear, before FSDP2 shards it (llmem.runtime.float8)
            from llmem.runtime.float8 import install_float8
            install_float8(causal_lm(model), setup.float8, setup.float8_all_gather)
        if setup.compile:    # after checkpointing, as torchtune and torchtitan compile (llmem.runtime.compile)
            from llmem.runtime.compile import compile_layers
            stack.enter_context(compile_layers(model, fake))

        say("materialising the model")
        runner = _materialised_runner(stack, model, setup, layout, mesh, hooks.category, device, fake, sharded,
                                      real_pg)
        optimizer = _optimizer(model, setup, hooks, fake)
        ids, positions, extra = _step_inputs(model, setup, layout, device, fake, images)
        offload = _activation_offload(model, setup)
        step = TrainingStep(setup, model, runner, optimizer, ids, resolved, "cpu" if fake else device.type,
                            autocast_dtype, hooks, policy, offload, positions, extra_inputs=extra)
        if split is not None:
            from llmem.runtime.pipeline import PipelineRunner

            step.pipeline = PipelineRunner(step, split, mesh)
        say("running the step")
        yield step
