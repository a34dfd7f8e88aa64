"""The phases of a job around its training step: how the model is loaded and how a checkpoint is saved, as rows
(`LOAD_PATHS`, `SAVE_KINDS`) that name the framework code each follows, and the default each method gets from HF's
Trainer with accelerate (transformers 5, accelerate 1.16, DeepSpeed 0.19). The bytes are worked out on the estimator
floor (llmem.estimator.job_phases); this module says which path a set-up takes and refuses the ones it cannot.

A method's phase family (`phase_family`):
- replicated: single, ddp (the whole model on every GPU);
- fsdp2: fsdp, zero2 (accelerate's fsdp2_prepare_model, FSDP2's state dicts);
- ds-zero12: ds-zero1, ds-zero2 (DeepSpeed's engine, parameters replicated);
- ds-zero3: ds-zero3 (parameters partitioned, zero.Init when HF's DeepSpeed config exists before from_pretrained).
Tensor, pipeline, context and expert parallelism and a quantised base have no phase family: their loading and
saving are not modelled (no phases in the answer).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.errors import LlmemError
from llmem.setup.methods import method_spec

DEFAULT = "default"
REPLICATED, FSDP2, DS_ZERO12, DS_ZERO3 = "replicated", "fsdp2", "ds-zero12", "ds-zero3"
FAMILIES = (REPLICATED, FSDP2, DS_ZERO12, DS_ZERO3)


@dataclass(frozen=True)
class PhaseRow:
    """One loading path or saving kind: the families it applies to, and those it is HF Trainer's default for."""
    name: str
    families: tuple[str, ...]
    default_for: tuple[str, ...]          # the families whose default it is in full fine-tuning
    peft_default_for: tuple[str, ...]     # ... and with adapters
    summary: str                          # --help and the phase's `what`
    peft_only: bool = False


LOAD_PATHS: dict[str, PhaseRow] = {r.name: r for r in (
    PhaseRow("cpu", (REPLICATED, FSDP2, DS_ZERO12, DS_ZERO3), (REPLICATED, FSDP2, DS_ZERO12),
             (REPLICATED, FSDP2, DS_ZERO12),
             "from_pretrained into host memory on every rank, then moved to the GPU (Trainer's model.to, FSDP2's "
             "fully_shard per unit, DeepSpeed's engine; ds-zero3: zero.Init off)"),
    PhaseRow("device-map", (REPLICATED,), (), (), "from_pretrained(device_map=...) straight onto the GPU"),
    PhaseRow("cpu-ram-efficient", (FSDP2,), (), (),
             "accelerate's cpu_ram_efficient_loading: one host copy per node, rank 0 broadcasting each parameter"),
    PhaseRow("meta-init", (FSDP2,), (), (), "torchtitan's meta-device init, fully_shard, to_empty, then a sharded "
                                        "(DCP) load per rank"),
    PhaseRow("zero-init", (DS_ZERO3,), (DS_ZERO3,), (DS_ZERO3,),
             "zero.Init (HF's DeepSpeed config made before from_pretrained): parameters partitioned as built, rank 0 "
             "reading the checkpoint and loading it one module at a time"),
)}

SAVE_KINDS: dict[str, PhaseRow] = {r.name: r for r in (
    PhaseRow("full", (REPLICATED, FSDP2, DS_ZERO12), (REPLICATED, DS_ZERO12), (),
             "the whole model's state dict on the host, rank 0's (FSDP2: FULL_STATE_DICT, each parameter "
             "all-gathered in turn) or every rank's (ZeRO-1/2: the replicated 16-bit weights cloned), and the "
             "optimizer saved beside it"),
    PhaseRow("sharded", (FSDP2, DS_ZERO12, DS_ZERO3), (FSDP2, DS_ZERO3), (FSDP2,),
             "each rank saves its own shards (FSDP2: SHARDED_STATE_DICT copied to the host, accelerate's default; "
             "DeepSpeed: the engine's save_checkpoint)"),
    PhaseRow("gather-16bit", (DS_ZERO3,), (), (),
             "stage3_gather_16bit_weights_on_model_save: the 16-bit weights consolidated on rank 0's host, one "
             "module gathered at a time, and the engine's sharded checkpoint"),
    PhaseRow("adapters", (REPLICATED, DS_ZERO12, DS_ZERO3), (), (REPLICATED, DS_ZERO12, DS_ZERO3),
             "peft's save_pretrained: the adapter weights only "
             "(ds-zero3: every module gathered in turn, the frozen ones dropped)", peft_only=True),
)}


