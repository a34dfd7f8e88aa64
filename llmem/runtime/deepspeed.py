"""DeepSpeed on the runtime floor: its own engine runs the traced step on fake tensors.

`llmem trace` under ds-zero1/2/3: DeepSpeed's own engine (deepspeed.initialize) runs the step, with the ZeRO
optimizer of the set-up's stage, on fake tensors, rank 0 of the layout on a fake process group.

The step is HF Trainer's under DeepSpeed: the model (fp32, as loaded), the set-up's torch optimizer over its trainable
parameters (make_optimizer, passed as `optimizer=`), and a config built from the set-up (bf16 / fp16 / none, its
`zero_optimization` block from llmem.setup.deepspeed, HF's gradient_clipping 1.0 and zero_allow_untested_optimizer);
each iteration is `loss = engine(input_ids=ids, labels=ids).loss; engine.backward(loss); engine.step()` (a
vision-language model's forward also takes the processor's pixel values, grid and positions: prepared_step's
extra_inputs, llmem.runtime.vision). The model,
the gradient checkpointing, peft and the CUDA kernels' emulation (fused SDPA, dropout mask) are prepared_step's.

A TRL objective (--objective dpo / kto / orpo / simpo / reward) runs TRL's own loss (llmem.runtime.objective_steps)
with the engine as the model it calls, `engine.backward(loss)` and `engine.step()` (ObjectiveOnEngine); its trainer
__init__'s part (fused heads, the batch, the reference) comes before deepspeed.initialize, as TRL's trainers run it
before Trainer.train prepares the model; the reference goes through TRL's own prepare_deepspeed (prepare_reference:
stage 0 under ZeRO-1/2, its own ZeRO-3 engine under stage 3). GRPO / RLOO (llmem.runtime.generation) generate through
TRL's own unwrap_model_for_generation on the engine (ObjectiveOnEngine.unwrap_for_generation: ZeRO-3's
GatheredParameters over the whole policy, its hooks removed and re-added). transformers' HfDeepSpeedConfig is set for the steps
(hf_deepspeed_config), as TrainingArguments sets it, so TRL's fused head gathers the ZeRO-3 lm_head itself.

DeepSpeed's code runs unchanged on fake tensors but for these named patches (deepspeed_patches):
- deepspeed.comm.torch.build_shm_op returns None: the optional ShareMemCommBuilder op (JIT-built for minutes on its
  first use) is for CPU all-reduce between processes; the fake process group has none.
- scalar reads of fake tensors return 0: the overflow flag (stage_1_and_2.py has_overflow `overflow_gpu[0].item()`,
  runtime/utils.py is_invalid_grad_norm `bool(...)`) reads "no overflow", so every step runs as a finite one does.
  Reads the fake mode can answer (constants: AdamW's step counts) keep their values.
- zero/utils.py assert_ints_same_as_other_ranks does nothing: it broadcasts rank 0's list of ids and compares it
  with the data read back (ZeRO-3's partitioned_param_coordinator.py reset_step); one emulated rank agrees with
  itself.
- torch.nn.functional.linear is put back after the run: ZeRO-3 replaces it with its own and does not restore it.
- the engine's `module.to(device)` (engine.py _configure_distributed_model) is a no-op: the parameters are already
  on the engine's device, and Module._apply swaps fake parameters (torch.utils.swap_tensors refuses them).

DeepSpeed's accelerator is its CPU_Accelerator (DS_ACCELERATOR=cpu, swapped in where DeepSpeed chose CUDA before);
where that changes memory the CUDA behaviour is emulated or noted:
- available_memory() answers the GPU's memory less the live tensors, as on CUDA (stage_1_and_2.py: a flat buffer is
  built on the device when it fits, else the parameters go through the host first).
- is_fp16_supported() answers True, as on CUDA (the CPU answers from oneDNN's fp16 support, and engine.py
  refuses an fp16 config where it is False).
- streams: is_synchronized_device() is True on the CPU, so ZeRO's side streams (stage 1/2 overlap_comm's reduction
  stream, stage 3's all-gather and reduce-and-partition streams) are None and every allocation is on one stream
  (not emulated: the allocator replay sees one pool; record_stream's delayed reuse is not modelled either).
- empty_cache() does nothing on the CPU: DeepSpeed calls it while it builds the flat buffers (the setup, whose
  history the ledger folds into what is live at the first forward) and when it loads checkpoints, not in the step.
- pin_memory only matters to offloading, which the trace refuses (the host and the device are one here).

The ledger skips meta tensors (stage_1_and_2.py keeps `torch.zeros_like(param, device="meta")` shapes of every
parameter, round_robin_bit16_meta): they hold no memory.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from llmem.errors import LlmemError
from llmem.memory.activations.profile import activation_notes
from llmem.model.families import text_config
from llmem.model.vision_inputs import vision_inputs
from llmem.result import MemoryResult, phase_over
from llmem.runtime.ds_saving import ds_save_job_phase, ds_save_traced, run_ds_save
from llmem.runtime.ledger import Ledger, StepRoles, TracingFakeMode, tracking
from llmem.runtime.patches import patched
from llmem.runtime.replay import TraceDetails, build_result, replay_ledger, trace_details
from llmem.runtime.step import StepHooks, TrainingStep, check_iterations, prepared_step
from llmem.setup.deepspeed import reference_engine_note, zero_config
from llmem.setup.gpus import outside_allocator_bytes, resolve_gpu
from llmem.setup.methods import method_spec
from llmem.setup.objectives import REF_COPY, objective_spec, reference_mode
from llmem.setup.training import TrainingSetup

# HF Trainer's TrainingArguments.max_grad_norm, which it writes as the config's gradient_clipping
HF_GRADIENT_CLIPPING = 1.0
# the environment DeepSpeed reads for rank 0 (the process group itself is the fake one, already initialised)
RANK_ENV = {"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
# deepspeed.utils.groups' caches of process groups, dropped when the fake process group goes
GROUP_CACHES = ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP",
                "_TENSOR_MODEL_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS",
                "_EXPERT_DATA_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP", "mpu",
                "mesh_device")


def check_deepspeed_setup(setup: TrainingSetup) -> None:
    """What the DeepSpeed trace cannot run, refused before anything is built (the rest: llmem.setup.support)."""
    if setup.offload_optimizer or setup.offload_param:
        raise LlmemError("trace of ds-zero with offload_optimizer / offload_param: DeepSpeed's accelerator here is the "
                         "CPU, so its host copies and its device tensors cannot be told apart; use llmem estimate")
    if importlib.util.find_spec("deepspeed") is None:
        raise LlmemError("trace of a ds-zero method runs DeepSpeed's engine: pip install deepspeed")


def engine_config(setup: TrainingSetup, stage: int, hidden_size: int, dp: int) -> dict:
    """The config deepspeed.initialize gets, as HF Trainer fills it for this set-up: the micro batch, no gradient
    accumulation, bf16 or fp16 (DeepSpeed's dynamic loss scaler) from the compute dtype, the ZeRO block."""
    cfg: dict = {"train_micro_batch_size_per_gpu": setup.batch_size, "gradient_accumulation_steps": 1,
                 "train_batch_size": setup.batch_size * dp, "gradient_clipping": HF_GRADIENT_CLIPPING,
                 "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 62, "wall_clock_breakdown": False,
                 "zero_optimization": zero_config(setup, stage, hidden_size).to_json()}
    compute = setup.precision_spec.compute_dtype
    if compute == "bfloat16":
        cfg["bf16"] = {"enabled": True}
    elif compute == "float16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0}
    return cfg


@contextlib.contextmanager
def ds_environment(world_size: int) -> Iterator[None]:
    """RANK_ENV, the world size, and DS_ACCELERATOR=cpu (DeepSpeed's CPU accelerator, without its detection)."""
    values = {**RANK_ENV, "WORLD_SIZE": str(world_size), "DS_ACCELERATOR": "cpu"}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def hf_deepspeed_config(setup: TrainingSetup, stage: int, hidden_size: int, dp: int) -> Iterator[None]:
    """transformers' HfDeepSpeedConfig for the steps (the models are built before: llmem does not load them through
    from_pretrained's zero.Init), as TrainingArguments sets it when given a DeepSpeed config: its
    is_deepspeed_zero3_enabled() is what TRL reads (trl/trainer/utils.py maybe_gather_lm_head_ctx: the fused head
    gathers the ZeRO-3 lm_head with GatheredParameters around its forward and its backward); unset after."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    config = HfDeepSpeedConfig(engine_config(setup, stage, hidden_size, dp))
    try:
        yield
    finally:
        del config
        unset_hf_deepspeed_config()


_CPU_ACCELERATOR: list = []     # the one CPU_Accelerator this process swaps in where DeepSpeed found a GPU


@contextlib.contextmanager
def cpu_accelerator() -> Iterator[object]:
    """DeepSpeed's CPU accelerator for the run, also on a machine with a GPU (the fake tensors are cpu tensors);
    an accelerator DeepSpeed had chosen before (CUDA) is restored after."""
    from deepspeed.accelerator import real_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    saved = real_accelerator.get_accelerator()
    if not isinstance(saved, CPU_Accelerator):
        if not _CPU_ACCELERATOR:
            _CPU_ACCELERATOR.append(CPU_Accelerator())
        real_accelerator.ds_accelerator = _CPU_ACCELERATOR[0]
    try:
        yield real_accelerator.ds_accelerator
    finally:
        real_accelerator.ds_accelerator = saved


@contextlib.contextmanager
def fresh_comm_state() -> Iterator[None]:
    """deepspeed.comm keeps its backend (cdb) and deepspeed.utils.groups its process groups in module globals: each
    run starts without them and leaves none behind (the fake process group they refer to is destroyed)."""
    from deepspeed.comm import comm
    from deepspeed.utils import groups

    saved = {name: getattr(groups, name) for name in GROUP_CACHES if hasattr(groups, name)}
    fresh = {name: (type(v)() if isinstance(v, dict) else None) for name, v in saved.items()}
    cdb = comm.cdb
    comm.cdb = None
    for name, value in fresh.items():
        setattr(groups, name, value)
    try:
        yield
    finally:
        comm.cdb = cdb
        for name, value in saved.items():
            setattr(groups, name, value)


@contextlib.contextmanager
def _fake_scalar_reads_zero() -> Iterator[None]:
    """`.item()` / `bool()` of a fake tensor whose value the fake mode does not know reads 0 (False)."""
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import DataDependentOutputException

    table = fake_impls.op_implementations_dict
    ops = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)
    saved = {op: table[op] for op in ops}

    def read(fake_mode, func, arg):
        try:
            return saved[func](fake_mode, func, arg)
        except DataDependentOutputException:
            return False if arg.dtype == torch.bool else (0.0 if arg.is_floating_point() else 0)

    table.update(dict.fromkeys(ops, read))
    try:
        yield
    finally:
        table.update(saved)


@contextlib.contextmanager
def deepspeed_patches(ledger: Ledger, accelerator, gpu_memory_bytes: int, fake: bool) -> Iterator[None]:
    """The patches of this module's docstring, on DeepSpeed's CPU `accelerator`; restored on exit."""

    def available_memory(device_index=None) -> int:      # torch.cuda.mem_get_info's free bytes
        return max(0, gpu_memory_bytes - sum(ledger.live.values()))

    track = ledger.track

    def track_on_device(t: torch.Tensor) -> None:      # meta tensors hold no memory
        if t.device.type != "meta":
            track(t)

    with contextlib.ExitStack() as stack:
        # ZeRO-3 replaces torch.nn.functional.linear with its own (zero/linear.py zero3_linear_wrap, through
        # partition_parameters' Init) and leaves it there: put the original back, or every later step in the process
        # would run DeepSpeed's linear
        stack.enter_context(patched(torch.nn.functional, "linear", torch.nn.functional.linear))
        stack.enter_context(patched(ledger, "track", track_on_device))
        stack.enter_context(patched(sys.modules["deepspeed.comm.torch"], "build_shm_op", lambda: None))
        stack.enter_context(patched(accelerator, "available_memory", available_memory))
        stack.enter_context(patched(accelerator, "is_fp16_supported", lambda: True))    # as CUDA answers
        if fake:
            stack.enter_context(_fake_scalar_reads_zero())
            for name in ("partitioned_param_coordinator", "stage3", "partition_parameters"):
                module = importlib.import_module(f"deepspeed.runtime.zero.{name}")
                stack.enter_context(patched(module, "assert_ints_same_as_other_ranks", lambda ints: None))
        yield


@dataclass
class EngineStep:
    """What StepRoles reads of a step (the model, the set-up, the optimizer's states, the inputs) for DeepSpeed's
    engine; `optimizer` is the torch optimizer ZeRO steps (its states are over the flat fp32 partitions)."""
    setup: TrainingSetup
    model: nn.Module
    optimizer: torch.optim.Optimizer
    input_ids: torch.Tensor
    engine: object
    zero: object          # the ZeRO optimizer (DeepSpeedZeroOptimizer or DeepSpeedZeroOptimizer_Stage3)
    extra_inputs: dict = field(default_factory=dict)   # a VLM's images (llmem.runtime.vision), as the step hands them


def _tensors(*values) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            out += _tensors(*v.values())
        elif isinstance(v, (list, tuple)):
            out += _tensors(*v)
    return out


def zero_buffers(zero) -> dict[str, list[torch.Tensor]]:
    """DeepSpeed's own buffers by component (attribute names of stage_1_and_2.py / stage3.py)."""
    get = lambda name: getattr(zero, name, None)  # noqa: E731
    stage3 = f"_{type(zero).__name__}__"
    fp32 = _tensors(get("single_partition_of_fp32_groups"), get("fp32_partitioned_groups_flat"))
    buckets = [b.buffer for b in (get("ipg_buckets") or {}).values()]
    return {
        "weights": _tensors(get("bit16_groups_flat"), get("fp16_partitioned_groups_flat"), fp32),
        "gradients": _tensors(get("grads_in_partition"), get("averaged_gradients"),
                              get("grad_partitions_flat_buffer"), [t.grad for t in fp32]),
        "communication_buffers": _tensors(buckets, get(stage3 + "ipg_bucket_flat_buffer")),
    }


class EngineRoles(StepRoles):
    """StepRoles over DeepSpeed's engine: its buffers relabelled by zero_buffers at each phase and at the end; the
    fp32 gradient partitions ZeRO builds for the step are gradients; ZeRO-3's gathered parameters and its
    gradient reductions are labelled where they are allocated."""

    def label_buffers(self) -> None:
        for category, tensors in zero_buffers(self.step.zero).items():
            self.ledger.relabel(tensors, category)

    def on_phase(self, phase: str, it: int) -> None:
        super().on_phase(phase, it)
        self.label_buffers()

    def finish(self) -> None:
        super().finish()
        self.label_buffers()


@contextlib.contextmanager
def labelled_regions(ledger: Ledger, roles: EngineRoles, zero) -> Iterator[None]:
    """Regions around DeepSpeed's methods that allocate what the default categories would misname: ZeRO-3's
    parameter fetch (gathered_weights), the IPG buffers and the gradient reductions (communication_buffers); each
    parameter's autograd gradient is relabelled a gradient when ZeRO takes it, and the fp32 gradient partition
    before the optimizer step of its partition."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc

    def in_region(obj, name: str, category: str):
        fn = getattr(obj, name)

        def wrapper(*args, **kwargs):
            with ledger.region(category):
                return fn(*args, **kwargs)
        return patched(obj, name, wrapper)

    def step_partition(fn):
        def wrapper(*args, **kwargs):
            roles.label_buffers()
            return fn(*args, **kwargs)
        return wrapper

    def reduce_param(fn):
        def wrapper(param, *args, **kwargs):     # the parameter's .grad as autograd left it, before ZeRO moves it
            ledger.relabel([param.grad], "gradients")
            return fn(param, *args, **kwargs)
        return wrapper

    with contextlib.ExitStack() as stack:
        stack.enter_context(in_region(ppc.PartitionedParameterCoordinator, "fetch_sub_module", "gathered_weights"))
        for name in ("setup_buckets", "reduce_ipg_grads",
                     "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"):
            if hasattr(zero, name):
                stack.enter_context(in_region(zero, name, "communication_buffers"))
        stack.enter_context(patched(zero, "_optimizer_step", step_partition(zero._optimizer_step)))
        stack.enter_context(patched(zero, "reduce_ready_partitions_and_remove_grads",
                                    reduce_param(zero.reduce_ready_partitions_and_remove_grads)))
        yield


def run_engine(step: EngineStep, extra: dict, offload, iterations: int, phase: Callable[[str, int], None],
               say: Callable[[str], None]) -> None:
    """HF Trainer's training_step under DeepSpeed: forward (the loss), engine.backward, engine.step (which zeroes
    the gradients). `offload`: --offload-activations' saved-tensor hooks around the forward (or None)."""
    engine, ids = step.engine, step.input_ids
    extra = dict(extra)
    labels = extra.pop("labels", ids)      # (a vision batch's own labels where the collator masks tokens)
    for it in range(iterations):
        say(f"iteration {it + 1}/{iterations}")
        phase("forward", it)
        with offload.forward() if offload is not None else contextlib.nullcontext():
            loss = engine(input_ids=ids, labels=labels, **extra).loss
        phase("backward", it)
        engine.backward(loss)
        del loss
        phase("optimizer_step", it)
        engine.step()


def prepare_reference(ref: nn.Module, step: TrainingStep):
    """TRL's own prepare_deepspeed (trl/models/utils.py) on the reference, with the policy's config as accelerate's
    DeepSpeed plugin holds it: an engine without optimizer; ZeRO-3 partitions the copy (DeepSpeedZeRoOffload,
    gathering per module in its forward), stages 1-2 become stage 0 (the whole copy, cast to bf16 / fp16 by the
    engine, on every rank)."""
    import types

    from trl.models.utils import prepare_deepspeed

    setup = step.setup
    cfg = engine_config(setup, method_spec(setup.method).zero_stage, text_config(ref.config).hidden_size,
                        step.layout.dp)
    plugin = types.SimpleNamespace(deepspeed_config=cfg)
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=plugin))
    with patched(ref, "to", lambda *a, **k: ref):        # already on the engine's device
        return prepare_deepspeed(ref, accelerator)


