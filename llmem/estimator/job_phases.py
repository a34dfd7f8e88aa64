"""The job's loading and saving phases beside its training step: each one's peak of tensor bytes on one GPU and of
CPU RAM on one node, worked out from the frameworks' own code paths (llmem.setup.job_phases names the path a set-up
takes). Pure arithmetic over `PhaseBytes`, the bytes the phases are made of, which `phase_bytes` reads once from the
resolved set-up; one function per framework behaviour.

Loading (transformers 5's from_pretrained builds the model on the meta device, then materialises the checkpoint's
tensors where the device map says, the host by default):
- `load_on_host_then_move`: every rank of a node holds the model in host memory, then the Trainer moves it whole.
- `load_with_device_map`: from_pretrained(device_map=...) puts each tensor straight on the GPU.
- `fsdp2_prepare_from_host`: accelerate's fsdp2_prepare_model without cpu_ram_efficient_loading (its default):
  every rank holds the model on the host (original_sd keeps it alive until preparation returns) and fully_shard
  moves each unit's tensors whole to the GPU before it shards them.
- `fsdp2_cpu_ram_efficient_loading`: local rank 0 of each node loads the model (the other ranks on meta), then
  fsdp2_load_full_state_dict broadcasts one full parameter at a time and each rank keeps its shard.
- `meta_init_then_sharded_load`: torchtitan: fully_shard on meta, to_empty, then DCP reads each rank's shards.
- `deepspeed_engine_moves_module`: no zero.Init: every rank loads the model on the host; DeepSpeed's engine casts it
  to 16 bits and moves it whole to its GPU (_configure_distributed_model) before ZeRO partitions anything.
- `zero_init_then_rank0_loads`: zero.Init partitions each module as it is built; rank 0 reads the checkpoint into
  host memory and _load_state_dict_into_zero3_model gathers one module at a time (GatheredParameters,
  modifier_rank=0) to copy it in; a tied lm_head's own partition is still held then (see the function).

Saving (what HF's Trainer runs at a checkpoint: the model, then the optimizer; the step's weights and optimizer
states stay on the GPU throughout, and so do DDP's gradient buckets (the Reducer's, for the module's lifetime) and
the cuBLAS workspace (made at the first matmul, kept by the allocator for its handle); gradients freed by
zero_grad(set_to_none=True)):
- `save_pretrained_from_device`: rank 0's save_pretrained (safetensors copies each tensor of a shard to the host and
  keeps it until the shard is written; shards of 50 GB, transformers 5's max_shard_size) and torch.save of the
  optimizer's state dict (one storage copied to the host at a time).
- `fsdp2_full_state_dict`: get_model_state_dict / get_optimizer_state_dict(full_state_dict=True, cpu_offload=True):
  every rank all-gathers each parameter (and each state) in turn (full_tensor), rank 0 keeps its host copy.
- `fsdp2_sharded_state_dict`: SHARDED_STATE_DICT with offload_to_cpu (accelerate's FSDP2 default): each rank copies
  its shards of the model, then of the optimizer, to the host for DCP to write.
- `deepspeed_save_checkpoint`: the engine's save_checkpoint: each rank torch.saves its fp32 flat partitions (ZeRO-1/2
  one flat buffer per group; ZeRO-3 one per sub-group of sub_group_size), one storage copied to the host at a time.
- `zero12_full_state_dict`: accelerate's get_state_dict for ZeRO-1/2, run on every rank by HF Trainer's save_model:
  the replicated 16-bit weights cloned to each rank's host (clone_tensors_for_torch_save), then the engine's
  checkpoint.
- `zero3_consolidated_16bit_state_dict`: _zero3_consolidated_16bit_state_dict: each module's own parameters gathered
  in turn, rank 0 copying them to its host, then the engine's checkpoint.
- `peft_adapter_save`: peft's save_pretrained (get_peft_model_state_dict: the adapter weights); under ZeRO-3 HF's
  Trainer consolidates with exclude_frozen_parameters=True, which still gathers every module in turn; under ZeRO-1/2
  it takes accelerate's get_state_dict (the whole module cloned on every rank) before peft keeps the adapters.

Known limitations: the phases are analytic, from the frameworks' code as read (transformers 5.25, accelerate 1.16,
torch 2.13, DeepSpeed 0.19, peft 0.21), not replayed through the allocator model (`llmem trace` runs the loading and
saving code on fake tensors where it can: llmem.runtime.loading, saving, ds_saving);
device bytes are tensor bytes (no allocator rounding or cache, no CUDA context). The checkpoint is taken to be read in
the dtype the step stores each parameter (an fp32 upcast of a bf16 checkpoint adds one parameter's copy at a time,
not counted). Host bytes are the phase's own: file pages of a memory-mapped safetensors checkpoint (the OS's page
cache), the Python process and the libraries, and host memory the step already holds (offloaded optimizer states,
FSDP2's CPUOffloadPolicy shards except where loading puts them there) come on top. Only the policy is counted under
the preference and generation objectives (a reference model and vLLM load beside it). Tensor, pipeline, context and
expert parallelism and a quantised base have no phases (llmem.setup.job_phases). peft's merge_and_unload is not
modelled, nor FSDP2's full state dict on a single process (accelerate then keeps it on the GPU, not offloaded).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from math import ceil, prod

from llmem.estimator.identity_cache import IdentityCache
from llmem.estimator.param_facts import element_bytes_by_name
from llmem.estimator.states import ModelStates
from llmem.model.resolved import ResolvedSetup
from llmem.result import JobPhase
from llmem.setup.deepspeed import param_partition_numel, partition_numel, sub_group_numels, zero_config
from llmem.setup.job_phases import (
    DS_ZERO3,
    DS_ZERO12,
    FSDP2,
    PHASE_FIXES,
    REPLICATED,
    load_path,
    phase_family,
    save_kind,
)
from llmem.setup.precision import F32
from llmem.units import format_bytes

SAFETENSORS_SHARD_BYTES = 50 * 10**9   # save_pretrained's max_shard_size="50GB" (transformers 5)


@dataclass(frozen=True)
class PhaseBytes:
    """The bytes the phases are made of (every parameter once: a tied weight counted once)."""
    ranks_per_node: int            # the GPUs (processes) of one node
    shard_ranks: int               # FSDP2 / ZeRO: the ranks the model states are split over
    model_bytes: int               # every parameter in the dtype the step stores it (fp32 masters under *-mixed)
    model_16bit_bytes: int         # every parameter in the compute dtype (DeepSpeed's module parameters)
    trained_bytes: int             # the trained parameters (peft: the adapters), as stored
    trained_16bit_bytes: int       # ... in the compute dtype (ZeRO-3's consolidated adapters)
    largest_param_bytes: int       # one parameter, as stored
    largest_unit_bytes: int        # FSDP2: the parameters moved whole at once (a decoder layer, or the embedding
                                   # and the tail together: fsdp2_prepare_model_units)
    largest_module_16bit_bytes: int   # DeepSpeed: one module's own parameters, 16-bit (GatheredParameters' unit)
    fsdp_shard_bytes: int          # FSDP2: this rank's padded dim-0 shards of every parameter, as stored
    zero3_partition_16bit_bytes: int  # ZeRO-3: this rank's 16-bit partitions (ceil(numel / dp) each)
    zero3_tied_partition_16bit_bytes: int   # ... of the parameters with a tied alias (zero_init_then_rank0_loads)
    optimizer_bytes: int           # the optimizer's states of every trained parameter, unsharded
    optimizer_shard_bytes: int     # FSDP2: the states of this rank's shards
    largest_state_bytes: int       # one state tensor, unsharded
    zero_flat_bytes: int           # DeepSpeed: the largest fp32 flat partition a rank's torch.save copies at once
    tied_bytes: int                # the parameters with a tied alias (an untied lm_head: none), as stored: FSDP2's
    tied_shard_bytes: int          # state dicts have one entry per name and copy each ... and their FSDP2 shards
    stateless_grads_bytes: int     # FSDP2, an optimizer without state (SGD): the trained shards' zero gradients
                                   # (torch/distributed/checkpoint/state_dict.py _init_optim_state: zeros_like each
                                   # trained parameter, a step at lr 0, before the state dict is read)
    resident_bytes: int            # what the step keeps on one GPU between steps: weights, optimizer states, DDP's
                                   # buckets and cuBLAS's workspace (as eval_phase's)
    cpu_offload: bool = False      # FSDP2's CPUOffloadPolicy: the sharded parameters live on the host


# ------------------------------------------------------------------------------------------------ loading
# Each returns (device bytes per GPU, host bytes per node).

def load_on_host_then_move(b: PhaseBytes) -> tuple[int, int]:
    """from_pretrained on the host on each rank of a node, then model.to(device): the whole model on the GPU."""
    return b.model_bytes, b.ranks_per_node * b.model_bytes


def load_with_device_map(b: PhaseBytes) -> tuple[int, int]:
    """from_pretrained(device_map=...): each tensor materialised on the GPU (the checkpoint's pages are the OS's)."""
    return b.model_bytes, 0


def _fsdp2_resident(b: PhaseBytes) -> tuple[int, int]:
    """Where FSDP2's shards end up after loading: the GPU, or the host under CPUOffloadPolicy (per node)."""
    return (0, b.ranks_per_node * b.fsdp_shard_bytes) if b.cpu_offload else (b.fsdp_shard_bytes, 0)