# What a user changes where a phase of the job, not its step, runs out of the GPU's memory (a phase's peak does not
# depend on the training batch: a smaller --batch-size never helps there)
PHASE_FIXES = {
    "load": "choose a loading path that keeps less on each GPU (--load-path; with FSDP2: cpu-ram-efficient or "
            "meta-init)",
    "eval": "move the kept tensors to the host more often (--eval-accumulation-steps N), keep the losses only "
            "(--eval-keeps loss), or evaluate at a smaller --eval-batch-size",
    "save": "save each rank's own shards (--save-kind sharded) rather than gathering the model",
}


def phase_family(setup) -> str | None:
    """The set-up's phase family (module docstring), None where its phases are not modelled."""
    spec = method_spec(setup.method)
    if spec.has_tp or setup.pp > 1 or setup.cp > 1 or setup.ep > 1 or setup.quant_spec.quantised:
        return None
    if spec.zero_stage is not None:
        return DS_ZERO3 if spec.zero_stage == 3 else DS_ZERO12
    return FSDP2 if spec.shards_model_states else REPLICATED


def _chosen(rows: dict[str, PhaseRow], value: str, family: str, peft: bool) -> PhaseRow:
    """The row named by `value`, or under "default" the one HF Trainer's path takes for the family."""
    if value != DEFAULT:
        return rows[value]
    return next(r for r in rows.values() if family in (r.peft_default_for if peft else r.default_for))


def load_path(setup) -> PhaseRow | None:
    """The loading path the set-up takes (--load-path, or HF Trainer's default for its method); None: not
    modelled."""
    family = phase_family(setup)
    return None if family is None else _chosen(LOAD_PATHS, setup.load_path, family, setup.peft)


def save_kind(setup) -> PhaseRow | None:
    """The saving kind the set-up takes (--save-kind, or HF Trainer + accelerate's default for its method and
    whether it trains adapters); None: not modelled."""
    family = phase_family(setup)
    return None if family is None else _chosen(SAVE_KINDS, setup.save_kind, family, setup.peft)


def check_job_phases(setup) -> None:
    """--load-path and --save-kind: a known value, one that applies to the method (and to adapters)."""
    for flag, rows, value in (("--load-path", LOAD_PATHS, setup.load_path),
                              ("--save-kind", SAVE_KINDS, setup.save_kind)):
        if value == DEFAULT:
            continue
        if value not in rows:
            raise LlmemError(f"unknown {flag} {value!r}: choose one of {DEFAULT}, {', '.join(rows)}")
        family = phase_family(setup)
        if family is None:
            raise LlmemError(f"{flag} {value}: loading and saving are modelled for single, ddp, fsdp, zero2 and "
                             "ds-zero1/2/3 without tp, pp, cp, ep or a quantised base: drop the flag")
        row = rows[value]
        if family not in row.families:
            raise LlmemError(f"{flag} {value} does not apply to --method {setup.method}: choose one of "
                             f"{DEFAULT}, {', '.join(r.name for r in rows.values() if family in r.families)}")
        if row.peft_only and not setup.peft:
            raise LlmemError(f"{flag} {value} saves adapters: add --lora-rank R or --peft-config PATH, or choose "
                             f"another {flag}")