class ObjectiveOnEngine:
    """A TRL objective's step (llmem.runtime.objective_steps) over DeepSpeed's engine: the prepared step's fields,
    the engine as what the trainer's loss calls, engine.backward for the loss's backward and engine.step (which
    zeroes the gradients) for the optimizer's, as HF Trainer's training_step runs them under DeepSpeed."""

    def __init__(self, prepared: TrainingStep) -> None:
        self.__dict__.update({f: getattr(prepared, f) for f in prepared.__dataclass_fields__})
        self._prepared = prepared
        self.engine = None

    @property
    def layout(self):
        return self.resolved.layout

    def _phase(self, name: str, it: int) -> None:
        self._prepared._phase(name, it)

    def prepare_reference(self, ref: nn.Module):
        return prepare_reference(ref, self)

    def bind(self, engine) -> None:
        self.engine, self.runner = engine, engine

    def backward(self, loss) -> None:
        """DeepSpeed's engine.backward (its ZeRO reduce hooks and loss scaling), as TRL's Trainer calls it."""
        self.engine.backward(loss)

    def unwrap_for_generation(self):
        """TRL's own unwrap_model_for_generation (trl/models/utils.py) on the engine, as GRPOTrainer's and
        RLOOTrainer's `_generate_single_turn` call it (ds3_gather_for_generation True, GRPOConfig's default): under
        ZeRO-3 deepspeed.zero.GatheredParameters over all the engine's parameters for the whole generate (the full
        model on this rank in the engine's dtype) with the coordinator's hooks removed, re-added after
        (remove_hooks / add_hooks, which invalidates its trace); under stages 1-2 the engine's module as it is."""
        import types

        from trl.models.utils import unwrap_model_for_generation

        stage = method_spec(self.setup.method).zero_stage
        accelerator = types.SimpleNamespace(
            state=types.SimpleNamespace(deepspeed_plugin=types.SimpleNamespace(zero_stage=stage), fsdp_plugin=None),
            unwrap_model=lambda model: model.module)
        return unwrap_model_for_generation(self.engine, accelerator, gather_deepspeed3_params=True)

    def optimizer_step(self, it: int) -> None:
        self._phase("optimizer_step", it)
        self.engine.step()


