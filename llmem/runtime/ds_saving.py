"""`llmem trace` of the saving phase under DeepSpeed (llmem.runtime.deepspeed runs the step on DeepSpeed's own
engine): what HF Trainer's save_model and _save_optimizer_and_scheduler run (transformers 5.25, DeepSpeed 0.19),
on the traced engine after its iterations, under the ledger's "save" phase.

What runs for real:
- gather-16bit (ZeRO-3 with stage3_gather_16bit_weights_on_model_save): the engine's
  _zero3_consolidated_16bit_state_dict (GatheredParameters over each module's own parameters in turn, rank 0's
  `param.detach().cpu()` of each), which save_model writes with save_pretrained; then
- the engine's save_checkpoint (what the sharded kind runs alone): each rank's module state and its ZeRO
  optimizer's state dict (the flat fp32 partitions) through DeepSpeed's checkpoint engine's torch.save.
The writes are stubbed as in llmem.runtime.saving (torch.save under skip_data, its `storage.cpu()` made as one host
copy of the largest device storage). The host copies of the consolidation are rank 0's; the checkpoint's are every
rank's.
"""

from __future__ import annotations

import gc
import tempfile
from collections.abc import Callable

from llmem.result import JobPhase
from llmem.runtime.host_copies import host_and_device
from llmem.runtime.ledger import PHASE_CODES, Ledger
from llmem.runtime.loading import phases_untraced
from llmem.runtime.replay import phase_tensor_peak
from llmem.runtime.saving import SAVE_PHASE, writes_stubbed
from llmem.setup.job_phases import DS_ZERO3, phase_family, save_kind


def consolidated_16bit(engine) -> None:
    """HF Trainer's save_model under ZeRO-3 with the 16-bit gather: the consolidated state dict on rank 0's host
    (save_pretrained then writes those host tensors)."""
    state_dict = engine._zero3_consolidated_16bit_state_dict()
    del state_dict
    # its recursive get_layer_state_dict closes over the dict (a reference cycle): the dict dies at the next
    # collection, which save_pretrained's thousands of Python objects trigger long before the checkpoint
    gc.collect()


# (save kind, phase family) -> what runs before the engine's save_checkpoint (None: the checkpoint alone)
DS_SAVE_RUNS: dict[tuple[str, str], Callable | None] = {
    ("gather-16bit", DS_ZERO3): consolidated_16bit, ("sharded", DS_ZERO3): None,
}


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


def run_ds_save(engine, ledger: Ledger, on_phase: Callable[[str, int], None], setup,
                ranks_per_node: int) -> tuple[int, int]:
    """The saving code on the traced engine: (host bytes of rank 0's consolidation, host bytes per node of the
    checkpoint)."""
    run = DS_SAVE_RUNS[save_kind(setup).name, phase_family(setup)]
    on_phase(SAVE_PHASE, 0)
    with tempfile.TemporaryDirectory() as output_dir, writes_stubbed(ledger), \
            host_and_device(ledger, device_named_cpu=True):
        before = ledger.host_now
        ledger.host_peaks[PHASE_CODES[SAVE_PHASE]] = before
        if run is not None:
            run(engine)
        gathered = _host_added(ledger, before)
        engine.save_checkpoint(output_dir)
        checkpoint = _host_added(ledger, before)
    return gathered, ranks_per_node * checkpoint


def ds_save_job_phase(ledger: Ledger, setup, host: tuple[int, int]) -> JobPhase:
    """The saving phase: its peak of device tensor bytes over the whole ledger, of host bytes on the node."""
    row = save_kind(setup)
    run = DS_SAVE_RUNS[row.name, phase_family(setup)]
    what = " ".join((run.__doc__ if run is not None else row.summary).split())
    return JobPhase(SAVE_PHASE, row.name, phase_tensor_peak(ledger, SAVE_PHASE), max(host),
                    f"traced: {what}; then the engine's save_checkpoint")
