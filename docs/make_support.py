"""The support matrix (docs/support.md): which options combine, as the engine itself answers it.

Every cell is one `llmem.estimate` of a small model (tiny-llama; tiny-qwen3-moe where --ep needs experts) at 64
tokens: the set-up's own validation, the support check every engine raises (llmem.setup.support) and the
estimator's refusals all run, so the page says what `llmem estimate` says, whichever floor holds the rule. A refusal
is reported with the first line the engine gives (numbered once, below the tables).

    HF_HUB_OFFLINE=1 .venv/bin/python docs/make_support.py > docs/support.md      # ~1-2 min on 2 cores

tests/setup/test_support_matrix.py checks a sample of cells against a fresh estimate, and the whole page in the slow run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

SEQ_LEN = 64
MODEL = "tiny-llama"
MOE_MODEL = "tiny-qwen3-moe"


@dataclass(frozen=True)
class Feature:
    """One option as a user turns it on: the set-up fields it sets, and the GPUs it multiplies the layout by."""
    label: str
    fields: dict = field(default_factory=dict)
    gpu_factor: int = 1
    model: str = MODEL
    group: str = ""          # options of one group exclude each other (one quantised base, one optimizer, ...)


# The methods as rows: their fields and GPU count (fsdp+tp: 2 dp x 2 tp)
METHOD_ROWS: tuple[Feature, ...] = (
    Feature("single", {"method": "single"}, 1),
    Feature("ddp", {"method": "ddp"}, 2),
    Feature("fsdp", {"method": "fsdp"}, 2),
    Feature("zero2", {"method": "zero2"}, 2),
    Feature("tp", {"method": "tp"}, 2),
    Feature("fsdp+tp", {"method": "fsdp+tp", "tp": 2}, 4),
    Feature("ds-zero1", {"method": "ds-zero1"}, 2),
    Feature("ds-zero2", {"method": "ds-zero2"}, 2),
    Feature("ds-zero3", {"method": "ds-zero3"}, 2),
)

# The options as columns, grouped as `llmem estimate --help` groups them
FEATURES: tuple[Feature, ...] = (
    Feature("--lora-rank 8", {"lora_rank": 8}),
    Feature("--qlora", {"lora_rank": 8, "quant_base": "nf4"}, group="quant"),
    Feature("--load-in-8bit", {"lora_rank": 8, "quant_base": "int8"}, group="quant"),
    Feature("--qlora-torchao", {"lora_rank": 8, "quant_base": "torchao-nf4", "precision": "bf16",
                                "adapter_dtype": "base"}, group="quant"),
    Feature("--grad-ckpt", {"grad_ckpt": True}),
    Feature("--ac-policy op", {"ac_policy": "op"}),
    Feature("--attn flash", {"attn": "flash"}, group="attn"),
    Feature("--attn eager", {"attn": "eager"}, group="attn"),
    Feature("--fused-ce", {"fused_ce": True}),
    Feature("--packing", {"packing": True}),
    Feature("--offload-activations", {"offload_activations": True}),
    Feature("--optimizer adamw-8bit", {"optimizer": "adamw-8bit"}, group="opt"),
    Feature("--optimizer adafactor", {"optimizer": "adafactor"}, group="opt"),
    Feature("--optimizer muon", {"optimizer": "muon"}, group="opt"),
    Feature("--offload-optimizer", {"offload_optimizer": True}),
    Feature("--optimizer-in-backward", {"optimizer_in_backward": True}),
    Feature("--offload-param", {"offload_param": True}),
    Feature("--objective dpo", {"objective": "dpo"}, group="obj"),
    Feature("--objective kto", {"objective": "kto"}, group="obj"),
    Feature("--objective reward", {"objective": "reward"}, group="obj"),
    Feature("--objective grpo", {"objective": "grpo", "num_generations": 2, "max_completion_length": 16}, group="obj"),
    Feature("--pp 2", {"pp": 2, "precision": "bf16"}, 2),
    Feature("--cp 2", {"cp": 2}, 2),
    Feature("--ep 2", {"ep": 2}, 1, MOE_MODEL),
    Feature("--dp-replicate 2", {"dp_replicate": 2}, 2),
    Feature("--sequence-parallel", {"sequence_parallel": True}),
    Feature("--loss-parallel", {"loss_parallel": True}),
)


def combine(*parts: Feature) -> tuple[dict, str]:
    """The set-up fields of `parts` together (later precision / batch rules win) and the model they run on."""
    fields: dict = {"seq_len": SEQ_LEN}
    gpus = 1
    model = MODEL
    for part in parts:
        fields.update(part.fields)
        gpus *= part.gpu_factor
        model = part.model if part.model != MODEL else model
    if fields.get("objective") in ("grpo", "kto"):   # GRPO's generations divide the global batch; KTO's KL term
        fields["batch_size"] = 2                      # pairs a sample with a neighbour's completion
    if fields.get("pp", 1) > 1:
        fields["batch_size"] = max(fields.get("batch_size", 1), 2)
    fields["gpus"] = gpus
    return fields, model


def answer(*parts: Feature) -> str | None:
    """None when `llmem estimate` answers the combination, else the first line of its refusal."""
    from llmem import estimate
    from llmem.errors import LlmemError

    fields, model = combine(*parts)
    try:
        estimate(model, **fields)
    except LlmemError as exc:
        return _method_free(str(exc).splitlines()[0], fields.get("method", ""))
    return None


def _method_free(why: str, method: str) -> str:
    """The refusal with the method it was asked under written as <method>, so that one rule is cited once."""
    for before, after in ((f"(got {method})", "(got <method>)"), (f"got {method}", "got <method>"),
                          (f"with {method}:", "with <method>:"), (f"under {method} ", "under <method> ")):
        why = why.replace(before, after)
    return why


class Reasons:
    """Refusal lines numbered in the order first met, so a table cell can cite one by number."""

    def __init__(self) -> None:
        self.lines: dict[str, int] = {}

    def cite(self, why: str | None) -> str:
        if why is None:
            return "yes"
        number = self.lines.setdefault(why, len(self.lines) + 1)
        return f"no [{number}]"


def method_table(reasons: Reasons) -> list[str]:
    head = ["option"] + [m.label for m in METHOD_ROWS]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows.append("| (none) | " + " | ".join(reasons.cite(answer(m)) for m in METHOD_ROWS) + " |")
    for feature in FEATURES:
        cells = [reasons.cite(answer(m, feature)) for m in METHOD_ROWS]
        rows.append(f"| `{feature.label}` | " + " | ".join(cells) + " |")
    return rows


def pair_cell(a: Feature, b: Feature, reasons: Reasons) -> str:
    """Under which methods `a` and `b` run together: the first method (in METHOD_ROWS' order) that answers, or the
    refusal of the first method tried."""
    first: str | None = None
    for method in METHOD_ROWS:
        why = answer(method, a, b)
        if why is None:
            return method.label
        first = first or why
    return reasons.cite(first)


def pair_table(reasons: Reasons) -> list[str]:
    rows = ["| option | with | runs under (first method that answers) |", "|---|---|---|"]
    for i, a in enumerate(FEATURES):
        for b in FEATURES[i + 1:]:
            if a.group and a.group == b.group:
                continue
            rows.append(f"| `{a.label}` | `{b.label}` | {pair_cell(a, b, reasons)} |")
    return rows


def rules_by_option() -> list[str]:
    """The support tables themselves (llmem.setup.support.SUPPORT), one list per feature in the order they are
    checked: what each option is not modelled with."""
    from llmem.setup.support import SUPPORT

    lines: list[str] = []
    for row in SUPPORT.values():
        others = dict.fromkeys(r.other for r in row.refusals)       # in order, each once
        lines += [f"- **{row.feature}** is not modelled with: " + "; ".join(others) + "."]
    return lines


def page() -> str:
    reasons = Reasons()
    methods = method_table(reasons)
    pairs = pair_table(reasons)
    lines = [
        "# Which options combine",
        "",
        "Generated by `docs/make_support.py` (do not edit by hand): every cell is one `llmem estimate` of "
        f"`{MODEL}` at {SEQ_LEN} tokens (`{MOE_MODEL}` for `--ep`), so each answer is the engine's own - the "
        "set-up's validation, the support check every engine runs (`llmem.setup.support.check_support`) and the "
        "estimator's refusals. \"no [n]\" cites the refusal line numbered below; `trace` and `measure` refuse the "
        "same set-ups (they resolve through the same check).",
        "",
        "## Each option under each method",
        "",
        "Methods at 2 GPUs (fsdp+tp: 2 dp x 2 tp; single: 1); options that need more GPUs (`--pp`, `--cp`, "
        "`--dp-replicate`) double them.",
        "",
        *methods,
        "",
        "## Two options together",
        "",
        "The first method, in the order of the table above, under which the two answer; \"no [n]\" where none does "
        "(the reason the first method gave).",
        "",
        *pairs,
        "",
        "## Refusals",
        "",
        *[f"{n}. {why}" for why, n in reasons.lines.items()],
        "",
        "## The rules, by option",
        "",
        "The support tables every engine reads (`llmem.setup.support.SUPPORT`), in the order they are checked: the "
        "first that applies is the refusal a user reads. A single option's own range or name, and the methods a "
        "layout degree runs under (`--pp`, `--cp`, `--ep`, `--dp-replicate`), are checked where the set-up is built.",
        "",
        *rules_by_option(),
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    sys.stdout.write(page())
    return 0


if __name__ == "__main__":
    sys.exit(main())