def fsdp2_prepare_from_host(b: PhaseBytes) -> tuple[int, int]:
    """fsdp2_prepare_model without cpu_ram_efficient_loading: the model on every rank's host; _move_states_to_device
    puts one unit's tensors whole on the GPU, FSDPParam keeps this rank's shard of them (the whole ones die as
    fully_shard returns, the embedding's and the output's not: see fsdp2_prepare_model_units)."""
    device, host = _fsdp2_resident(b)
    return device + b.largest_unit_bytes, host + b.ranks_per_node * b.model_bytes


def fsdp2_cpu_ram_efficient_loading(b: PhaseBytes) -> tuple[int, int]:
    """One host copy per node (local rank 0's from_pretrained, the others on meta); fsdp2_load_full_state_dict
    broadcasts each parameter whole (rank 0 its copy moved to the GPU, the others an empty one) and
    distribute_tensor keeps the shard."""
    device, host = _fsdp2_resident(b)
    return device + b.largest_param_bytes, host + b.model_bytes


def meta_init_then_sharded_load(b: PhaseBytes) -> tuple[int, int]:
    """torchtitan: fully_shard on meta, to_empty allocates the shards, DCP reads each rank's part of a tensor into a
    host buffer before copying it in (one at a time)."""
    device, host = _fsdp2_resident(b)
    return device, host + b.ranks_per_node * ceil(b.largest_param_bytes / b.shard_ranks)