def run_objective(step: ObjectiveOnEngine, iterations: int, say: Callable[[str], None]) -> None:
    from llmem.runtime.objective_steps import objective_iteration

    for it in range(iterations):
        say(f"iteration {it + 1}/{iterations}")
        objective_iteration(step, it)


def initialize(prepared: TrainingStep, stage: int) -> EngineStep:
    """deepspeed.initialize over the prepared model and its torch optimizer."""
    import deepspeed

    setup, model = prepared.setup, prepared.model
    cfg = engine_config(setup, stage, text_config(model.config).hidden_size, prepared.layout.dp)
    with patched(model, "to", lambda *a, **k: model):     # already on the engine's device
        engine, zero, _, _ = deepspeed.initialize(model=model, optimizer=prepared.optimizer, config=cfg)
    return EngineStep(setup, model, zero.optimizer, prepared.input_ids, engine, zero)


def notes_of(setup: TrainingSetup, world_size: int, stage: int, fake: bool) -> list[str]:
    import deepspeed

    tensors = ("fake tensors (shapes only), CUDA's fused SDPA kernels and dropout mask emulated" if fake else
               "real CPU tensors, CPU kernels (SDPA math / flash-for-cpu)")
    notes = [f"DeepSpeed {deepspeed.__version__}'s engine (deepspeed.initialize, ZeRO stage {stage}, the set-up's "
             f"torch optimizer) on {tensors}; rank 0 of {world_size} on a fake process group: NCCL's internal buffers "
             "are not traced (device_used adds the catalog's assumption for them), nor ZeRO's side streams (one "
             "allocator pool here)"]
    if setup.precision == "fp16-mixed":
        notes.append("fp16: every step runs as one without overflow (DeepSpeed's dynamic loss scaler skips a step "
                     "that overflows)")
    return notes


