"""`llmem trace` of the job's saving phase: the checkpoint code HF's Trainer runs (transformers 5.25, accelerate 1.16,
peft 0.21, torch 2.13) on the traced step's model and optimizer after its training iterations, its device
allocations recorded under the ledger's "save" phase and its host copies tallied apart (llmem.runtime.host_copies).

What runs for real:
- replicated (single, ddp), full or adapters: Trainer._save's `save_pretrained` of the unwrapped model (transformers'
  or peft's: get_peft_model_state_dict), safetensors' save_file (_flatten_as_ptr copying each tensor of a shard to
  the host and keeping it until the shard is written), then `torch.save(optimizer.state_dict())`;
- FSDP2, full or sharded: accelerate's save_fsdp_model and save_fsdp_optimizer with the plugin's state-dict configs
  (FULL: FullStateDictConfig(offload_to_cpu, rank0_only), SHARDED: ShardedStateDictConfig(offload_to_cpu)):
  torch's get_model_state_dict / get_optimizer_state_dict (_gather_state_dict's full_tensor and `.to(cpu)` per
  tensor, or _offload_state_dict_to_cpu).
What is stubbed: the writes. safetensors' serialize_file and DCP's save write nothing (the host tensors they would
write are alive while they run); torch.save runs under torch.serialization.skip_data (the pickling, no bytes), and
its `storage.cpu()` of a device storage (one at a time: skipped with the bytes) is made as one host copy of the
largest such storage. Fake storages have no data pointer: transformers' and peft's id_tensor_storage (the tied-
weights check) read the storage object's identity instead.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from collections.abc import Callable, Iterator
from functools import partial
from types import SimpleNamespace

import numpy
import torch

from llmem.result import JobPhase
from llmem.runtime.host_copies import host_and_device
from llmem.runtime.ledger import HOST, PHASE_CODES, Ledger
from llmem.runtime.loading import phases_untraced
from llmem.runtime.patches import accelerate_logging_without_state, collectives_waited_in_place, patched
from llmem.runtime.replay import phase_tensor_peak
from llmem.setup.job_phases import FSDP2, REPLICATED, phase_family, save_kind

SAVE_PHASE = "save"


def _storage_id(t: torch.Tensor) -> tuple:
    """transformers' / peft's id_tensor_storage for fake tensors (no data pointer): the storage object's identity."""
    from torch.distributed.tensor import DTensor

    local = t._local_tensor if isinstance(t, DTensor) else t
    st = local.untyped_storage()
    return t.device, id(st), st.nbytes()


def _largest_device_storage(obj, ledger: Ledger) -> int:
    """The bytes of the largest storage in `obj` (nested dicts, lists) not on the host."""
    if isinstance(obj, torch.Tensor):
        return 0 if ledger.on_host(obj) else obj.untyped_storage().nbytes()
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return max((_largest_device_storage(v, ledger) for v in items), default=0)


def _torch_save(ledger: Ledger, obj, f=None, *args, **kwargs) -> None:
    """torch.save without the bytes (skip_data over fake tensors), and serialization._save's `storage.cpu()` of the
    largest device storage: it copies one storage at a time to the host and drops it once written."""
    with ledger.region(HOST):
        copy = torch.empty(_largest_device_storage(obj, ledger), dtype=torch.uint8)
    del copy
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.serialization.save(obj, io.BytesIO())


@contextlib.contextmanager
def writes_stubbed(ledger: Ledger) -> Iterator[None]:
    """safetensors, torch.save and DCP write nothing; the host copies they make are made (module docstring)."""
    import safetensors.torch as st
    import torch.distributed.checkpoint as dcp
    import transformers.modeling_utils as modeling_utils
    from peft import peft_model

    def to_ndarray(tensor: torch.Tensor):
        return numpy.empty(0, dtype=numpy.uint8), tensor.to("cpu")     # safetensors' _to_ndarray: its host copy

    with contextlib.ExitStack() as stack:
        for obj, name, value in ((st, "_to_ndarray", to_ndarray), (st, "serialize_file", lambda *a, **k: None),
                                 (torch, "save", partial(_torch_save, ledger)), (dcp, "save", lambda *a, **k: None),
                                 (modeling_utils, "id_tensor_storage", _storage_id),
                                 (peft_model, "id_tensor_storage", _storage_id)):
            stack.enter_context(patched(obj, name, value))
        yield


