"""Options on the planner floor: what `llmem plan` is asked (PlanOptions).

What `llmem plan` is asked: the engine, the ranking, the headroom and the time model's knobs, the export kinds.
Each field carries its command-line option (llmem.cli builds the `plan` flags from these fields)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmem.errors import LlmemError
from llmem.planner.side_by_side import available_cpus
from llmem.planner.timing import DEFAULT_INTER_NODE_GBPS, DEFAULT_MFU
from llmem.search import BATCH_CAP
from llmem.units import parse_bytes, parse_count, parse_fraction

ENGINES = ("llmem", "paper")
RANKINGS = ("time", "paper")
# plan --export KIND: what each kind writes (its writer: llmem.planner.export.EXPORTERS)
EXPORT_FILES = {"accelerate": "YAML", "torchrun": "shell", "deepspeed": "JSON", "torchtitan": "TOML",
                "trl": "the trl CLI's YAML and the accelerate config beside it"}
EXPORT_KINDS = tuple(EXPORT_FILES)
LAYOUT_SCOPES = ("all", "dp-tp")     # --layouts: with pipeline, context- and expert-parallel layouts, or without


def _flag(default: Any, help: str, flag: str, *, parse=None, cli_default: Any = ..., choices=None, type=None,
          metavar=None) -> Any:
    """A PlanOptions field with its `plan` option: `parse` reads the flag's text into the field's value."""
    return field(default=default, metadata={"flag": flag, "help": help, "parse": parse, "choices": choices,
                                            "cli_default": default if cli_default is ... else cli_default,
                                            "type": type, "metavar": metavar})


def parse_workers(text: str | int) -> int:
    """--workers: a count, or auto (every CPU this process may use)."""
    if str(text) == "auto":
        return available_cpus()
    try:
        return int(text)
    except ValueError:
        raise LlmemError(f"--workers takes a number of processes or auto, got {text!r}") from None


@dataclass
class PlanOptions:
    engine: str = _flag("llmem", "memory engine: llmem (PyTorch-native estimator, default) or paper (LLMem's "
                        "equations)", "--engine", choices=ENGINES)
    ranking: str = _flag("time", "time (tokens/s from the time model, default) or paper (LLMem's Algorithm 1)",
                         "--ranking", choices=RANKINGS)
    headroom: float = _flag(0.0, "keep this share of GPU memory free, e.g. 5%% (default 0%%)", "--headroom",
                            parse=parse_fraction, cli_default="0%")   # fits when device_used <= (1 - headroom) x memory
    mfu: float = _flag(DEFAULT_MFU, f"model FLOPs utilisation (default {DEFAULT_MFU})", "--mfu", type=float)
    inter_node_gbps: float = _flag(DEFAULT_INTER_NODE_GBPS, "network bandwidth per GPU across nodes in GB/s "
                                   "(default 25 = 200 Gb/s)", "--inter-node-gbps", type=float)
    global_batch: int | None = _flag(None, "samples per optimizer step: gradient accumulation over the largest "
                                     "micro-batch that fits", "--global-batch", type=int)
    dataset_tokens: int | None = _flag(None, "tokens in the dataset (e.g. 2e9, 500M, 1.5B): time to train it",
                                       "--dataset-tokens", parse=parse_count)
    m_base_bytes: int | None = _flag(None, "paper engine: memory in use before training, e.g. 600MiB", "--m-base",
                                     parse=parse_bytes)
    batch_cap: int = _flag(BATCH_CAP, f"cap of the batch search (default {BATCH_CAP})", "--max-batch", type=int)
    layouts: str = _flag("all", "all: dp x tp, HSDP, pipeline, context- and expert-parallel layouts (default); "
                         "dp-tp: without pipeline, context and expert parallelism", "--layouts",
                         choices=LAYOUT_SCOPES)
    workers: int = _flag(1, "processes the plan's independent searches run on side by side (default auto: every "
                         "CPU this process may use; 1: in turn)", "--workers", parse=parse_workers, metavar="N",
                         cli_default="auto")
    methods: tuple[str, ...] | None = None       # from --method: plan only this method
    tp: int | None = None                        # from --tp: only this tensor-parallel degree

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise LlmemError(f"unknown engine {self.engine!r}: choose {' or '.join(ENGINES)}")
        if self.ranking not in RANKINGS:
            raise LlmemError(f"unknown ranking {self.ranking!r}: choose {' or '.join(RANKINGS)}")
        if not 0 <= self.headroom < 1:
            raise LlmemError(f"--headroom must lie in [0, 100%), got {self.headroom}")
        if not 0 < self.mfu <= 1:
            raise LlmemError(f"--mfu must lie in (0, 1], got {self.mfu}")
        if self.inter_node_gbps <= 0:
            raise LlmemError(f"--inter-node-gbps must be positive, got {self.inter_node_gbps}")
        if self.global_batch is not None and self.global_batch < 1:
            raise LlmemError(f"--global-batch must be >= 1, got {self.global_batch}")
        if self.dataset_tokens is not None and self.dataset_tokens < 1:
            raise LlmemError(f"--dataset-tokens must be >= 1, got {self.dataset_tokens}")
        if self.layouts not in LAYOUT_SCOPES:
            raise LlmemError(f"unknown --layouts {self.layouts!r}: choose {' or '.join(LAYOUT_SCOPES)}")
        if self.workers < 1:
            raise LlmemError(f"--workers must be >= 1 (or auto), got {self.workers}")
        if self.batch_cap < 1:
            raise LlmemError(f"--max-batch must be >= 1, got {self.batch_cap}")
