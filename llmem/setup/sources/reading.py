"""Reading one config: its keys read one by one (the rest reported as not read), the TrainingSetup fields they set
with what each key said (`Used`), what cannot be expressed (`Ignored`), the dtype facts the precision is resolved
from, and the method and GPU count where the file states them. Bad values are one-line LlmemErrors naming the
file, the key and the fix."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from llmem.errors import LlmemError
from llmem.setup.sources.record import Ignored, Used

# the HF Trainer's torch_compile (TrainingArguments.torch_compile: torch.compile of the whole model)
WHOLE_MODEL_COMPILE = ("the Trainer's torch.compile of the whole model is not modelled (llmem's --compile is "
                       "torchtune's and torchtitan's compile of each decoder layer)")
# the rest of Unsloth's stack where a config loads the model through it (only its checkpoint is modelled)
UNSLOTH_KERNELS_NOTE = ("Unsloth's Triton kernels (fast LoRA MLP / QKV / O, fused cross-entropy, RoPE, RMSNorm) are "
                        "not modelled: HF's modules' saved tensors and full logits stand in (likely an upper bound)")


class Keys:
    """A config's mapping whose reads are tracked (nested mappings share the tracking), so that the keys no reader
    looked at can be listed as not read."""

    def __init__(self, data: dict, prefix: str = "", seen: set[str] | None = None):
        self.data = data
        self.prefix = prefix
        self.seen = set() if seen is None else seen

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add(self.name(key))
        value = self.data.get(key, default)
        return default if value is None else value

    def __contains__(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def sub(self, key: str) -> Keys:
        """The nested mapping at `key` ({} when absent or empty)."""
        value = self.get(key)
        self.seen.add(self.name(key))
        return Keys(value if isinstance(value, dict) else {}, f"{self.name(key)}.", self.seen)

    def unread(self) -> Iterator[str]:
        for key, value in self.data.items():
            name = self.name(str(key))
            if name in self.seen:
                continue
            if isinstance(value, dict) and any(s.startswith(name + ".") for s in self.seen):
                yield from Keys(value, name + ".", self.seen).unread()
            elif value is not None and value != "" and value != []:
                yield name


@dataclass(frozen=True)
class Dtypes:
    """What decides `--precision` and `--adapter-dtype`, as the frameworks set it up:
    compute: the matmuls' dtype (autocast's, or the weights' own where nothing autocasts): fp32 / bf16 / fp16;
    weights: the dtype the framework loads the model in (from_pretrained's dtype);
    adapters: "fp32" (peft's get_peft_model(autocast_adapter_dtype=True), its default) or "base";
    masters: the trained parameters are held in fp32 whatever the weights' dtype (accelerate's FSDP upcast of
      low-precision trained parameters, DeepSpeed's fp32 partitions, LLaMA-Factory's upcast);
    kbit_upcast: peft's prepare_model_for_kbit_training runs on a quantised base (None: the weights' dtype decides).
    """
    compute: str | None = None
    weights: str | None = None
    adapters: str = "fp32"
    masters: bool = False
    kbit_upcast: bool | None = None


def resolve_precision(d: Dtypes, peft: bool) -> tuple[str, str]:
    """(--precision, --adapter-dtype). The trained parameters' dtype decides fp32 masters (*-mixed) or pure low
    precision: HF Trainer's autocast over a model loaded in bf16 trains bf16 parameters with bf16 AdamW states, which
    is llmem's pure bf16 (autocast's fp32 ops, softmax and norms, are not told apart); the same over an fp32 model
    (TRL's default dtype, accelerate's FSDP upcast, DeepSpeed's fp32 partitions) is bf16-mixed. Under LoRA the
    trained parameters are the adapters: fp32 under peft's default, the base's dtype otherwise."""
    compute = d.compute or "fp32"
    weights = d.weights or compute
    adapter_dtype = "base" if peft and d.adapters == "base" else "fp32"
    if compute == "fp32":
        return "fp32", adapter_dtype
    trained = "fp32" if d.masters or (peft and d.adapters == "fp32") else weights
    return (f"{compute}-mixed" if trained == "fp32" else compute), adapter_dtype


@dataclass
class Reading:
    """One file's reading: the fields it sets and the record of how (mutable while its reader runs)."""
    path: Path
    format: str
    values: dict[str, Any] = field(default_factory=dict)
    used: list[Used] = field(default_factory=list)
    ignored: list[Ignored] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    dtypes: Dtypes = field(default_factory=Dtypes)
    method: str | None = None           # stated by the file (None: the launcher decides)
    multi_gpu_method: str = "ddp"       # what the framework runs on several GPUs when the file states no method
    gpus: int | None = None             # stated by the file
    gpus_per_node: int | None = None
    zero_stage: int | None = None       # DeepSpeed's ZeRO stage, where DeepSpeed runs it
    # the data-parallel shard degree is what the other degrees leave (torchtitan's data_parallel_shard_degree -1):
    # a sharding method whose dp resolves to 1 runs without FSDP2
    shard_rest: bool = False
    no_fsdp_precision: str | None = None    # the precision it trains in where no FSDP2 applies (torchtitan's)
    files: list[tuple[str, str]] = field(default_factory=list)   # referenced files read into this one

    @property
    def file(self) -> str:
        return self.path.name

    # ------------------------------------------------------------------ recording
    def set(self, key: str, raw: Any, name: str, value: Any, note: str = "", file: str | None = None) -> None:
        self.values[name] = value
        self.used.append(Used(file or self.file, key, raw, name, value, note))

    def note_used(self, key: str, raw: Any, note: str, file: str | None = None) -> None:
        """A key read that changes no llmem field (gradient accumulation, the sharding's own facts)."""
        self.used.append(Used(file or self.file, key, raw, "", None, note))

    def ignore(self, key: str, raw: Any, why: str, file: str | None = None, approximates: bool = True,
               settled_by: str = "") -> None:
        """A key llmem does not express; approximates False: it has no effect on memory (the answer stays the
        file's run); settled_by: the field whose command-line flag settles it (the entry then dropped)."""
        self.ignored.append(Ignored(file or self.file, key, raw, why, approximates, settled_by))

    def dtype(self, **changes: Any) -> None:
        self.dtypes = replace(self.dtypes, **changes)

    def not_read(self, keys: Keys, file: str | None = None) -> None:
        """One entry for the keys no reader looked at (data, logging, learning rate, saving, ...)."""
        rest = list(keys.unread())
        if rest:
            self.ignore("(other keys)", rest, "not read: no memory effect llmem knows of", file=file,
                        approximates=False)

    # ------------------------------------------------------------------ values
    def error(self, key: str, raw: Any, problem: str, fix: str) -> LlmemError:
        return LlmemError(f"{self.path}: {key} = {raw!r} {problem}; {fix}")

    def integer(self, key: str, raw: Any, low: int = 1, what: str = "a count") -> int:
        """An int >= low (YAML's 1_000, JSON's 1e9 as whole numbers too)."""
        value = raw
        if isinstance(raw, float) and raw.is_integer():
            value = int(raw)
        elif isinstance(raw, str) and raw.strip().lstrip("-").replace("_", "").isdigit():
            value = int(raw.replace("_", ""))
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, raw, f"is not {what}", f"give a whole number >= {low}")
        if value < low:
            raise self.error(key, raw, f"is not {what} (it is at least {low})", f"set it to {low} or more")
        return value

    def boolean(self, key: str, raw: Any) -> bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in ("true", "false", "yes", "no"):
            return raw.strip().lower() in ("true", "yes")
        raise self.error(key, raw, "is not true or false", "write true or false")

    def fraction(self, key: str, raw: Any) -> float:
        """A dropout probability in [0, 1)."""
        try:
            value = float(raw)
        except (TypeError, ValueError):
            value = -1.0
        if isinstance(raw, bool) or not 0.0 <= value < 1.0:
            raise self.error(key, raw, "is not a probability in [0, 1)", "give e.g. 0.05")
        return value

    def choice(self, key: str, raw: Any, choices: dict[str, Any] | tuple[str, ...], fix: str = "") -> Any:
        """`raw` (case-insensitive) among `choices` -> its value (a tuple: the name itself)."""
        table = choices if isinstance(choices, dict) else {c: c for c in choices}
        by_name = {str(k).lower(): v for k, v in table.items()}
        key_raw = str(raw).strip().lower()
        if key_raw not in by_name:
            raise self.error(key, raw, "is not one of " + ", ".join(map(str, table)),
                             fix or f"choose one of {', '.join(map(str, table))}")
        return by_name[key_raw]