def deepspeed_engine_moves_module(b: PhaseBytes) -> tuple[int, int]:
    """No zero.Init: every rank loads the model on the host; the engine casts it to 16 bits and moves it whole to
    the GPU (_configure_distributed_model's module.to) before ZeRO partitions it."""
    return b.model_16bit_bytes, b.ranks_per_node * b.model_bytes


def zero_init_then_rank0_loads(b: PhaseBytes) -> tuple[int, int]:
    """zero.Init: each module partitioned as it is built; rank 0 merges the checkpoint into one host state dict and
    each module is gathered whole (GatheredParameters, modifier_rank=0) to be copied into.

    A tied weight is partitioned twice: zero.Init partitions the lm_head's own weight as nn.Linear builds it, then
    tie_weights replaces it with the embedding's. The replaced parameter is kept alive by a reference cycle
    (DeepSpeed 0.19 partition_parameters.py _convert_to_deepspeed_param sets param.all_gather, param.partition, ...
    to closures over the parameter itself), so its partition is freed only by Python's cyclic garbage collector,
    whose passes follow the interpreter's allocation counts, not the load: counted through it, as the trace finds
    it (tiny-qwen3 ZeRO-3 x 2: 8.19 MB, the orphan's 4,096,000 bf16 elements)."""
    return (b.zero3_partition_16bit_bytes + b.zero3_tied_partition_16bit_bytes + b.largest_module_16bit_bytes,
            b.model_16bit_bytes)


# ------------------------------------------------------------------------------------------------ saving

def save_pretrained_from_device(b: PhaseBytes) -> tuple[int, int]:
    """Rank 0: safetensors keeps every tensor of a shard copied to the host until the shard is written, then
    torch.save copies the optimizer's states one storage at a time."""
    return b.resident_bytes, max(min(b.model_bytes, SAFETENSORS_SHARD_BYTES), b.largest_state_bytes)


