"""`llmem trace` of the saving phase under DeepSpeed (llmem.runtime.deepspeed runs the step on DeepSpeed's own
engine): what HF Trainer's save_model and _save_optimizer_and_scheduler run (transformers 5.25, DeepSpeed 0.19),
on the traced engine after its iterations, under the ledger's "save" phase.

What runs for real:
- gather-16bit (ZeRO-3 with stage3_gather_16bit_weights_on_model_save), and adapters under ZeRO-3
  (exclude_frozen_parameters): the engine's _zero3_consolidated_16bit_state_dict (GatheredParameters over each
  module's own parameters in turn, rank 0's `param.detach().cpu()` of each), which save_model writes; then
- the engine's save_checkpoint (what the sharded kinds run alone): the module states (ZeRO-1/2: rank 0's; ZeRO-3:
  every rank's) and each rank's ZeRO optimizer state dict (the flat fp32 partitions) through DeepSpeed's checkpoint
  engine's torch.save.
What is emulated: ZeRO-1/2's full kind, accelerate's get_state_dict on every rank (zero12_module_state_dict). The
writes are stubbed as in llmem.runtime.saving (torch.save under skip_data, its `storage.cpu()` made as one host copy
of the largest device storage).
"""

from __future__ import annotations

import contextlib
import gc
import tempfile
from collections.abc import Callable, Iterator

from llmem.result import JobPhase
from llmem.runtime.host_copies import host_and_device
from llmem.runtime.ledger import PHASE_CODES, Ledger
from llmem.runtime.loading import phases_untraced
from llmem.runtime.patches import patched
from llmem.runtime.replay import phase_tensor_peak
from llmem.runtime.saving import SAVE_PHASE, writes_stubbed
from llmem.setup.job_phases import DS_ZERO3, DS_ZERO12, phase_family, save_kind


def consolidated_16bit(engine) -> None:
    """HF Trainer's save_model under ZeRO-3 with the 16-bit gather: the consolidated state dict on rank 0's host
    (save_pretrained then writes those host tensors)."""
    state_dict = engine._zero3_consolidated_16bit_state_dict()
    del state_dict
    # its recursive get_layer_state_dict closes over the dict (a reference cycle): the dict dies at the next
    # collection, which save_pretrained's thousands of Python objects trigger long before the checkpoint
    gc.collect()


def consolidated_adapters(engine) -> None:
    """HF Trainer's save_model under ZeRO-3 with peft: _zero3_consolidated_16bit_state_dict(exclude_frozen_parameters
    =True) (every module gathered in turn, rank 0 keeping the trained ones), then peft's save_pretrained."""
    state_dict = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    del state_dict
    gc.collect()           # (consolidated_16bit's reference cycle)


def zero12_module_state_dict(engine) -> None:
    """HF Trainer's save_model under ZeRO-1/2, on every rank: accelerate's get_state_dict, DeepSpeed's
    clone_tensors_for_torch_save(module.state_dict()) to the host. On a GPU its `device == item.device` test
    fails and each tensor is `detach().to("cpu")`; on the one fake device it would take its clone branch, so that
    copy is made here as the GPU makes it."""
    state_dict = {k: v.detach().cpu() for k, v in engine.module.state_dict().items()}
    del state_dict


# (save kind, phase family) -> what runs before the engine's save_checkpoint (None: the checkpoint alone), and
# whether every rank of a node makes its host copies (else rank 0 alone)
DS_SAVE_RUNS: dict[tuple[str, str], tuple[Callable | None, bool]] = {
    ("gather-16bit", DS_ZERO3): (consolidated_16bit, False), ("sharded", DS_ZERO3): (None, False),
    ("adapters", DS_ZERO3): (consolidated_adapters, False),
    ("full", DS_ZERO12): (zero12_module_state_dict, True), ("sharded", DS_ZERO12): (None, False),
}
MODULE_STATES_EVERY_RANK = frozenset({DS_ZERO3})


def ds_save_traced(setup) -> bool:
    """Whether the DeepSpeed trace runs the set-up's saving kind."""
    row = save_kind(setup)
    return row is not None and phases_untraced(setup) is None and (row.name, phase_family(setup)) in DS_SAVE_RUNS


def _host_added(ledger: Ledger, before: int) -> int:
    """The host bytes the save phase added at its peak since `before`, the peak reset for what follows."""
    code = PHASE_CODES[SAVE_PHASE]
    added = ledger.host_peaks.get(code, before) - before
    ledger.host_peaks[code] = ledger.host_now
    return max(added, 0)


@contextlib.contextmanager
def _each_part_measured(engine, ledger: Ledger, before: int, parts: dict[str, int]) -> Iterator[None]:
    """save_checkpoint's two parts, the module states (engine._save_checkpoint) and the ZeRO optimizer's partition
    (engine._save_zero_checkpoint), each with the host bytes it adds at its peak in `parts`."""
    def measured(name: str):
        part = getattr(engine, name)

        def run(*args, **kwargs):
            out = part(*args, **kwargs)
            parts[name] = _host_added(ledger, before)
            return out
        return run

    with patched(engine, "_save_checkpoint", measured("_save_checkpoint")), \
            patched(engine, "_save_zero_checkpoint", measured("_save_zero_checkpoint")):
        yield


def run_ds_save(engine, ledger: Ledger, on_phase: Callable[[str, int], None], setup,
                ranks_per_node: int) -> tuple[int, ...]:
    """The saving code on the traced engine: the host bytes per node of each of its parts at its peak (they run one
    after the other). HF Trainer's save_checkpoint leaves a peft model's frozen parameters out
    (exclude_frozen_parameters). ZeRO-1/2's module states are saved by rank 0 alone, ZeRO-3's by every rank (its
    _configure_checkpointing: save_non_zero_checkpoint on each weights partition); each rank saves its optimizer
    partition."""
    family = phase_family(setup)
    run, every_rank = DS_SAVE_RUNS[save_kind(setup).name, family]
    on_phase(SAVE_PHASE, 0)
    parts: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as output_dir, writes_stubbed(ledger), \
            host_and_device(ledger, device_named_cpu=True):
        before = ledger.host_now
        ledger.host_peaks[PHASE_CODES[SAVE_PHASE]] = before
        if run is not None:
            run(engine)
        gathered = _host_added(ledger, before)
        with _each_part_measured(engine, ledger, before, parts):
            engine.save_checkpoint(output_dir, exclude_frozen_parameters=setup.peft)
    module_ranks = ranks_per_node if family in MODULE_STATES_EVERY_RANK else 1
    return (gathered * (ranks_per_node if every_rank else 1), parts.get("_save_checkpoint", 0) * module_ranks,
            parts.get("_save_zero_checkpoint", 0) * ranks_per_node)


def ds_save_job_phase(ledger: Ledger, setup, host: tuple[int, ...]) -> JobPhase:
    """The saving phase: its peak of device tensor bytes over the whole ledger, of host bytes on the node."""
    row = save_kind(setup)
    run, _ = DS_SAVE_RUNS[row.name, phase_family(setup)]
    what = " ".join((run.__doc__ if run is not None else row.summary).split())
    return JobPhase(SAVE_PHASE, row.name, phase_tensor_peak(ledger, SAVE_PHASE), max(host),
                    f"traced: {what}; then the engine's save_checkpoint")
