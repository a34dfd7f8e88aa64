"""What `llmem trace` says of the job's loading and saving phases: traced (llmem.runtime.loading, saving,
ds_loading, ds_saving), or not and why. The loading phase is traced in a run of its own (`load_phases`), the saving phase after the step's
iterations (llmem.runtime.saving.run_save)."""

from __future__ import annotations

from llmem.result import JobPhase
from llmem.runtime.loading import load_phases, phases_untraced
from llmem.setup.job_phases import load_path, save_kind
from llmem.setup.methods import method_spec
from llmem.units import format_bytes

__all__ = ["load_phases", "phase_trace_notes"]

# Paths the trace does not run, and why (what was tried)
UNTRACED = {
    "cpu-ram-efficient": "accelerate's fsdp2_prepare_model moves the host model to meta (Module._apply cannot swap "
                         "fake parameters for meta ones) and fsdp2_load_full_state_dict moves each full tensor to the "
                         "mesh's device type, which on the fake mesh is the host's",
    "deepspeed-load": "DeepSpeed's engine moving the whole module (no zero.Init), and peft's adapters over a "
                      "zero.Init model, are not run (llmem.runtime.ds_loading runs zero.Init without adapters)",
}


def _untraced(name: str, kind: str, setup) -> str:
    why = phases_untraced(setup)
    if why is not None:
        return f"{name} ({kind}) is not traced under {why}: the estimate's phase is analytic"
    why = UNTRACED.get(kind)
    if why is None and name == "load" and method_spec(setup.method).zero_stage is not None:
        why = UNTRACED["deepspeed-load"]
    return f"{name} ({kind}) is not traced: {why or 'the trace does not run this path (yet)'}; the estimate's " \
        "phase is analytic"


def phase_trace_notes(setup, job: list[JobPhase], save_why: str | None = None) -> list[str]:
    """One note per loading / saving phase: traced (device bytes per GPU, host bytes per node) or not and why
    (`save_why`: why the step's save could not run, llmem.runtime.saving.optimizer_unsaved)."""
    notes = []
    traced = {p.name: p for p in job}
    for name, row in (("load", load_path(setup)), ("save", save_kind(setup))):
        if row is None:
            continue
        phase = traced.get(name)
        if phase is not None:
            notes.append(f"{name} ({row.name}) traced: {format_bytes(phase.device_bytes)} of tensors per GPU at its "
                         f"peak, {format_bytes(phase.host_bytes)} of host tensors per node")
        elif name == "save" and save_why is not None:
            notes.append(f"save ({row.name}) is not traced: {save_why}; the estimate's phase is analytic")
        else:
            notes.append(_untraced(name, row.name, setup))
    return notes