def fsdp2_full_state_dict(b: PhaseBytes) -> tuple[int, int]:
    """_gather_state_dict(cpu_offload=True, ranks_only=(0,)): each parameter, then each optimizer state,
    all-gathered whole on every GPU in turn; rank 0 keeps all of them on its host (the model's, then the
    optimizer's). The model state dict has an entry per name and _iterate_state_dict copies each: a tied weight
    twice (torch/distributed/_state_dict_utils.py, no memo)."""
    gathered = max(b.largest_param_bytes, b.largest_state_bytes, b.stateless_grads_bytes)
    return b.resident_bytes + gathered, max(b.model_bytes + b.tied_bytes, b.optimizer_bytes)


def fsdp2_sharded_state_dict(b: PhaseBytes) -> tuple[int, int]:
    """_offload_state_dict_to_cpu: each rank copies its model shards (a tied weight's twice, one per name), then its
    optimizer's, to the host (already host tensors under CPUOffloadPolicy: no copy). get_optimizer_state_dict's
    _init_optim_state first gives an optimizer with no state (SGD) a zero gradient per trained parameter."""
    device = b.resident_bytes + b.stateless_grads_bytes
    if b.cpu_offload:
        return device, 0
    return device, b.ranks_per_node * max(b.fsdp_shard_bytes + b.tied_shard_bytes, b.optimizer_shard_bytes)


def deepspeed_save_checkpoint(b: PhaseBytes) -> tuple[int, int]:
    """The engine's save_checkpoint: every rank torch.saves its flat fp32 partitions, one storage at a time."""
    return b.resident_bytes, b.ranks_per_node * b.zero_flat_bytes


def zero12_full_state_dict(b: PhaseBytes) -> tuple[int, int]:
    """accelerate's get_state_dict, which HF Trainer's save_model runs on every rank: clone_tensors_for_torch_save
    of the replicated 16-bit module to each rank's host; then save_checkpoint."""
    device, checkpoint = deepspeed_save_checkpoint(b)
    return device, max(b.ranks_per_node * b.model_16bit_bytes, checkpoint)


def zero3_consolidated_16bit_state_dict(b: PhaseBytes) -> tuple[int, int]:
    """_zero3_consolidated_16bit_state_dict: one module's own parameters gathered at a time, rank 0 keeping a host
    copy of each; then save_checkpoint."""
    device, checkpoint = deepspeed_save_checkpoint(b)
    return device + b.largest_module_16bit_bytes, max(b.model_16bit_bytes, checkpoint)


def peft_adapter_save(b: PhaseBytes, family: str) -> tuple[int, int]:
    """peft's save_pretrained of the adapters, then the optimizer (torch.save; DeepSpeed: save_checkpoint). Under
    ZeRO-3 HF Trainer's consolidation (exclude_frozen_parameters) gathers every module in turn and keeps the
    trained ones; under ZeRO-1/2 its get_state_dict clones the whole 16-bit module to every rank's host first."""
    if family == DS_ZERO3:
        device, checkpoint = deepspeed_save_checkpoint(b)
        return device + b.largest_module_16bit_bytes, max(b.trained_16bit_bytes, checkpoint)
    if family == DS_ZERO12:
        return zero12_full_state_dict(b)
    return b.resident_bytes, max(b.trained_bytes, b.largest_state_bytes)


LOADS = {("cpu", REPLICATED): load_on_host_then_move, ("device-map", REPLICATED): load_with_device_map,
         ("cpu", FSDP2): fsdp2_prepare_from_host, ("cpu-ram-efficient", FSDP2): fsdp2_cpu_ram_efficient_loading,
         ("meta-init", FSDP2): meta_init_then_sharded_load, ("cpu", DS_ZERO12): deepspeed_engine_moves_module,
         ("cpu", DS_ZERO3): deepspeed_engine_moves_module, ("zero-init", DS_ZERO3): zero_init_then_rank0_loads}