def _checked_stage(setup: TrainingSetup, iterations) -> int:
    """The set-up's ZeRO stage, once its iterations and its DeepSpeed options are checked."""
    check_iterations(iterations)
    stage = method_spec(setup.method).zero_stage
    if stage is None:
        raise LlmemError(f"deepspeed_step runs the ds-zero methods, not {setup.method}")
    check_deepspeed_setup(setup)
    return stage


def save_checkpoint(step: EngineStep, prepared: TrainingStep, ledger: Ledger, hooks: StepHooks,
                    say: Callable[[str], None]) -> tuple[int, ...] | None:
    """The checkpoint HF Trainer saves after the iterations, where traced (llmem.runtime.ds_saving): the host
    bytes per node of each of its parts, None where not traced."""
    if not ds_save_traced(step.setup):
        return None
    say("saving a checkpoint")
    node_ranks = min(prepared.layout.gpus_per_node, prepared.layout.world_size)
    return run_ds_save(step.engine, ledger, hooks.on_phase, step.setup, node_ranks)


def _trace_notes(setup: TrainingSetup, resolved, world: int, stage: int, fake: bool) -> list[str]:
    """What a DeepSpeed trace says of its step: the engine's, the activations', the optimizer's, TRL's trainer code
    and what the run emulates of it, the model's positions and layers, a vision-language model's images."""
    notes = notes_of(setup, world, stage, fake) + activation_notes(setup) + setup.optimizer_spec.notes("trace", False)
    if setup.objective_spec.runs_trainer:         # TRL's trainer code and what the run emulates of it
        from llmem.runtime.objective_steps import objective_trace_notes

        notes += objective_trace_notes(setup)
        if setup.objective_spec.keeps_reference:    # (SFTTrainer has none to say of)
            notes.append(reference_engine_note(stage, reference_mode(setup) == REF_COPY))
    anatomy = resolved.anatomy
    notes += [n for n in (anatomy.positions_note(setup.seq_len), anatomy.varied_layers_note) if n is not None]
    images = vision_inputs(setup, resolved.base)     # a vision-language model's images (llmem.runtime.vision)
    if images is not None:
        notes.append(images.describe())
    return notes


