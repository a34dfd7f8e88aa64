"""Adapters over a frozen base: LoRA on the base as given, and QLoRA over a 4-bit NF4 base as each framework runs
it, each tried with the activation savers that matter most for them."""

from __future__ import annotations

from dataclasses import dataclass

from llmem.planner.search import CandidatePlan, PlanContext, frozen_base_trainable_params
from llmem.planner.suggestions.fitting import applied, best_fitting
from llmem.planner.suggestions.record import closest_plan, describe_fit, suggestion_dict, time_cost_pct
from llmem.setup.layout import Layout
from llmem.setup.training import LORA_ALL_LINEAR, TrainingSetup

LORA_RANK = 16
LORA_TARGETS = LORA_ALL_LINEAR


@dataclass(frozen=True)
class AdapterMenu:
    """Adapters over a frozen base, tried with the activation savers that matter most for them."""
    kind: str
    title: str
    changes: tuple[tuple[str, object], ...]
    flags: str
    sharded: bool | None = None     # only layouts that shard model states (True), that replicate them (False), any


# (field, value, flag) sets tried on top of each adapter menu, cheapest in time first
ADAPTER_VARIANTS: tuple[tuple[tuple[str, object, str], ...], ...] = (
    (),
    (("fused_ce", True, "--fused-ce"),),
    (("grad_ckpt", True, "--grad-ckpt"),),
    (("grad_ckpt", True, "--grad-ckpt"), ("fused_ce", True, "--fused-ce")),
)


def adapter_menus(setup: TrainingSetup) -> list[AdapterMenu]:
    """LoRA r16 on all linear layers over the base as given, and the same over a 4-bit NF4 base as each framework
    runs it:
    - QLoRA, HF/TRL's recipe: bitsandbytes NF4 with prepare_model_for_kbit_training's fp32 upcast, under autocast
      (TRL's bf16=True; so pure bf16 becomes bf16-mixed), on one GPU or DDP;
    - FSDP-QLoRA on several GPUs (Answer.AI's recipe, TRL, axolotl): the NF4 weights packed in the compute dtype
      (bnb_4bit_quant_storage) and sharded by FSDP2 / zero2, without the upcast (TRL and axolotl skip it there);
    - for a pure bf16 / fp32 set-up with LoRA, torchtune's QLoRA: torchao's NF4Tensor, adapters in the model dtype,
      no upcast, on any layout.
    A set-up that already trains adapters gets the QLoRA menus on its own adapters; a quantised one gets none."""
    if setup.quant_spec.quantised:
        return []
    lora = (("lora_rank", LORA_RANK), ("lora_targets", LORA_TARGETS))
    lora_flags = f"--lora-rank {LORA_RANK} --lora-targets {LORA_TARGETS}"
    menus = []
    if not setup.peft:
        menus.append(AdapterMenu("lora", f"LoRA r={LORA_RANK} on all linear layers", lora, lora_flags))
    else:
        lora, lora_flags = (), ""
    with_lora = f" with LoRA r={LORA_RANK} on all linear layers" if lora else " with the given adapters"
    mixed = {"bf16": "bf16-mixed", "fp16": "fp16-mixed"}.get(setup.precision)
    precision = (("precision", mixed),) if mixed else ()

    def flags(*parts: str) -> str:
        return " ".join(f for f in (*parts, lora_flags, f"--precision {mixed}" if mixed else "") if f)

    menus.append(AdapterMenu("qlora", "QLoRA (bitsandbytes 4-bit NF4 base, double quantisation)" + with_lora,
                             (("quant_base", "nf4"),) + lora + precision, flags("--qlora"),
                             sharded=False if setup.gpus > 1 else None))
    if setup.gpus > 1:
        menus.append(AdapterMenu(
            "fsdp-qlora", "FSDP-QLoRA (NF4 base packed in the compute dtype and sharded, no kbit upcast)" + with_lora,
            (("quant_base", "nf4"), ("kbit_upcast", False)) + lora + precision,
            flags("--qlora", "--no-kbit-upcast"), sharded=True))
    if setup.precision in ("bf16", "fp32") and not setup.peft_config:
        base = (("adapter_dtype", "base"),) if setup.precision == "bf16" else ()
        menus.append(AdapterMenu(
            "qlora-torchao", "torchtune's QLoRA (torchao NF4Tensor base, adapters in the model dtype)" + with_lora,
            (("quant_base", "torchao-nf4"),) + base + lora,
            " ".join(f for f in ("--qlora-torchao", "--adapter-dtype base" if base else "", lora_flags) if f)))
    return menus


def menu_suggestion(ctx: PlanContext, menu: AdapterMenu, setup: TrainingSetup, layouts: list[Layout],
                    engine_note: str) -> dict | None:
    """Every variant of the menu that fits, with its largest batch and speed; the fastest is the suggestion (None
    where the set-up's objective refuses the menu)."""
    base = applied(setup, **dict(menu.changes))
    if base is None:          # the objective refuses the menu (e.g. torchao's NF4 under TRL's trainers): not proposed
        return None
    if menu.sharded is not None:
        layouts = [lay for lay in layouts if lay.shards_model_states == menu.sharded]
    settings: list[dict] = []
    fastest: tuple[CandidatePlan, str, tuple] | None = None
    closest: CandidatePlan | None = None
    tried: set[tuple] = set()
    for variant in ADAPTER_VARIANTS:
        changes = tuple((k, v) for k, v, _ in variant if getattr(base, k) != v)   # what the set-up lacks
        if changes in tried:
            continue
        tried.add(changes)
        flags = " ".join(f for k, v, f in variant if (k, v) in changes)
        s = applied(base, **dict(changes))
        if s is None:         # the objective refuses the variant (e.g. --fused-ce under GRPO)
            continue
        best, plans = best_fitting(ctx, s, layouts)
        all_flags = " ".join(f for f in (menu.flags, flags) if f)
        pick = best or closest_plan(plans)
        if pick is not None and (closest is None
                                 or pick.memory.device_used_bytes < closest.memory.device_used_bytes):
            closest = pick
        settings.append({"flags": all_flags, "fits": best is not None,
                         "max_batch_size": best.max_batch_size if best else 0,
                         "label": pick.layout.label if pick else None,
                         "device_used_bytes": pick.memory.device_used_bytes if pick else None,
                         "tokens_per_s": best.time.tokens_per_s if best and best.time else None,
                         "time_cost_pct": time_cost_pct(ctx, best, setup)})
        if best is not None and best.time is not None and (
                fastest is None or best.time.tokens_per_s > fastest[0].time.tokens_per_s):
            fastest = (best, all_flags, changes)
    trainable = frozen_base_trainable_params(base, ctx.anatomy)
    head = f"{menu.title} ({trainable:,} trainable parameters)"
    if fastest is None:
        text = f"{head}: no setting fits — " + describe_fit(None, [closest] if closest else [], ctx.limit)
        return suggestion_dict(menu.kind, text + engine_note, closest, flags=menu.flags, settings=settings,
                           adapter_params=trainable, changes=dict(menu.changes))
    best, flags, changes = fastest
    fitting = [x for x in settings if x["fits"]]
    others = "; ".join(f"{x['flags']}: batch {x['max_batch_size']}" for x in fitting if x["flags"] != flags)
    text = (f"{head}: {flags} — {describe_fit(best, [], ctx.limit)}"
            + (f"; also fits: {others}" if others else "") + engine_note)
    return suggestion_dict(menu.kind, text, best, flags=flags, settings=settings, adapter_params=trainable,
                       time_cost_pct=time_cost_pct(ctx, best, setup),
                       changes={**dict(menu.changes), **dict(changes)})