SAVES = {("full", REPLICATED): save_pretrained_from_device, ("full", FSDP2): fsdp2_full_state_dict,
         ("sharded", FSDP2): fsdp2_sharded_state_dict, ("full", DS_ZERO12): zero12_full_state_dict,
         ("sharded", DS_ZERO12): deepspeed_save_checkpoint, ("sharded", DS_ZERO3): deepspeed_save_checkpoint,
         ("gather-16bit", DS_ZERO3): zero3_consolidated_16bit_state_dict,
         **{("adapters", f): partial(peft_adapter_save, family=f) for f in (REPLICATED, DS_ZERO12, DS_ZERO3)}}


# ------------------------------------------------------------------------------------------------ the set-up's

def phase_bytes(r: ResolvedSetup, ms: ModelStates) -> PhaseBytes:
    """The bytes of `PhaseBytes` for a resolved set-up (`ms`: its model states)."""
    s, params, family = r.setup, r.anatomy.params, phase_family(r.setup)
    shard_ranks = r.layout.shard_degree if family == FSDP2 else r.layout.dp
    b16 = s.compute_bytes
    by_name = element_bytes_by_name(r.anatomy, s)
    eb = [by_name[p.name] for p in params]
    stored = [p.numel * n for p, n in zip(params, eb, strict=True)]
    trained = [(p, n) for p, n in zip(params, eb, strict=True) if p.trainable]
    states = [r.optimizer.states(p.shape, n) for p, n in trained]
    shard_numel = [ceil(p.shape[0] / shard_ranks) * prod(p.shape[1:]) if p.shape else 1 for p in params]
    shard_bytes = [n * e for n, e in zip(shard_numel, eb, strict=True)]
    modules: dict[str, int] = defaultdict(int)
    for p in params:
        modules[p.name.rsplit(".", 1)[0]] += p.numel * b16
    return PhaseBytes(
        ranks_per_node=min(r.layout.gpus_per_node, r.layout.world_size), shard_ranks=shard_ranks,
        model_bytes=sum(stored), model_16bit_bytes=r.anatomy.total_params * b16,
        trained_bytes=sum(p.numel * n for p, n in trained),
        trained_16bit_bytes=r.anatomy.trainable_params * b16,
        largest_param_bytes=max(stored, default=0), largest_unit_bytes=fsdp2_prepare_model_units(params, stored),
        largest_module_16bit_bytes=max(modules.values(), default=0),
        fsdp_shard_bytes=sum(shard_bytes),
        tied_bytes=sum(nbytes for p, nbytes in zip(params, stored, strict=True) if p.tied_to is not None),
        tied_shard_bytes=sum(n for p, n in zip(params, shard_bytes, strict=True) if p.tied_to is not None),
        stateless_grads_bytes=0 if family != FSDP2 or any(map(sum, states)) else
        sum(n for p, n in zip(params, shard_bytes, strict=True) if p.trainable),
        zero3_partition_16bit_bytes=sum(param_partition_numel(p.numel, shard_ranks) for p in params) * b16,
        zero3_tied_partition_16bit_bytes=sum(param_partition_numel(p.numel, shard_ranks) for p in params
                                             if p.tied_to is not None) * b16,
        optimizer_bytes=sum(map(sum, states)),
        optimizer_shard_bytes=sum(sum(r.optimizer.states((n,), e))
                                  for p, n, e in zip(params, shard_numel, eb, strict=True) if p.trainable),
        largest_state_bytes=max((max(st, default=0) for st in states), default=0),
        zero_flat_bytes=_zero_flat_bytes(r, [p.numel for p, _ in trained], shard_ranks),
        resident_bytes=between_steps_bytes(r, ms),
        cpu_offload=s.fsdp_cpu_offload)


def between_steps_bytes(r: ResolvedSetup, ms: ModelStates) -> int:
    """What the step keeps on one GPU between steps, where a checkpoint is saved: the weights, the optimizer's
    states, cuBLAS's workspace (the allocator keeps it from the first matmul), DDP's Reducer buckets (the module's
    lifetime), and under ZeRO-3 the gradient partitions' buffer and the IPG bucket (llmem.estimator.moments'
    zero_moments holds them through the step; ZeRO-1/2's are the backward's only)."""
    held = ms.weights + ms.optimizer_states + r.gpu.cublas_workspace_bytes
    stage = r.method.zero_stage
    if stage is None:
        return held + ms.ddp_buckets
    return held + (ms.gradients + ms.ddp_buckets if stage == 3 else 0)