def deepspeed_step(setup: TrainingSetup, *, iterations: int = 2, progress: Callable[[str], None] | None = None,
                   cuda_kernels: bool = True, fake: bool = True,
                   save: bool = False) -> tuple[MemoryResult, TraceDetails]:
    """Run `iterations` steps of DeepSpeed's engine for a ds-zero set-up (rank 0 of its GPUs on a fake process
    group) with every allocation in the ledger; the allocator replay gives reserved; engine "trace".

    fake=False runs on real CPU tensors, the cross-check of the fake run (seconds for a model of a few million
    parameters; the CPU's bf16 matmuls of backward are slow: 40 s a step for tiny-llama at seq 256). save (fake
    only): HF Trainer's checkpoint saved after the iterations where traced (llmem.runtime.ds_saving), its phase in
    the result's job_phases."""
    stage = _checked_stage(setup, iterations)
    say = progress or (lambda msg: None)
    gpu = resolve_gpu(setup.gpu, setup.gpu_memory, setup.cuda_context)
    t0 = time.perf_counter()
    ledger = Ledger(workspace_bytes=gpu.cublas_workspace_bytes)
    fake_mode = TracingFakeMode() if fake else None
    roles_box: list[EngineRoles] = []

    with contextlib.ExitStack() as outer:
        def start_tracking() -> None:
            outer.enter_context(tracking(ledger, fake_mode, real=not fake))
            roles_box.append(EngineRoles(ledger))

        hooks = StepHooks(on_phase=lambda ph, it: roles_box[0].on_phase(ph, it), region=ledger.region)
        with prepared_step(setup, fake=fake, fake_mode=fake_mode, hooks=hooks, cuda_kernels=cuda_kernels and fake,
                           before_model=start_tracking, progress=say) as prepared, \
                ds_environment(prepared.layout.world_size), cpu_accelerator() as accelerator, fresh_comm_state(), \
                deepspeed_patches(ledger, accelerator, gpu.memory_bytes, fake):
            trl_step = None
            if setup.objective_spec.runs_trainer:   # TRL's trainer __init__ (its reference engine), before the policy's
                from llmem.runtime.objective_steps import objective_run

                trl_step = ObjectiveOnEngine(prepared)
                objective_run(trl_step)
            say("deepspeed.initialize")
            step = initialize(prepared, stage)
            roles = roles_box[0]
            roles.bind(step)
            extra = {} if prepared.position_ids is None else {"position_ids": prepared.position_ids}
            extra.update(prepared.extra_inputs)      # a vision-language model's images, grid and 3-D positions
            hidden = text_config(prepared.model.config).hidden_size
            with labelled_regions(ledger, roles, step.zero), \
                    hf_deepspeed_config(setup, stage, hidden, prepared.layout.dp):
                if trl_step is None:
                    run_engine(step, extra, prepared.offload, iterations, hooks.on_phase, say)
                else:
                    trl_step.bind(step.engine)
                    run_objective(trl_step, iterations, say)
                    del trl_step
                step_events = len(ledger.events)
                saved_host = save_checkpoint(step, prepared, ledger, hooks, say) if save and fake else None
            roles.finish()
            ledger.enabled = False
            resolved = prepared.resolved
            world = prepared.layout.world_size
            del step, prepared
    say("replaying the allocator")
    saved = [ds_save_job_phase(ledger, setup, saved_host)] if saved_host is not None else []
    ledger.events = ledger.events[:step_events]      # the step's answer: its iterations
    series = replay_ledger(ledger, expandable_segments=setup.expandable_segments)
    wall = time.perf_counter() - t0
    notes = _trace_notes(setup, resolved, world, stage, fake)
    notes.append(f"trace: {len(ledger.events)} allocator events, {wall:.1f} s")
    result = build_result("trace", ledger, resolved.record(), gpu, notes, series)
    result.job_phases = saved
    result.job_over = phase_over(saved, gpu.memory_bytes - outside_allocator_bytes(gpu, world))
    if objective_spec(setup.objective).generates:     # GRPO's / RLOO's phases (llmem.runtime.generation)
        from llmem.runtime.generation import traced_phases

        result.phases = traced_phases(series)
    return result, trace_details(ledger, series, wall)