def trainer_save(step, output_dir: str) -> None:
    """HF Trainer's checkpoint on one GPU or DDP: _save's save_pretrained of the unwrapped model (the adapters
    alone for a peft model), then _save_optimizer_and_scheduler's torch.save of the optimizer's state dict."""
    step.model.save_pretrained(output_dir, safe_serialization=True)
    torch.save(step.optimizer.state_dict(), f"{output_dir}/optimizer.pt")


def fsdp2_save(step, output_dir: str, full: bool) -> None:
    """accelerate's save_fsdp_model then save_fsdp_optimizer with its FSDP2 plugin's state-dict configs (accelerate
    utils/dataclasses.py FullyShardedDataParallelPlugin: offload_to_cpu, rank0_only for FULL)."""
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )

    plugin = SimpleNamespace(fsdp_version=2)
    if full:
        plugin.state_dict_type = StateDictType.FULL_STATE_DICT
        plugin.state_dict_config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        plugin.optim_state_dict_config = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    else:
        plugin.state_dict_type = StateDictType.SHARDED_STATE_DICT
        plugin.state_dict_config = ShardedStateDictConfig(offload_to_cpu=True)
        plugin.optim_state_dict_config = ShardedOptimStateDictConfig(offload_to_cpu=True)
    accelerator = SimpleNamespace(num_processes=step.layout.world_size, process_index=0)
    save_fsdp_model(plugin, accelerator, step.model, output_dir)
    save_fsdp_optimizer(plugin, accelerator, step.optimizer, step.model, output_dir)


# (save kind, phase family) -> what runs (llmem.setup.job_phases' rows); the kinds whose host copies every rank of a
# node makes (each its own shards), the others' rank 0 alone (save_pretrained's is_main_process, FULL's rank0_only)
SAVE_RUNS: dict[tuple[str, str], Callable] = {
    ("full", REPLICATED): trainer_save, ("adapters", REPLICATED): trainer_save,
    ("full", FSDP2): partial(fsdp2_save, full=True), ("sharded", FSDP2): partial(fsdp2_save, full=False),
}
EVERY_RANK_SAVES = frozenset({("sharded", FSDP2)})


def save_run(setup) -> Callable | None:
    """What the trace runs for the set-up's saving kind (None: not traced)."""
    family, row = phase_family(setup), save_kind(setup)
    if family is None or row is None or phases_untraced(setup) is not None:
        return None
    return SAVE_RUNS.get((row.name, family))


def optimizer_unsaved(optimizer) -> str | None:
    """Why the saving code cannot run on the step's optimizer (None: it can): llmem's wrappers (the optimizer in
    backward, Muon beside AdamW) have no torch state_dict for torch.save or get_optimizer_state_dict to read."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return None
    return f"its optimizer ({type(optimizer).__name__}, llmem's wrapper) has no torch state_dict"


def run_save(step, ledger: Ledger, roles) -> None:
    """The saving code on the traced step (after its iterations), under the ledger's save phase."""
    run = save_run(step.setup)
    roles.on_phase(SAVE_PHASE, 0)
    with tempfile.TemporaryDirectory() as output_dir, writes_stubbed(ledger), accelerate_logging_without_state(), \
            collectives_waited_in_place(), host_and_device(ledger):
        run(step, output_dir)


def save_job_phase(ledger: Ledger, setup, host_before: int, ranks_per_node: int) -> JobPhase:
    """The saving phase's peak of device tensor bytes (over the whole ledger) and of host bytes it added on the
    node (rank 0's, times the node's ranks that make the same copies)."""
    row = save_kind(setup)
    try:
        device = phase_tensor_peak(ledger, SAVE_PHASE)
    except KeyError:         # nothing allocated on the device (peft's adapters copied to the host): what is there
        device = sum(size if is_alloc else -size for is_alloc, _key, size, *_ in ledger.events)
    ranks = ranks_per_node if (row.name, phase_family(setup)) in EVERY_RANK_SAVES else 1
    host = ranks * (ledger.host_peaks.get(PHASE_CODES[SAVE_PHASE], host_before) - host_before)
    run = save_run(setup)
    what = "traced: " + " ".join((getattr(run, "func", run).__doc__ or row.summary).split())
    return JobPhase(SAVE_PHASE, row.name, device, host, what)