def fsdp2_prepare_model_units(params, stored: list[int]) -> int:
    """The most parameter bytes accelerate's fsdp2_prepare_model (accelerate 1.16 utils/fsdp_utils.py) has whole on
    the GPU at once when it shards a host model: a decoder layer's (its whole tensors die as its fully_shard
    returns), or the parameters outside the layers together: it reads `input_weight` / `output_weight` (the
    embedding's and the output's parameters) before carving the embedding unit and the tail [final norm, lm_head],
    and those locals keep the parameters fully_shard moved to the device whole until preparation returns, so the
    tail's are moved while the embedding's are still held (traced: llmem.runtime.loading)."""
    layers: dict[int, int] = defaultdict(int)
    outside = 0
    for p, nbytes in zip(params, stored, strict=True):
        if p.layer_index is None:
            outside += nbytes
        else:
            layers[p.layer_index] += nbytes
    return max(max(layers.values(), default=0), outside)


def _zero_flat_bytes(r: ResolvedSetup, numels: list[int], dp: int) -> int:
    """DeepSpeed's largest fp32 flat partition: ZeRO-1/2's flat buffer of this rank's partition, ZeRO-3's largest
    sub-group (0 outside DeepSpeed)."""
    stage = r.method.zero_stage
    if stage is None or not numels:
        return 0
    part = partition_numel(numels, stage, dp)
    if stage == 3:
        sub_group = zero_config(r.setup, stage, r.anatomy.hidden_size).sub_group_size
        part = max(sub_group_numels([param_partition_numel(n, dp) for n in numels], sub_group), default=0)
    return part * F32


# the set-ups of one plan's searches: a search estimates one set-up at several batches, whose phases are the same
_PHASES: IdentityCache[list[JobPhase]] = IdentityCache(64)


def job_phases(r: ResolvedSetup, ms: ModelStates) -> list[JobPhase]:
    """The loading and saving phases of the set-up (none where llmem.setup.job_phases models none); worked out once
    per set-up less its micro-batch shape, which no phase reads (`ms`: the model states, which do not read it
    either)."""
    key = (r.setup.shape_free, r.layout, r.gpu)
    return list(_PHASES.get(r.anatomy, key, lambda: _phases_of(r, ms)))


def _phases_of(r: ResolvedSetup, ms: ModelStates) -> list[JobPhase]:
    family = phase_family(r.setup)
    if family is None:
        return []
    b = phase_bytes(r, ms)
    out = []
    for phase, row, table in (("load", load_path(r.setup), LOADS), ("save", save_kind(r.setup), SAVES)):
        formula = table[row.name, family]
        device, host = formula(b)
        what = " ".join((getattr(formula, "func", formula).__doc__ or row.summary).split())
        out.append(JobPhase(phase, row.name, device, host, what))
    return out


PHASE_WORDS = {"load": "loading", "eval": "evaluation", "save": "saving"}



def _listed(words: list[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    return ", ".join(words[:-1]) + f" and {words[-1]}" if len(words) > 1 else "".join(words)


def job_notes(phases: list[JobPhase], step_allocated_bytes: int, allocator_bytes: int) -> list[str]:
    """Where a phase needs more of the GPU than the step (its peak of tensor bytes) or than the allocator may use
    (the GPU's memory less what lies outside the allocator)."""
    names = [p.name for p in phases]
    are = "phases are" if len(names) > 1 else "phase is"
    notes = [f"{_listed(names)} {are} analytic (the frameworks' {_listed([PHASE_WORDS[n] for n in names])} code as "
             "read; llmem trace runs it on fake tensors where it can): tensor bytes per GPU, host RAM per node"]
    for p in phases:
        if p.device_bytes > allocator_bytes:
            notes.append(f"{p.name} ({p.kind}) needs {format_bytes(p.device_bytes)} per GPU, more than the "
                         f"{format_bytes(allocator_bytes)} the allocator may use: the job runs out of memory there, "
                         f"whatever the step's fit (so it does not fit): {PHASE_FIXES[p.name]}")
        elif p.device_bytes > step_allocated_bytes:
            notes.append(f"{p.name} ({p.kind}) peaks above the step: {format_bytes(p.device_bytes)} against "
                         f"{format_bytes(step_allocated_bytes)} per GPU")
    return notes
