"""Launch configs for a plan (`llmem plan --export KIND PATH`): an accelerate YAML, a torchrun script, a DeepSpeed
JSON for the recommended layout, batch and accumulation (or, when nothing fits, the fastest offload suggestion's:
FSDP2's CPUOffloadPolicy is accelerate's fsdp_offload_params, the training script's --offload-optimizer and, on a
ZeRO-3 stand-in, DeepSpeed's offload_param).

The torchrun script launches the training script llmem ships (`python -m llmem.runtime.train_script`, run by
torchrun's `-m`) with exactly the flags that script reads (checked against its own parser when exported). The
DeepSpeed JSON says in its "comment" that llmem estimated PyTorch's method (FSDP2, DDP or tensor parallelism), whose
memory differs from DeepSpeed ZeRO's; `ExportPlan.notes` carries the same for the command line."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace

from llmem.errors import LlmemError
from llmem.planner.export_torchtitan import export_torchtitan
from llmem.planner.export_trl import check_trl_exportable, export_trl
from llmem.planner.options import EXPORT_KINDS
from llmem.planner.plan import Plan
from llmem.planner.timing import accumulation_for
from llmem.setup.deepspeed import ZeroConfig, zero_config
from llmem.setup.layout import Layout
from llmem.setup.methods import METHODS, MethodSpec
from llmem.setup.precision import PRECISIONS
from llmem.setup.sections import ActivationsConfig
from llmem.setup.training import TrainingSetup, lora_target_regex


@dataclass(frozen=True)
class ExportPlan:
    """What an exported config describes: one layout, its batch and accumulation, and offloading."""
    model: str
    architecture: str
    layout: Layout
    micro_batch_size: int
    accumulation_steps: int
    seq_len: int
    precision: str
    grad_ckpt: bool
    offload_optimizer: bool
    optimizer: str = "adamw"
    gpus_per_node: int | None = None
    notes: tuple[str, ...] = ()          # what the written file does not match of the estimate (for the CLI)
    zero: ZeroConfig | None = None       # DeepSpeed's ZeRO section the estimate assumed (a ds-zero layout)
    offload_param: bool = False          # FSDP2's CPUOffloadPolicy, as planned (--offload-param)
    sequence_parallel: bool = False      # TP as torchtitan applies it (a layout with tp only)
    loss_parallel: bool = False

    @property
    def cpu_offload_policy(self) -> bool:
        """FSDP2's CPUOffloadPolicy in the launch: planned (--offload-param), or FSDP2's only form of an optimizer
        offload (--offload-optimizer on an FSDP2 layout)."""
        return self.offload_param or self.offload_optimizer and self.layout.shards_model_states


# the options an export kind writes beyond the layout, batch, precision and checkpointing (the trl CLI's config:
# its trainer's objective and ModelConfig's LoRA adapters; llmem.planner.export_trl)
# the attention every export launches with: TrainingSetup's default (transformers' own, sdpa)
DEFAULT_ATTN = ActivationsConfig().attn
EXPRESSED = {"trl": ("--objective", "--lora-rank", "--ckpt-reentrant"),   # gradient_checkpointing_kwargs
             "torchtitan": ("--ac-policy", "--grad-ckpt-every")}   # [activation_checkpoint] selective op / N


def unexportable_options(setup: TrainingSetup, kind: str | None = None) -> list[str]:
    """The set-up's options that the exported launch configs (layout, batch, precision, checkpointing, optimizer
    offload) do not carry: exporting them would describe a different run than the one planned."""
    s = setup
    found = [flag for flag, on in (
        ("--lora-rank", bool(s.lora_rank)), ("--peft-config", bool(s.peft_config)),
        (f"--lora-targets {s.lora_targets}", lora_target_regex(s.lora_targets) is not None),   # TRL's is a name list
        (s.quant_spec.flag, s.quant_spec.quantised),
        (f"--optimizer {s.optimizer}", not s.optimizer_spec.adam),
        ("--optimizer-in-backward", s.optimizer_in_backward), (f"--grad-ckpt-every {s.ckpt_every}", s.ckpt_every > 1),
        ("--fused-ce", s.fused_ce), ("--offload-activations", s.offload_activations), ("--packing", s.packing),
        (f"--logits-dtype {s.logits_dtype}", s.logits_dtype != "fp32"), (f"--liger {s.liger}", s.liger != "none"),
        (f"--float8 {s.float8}", s.float8 != "none"), ("--compile", s.compile),
        (f"--attn {s.attn}", s.attn != DEFAULT_ATTN),
        (f"--objective {s.objective}", s.objective_spec.runs_trainer),
        (f"--ac-policy {s.ac_policy}", s.ac_policy != "full"), ("--ckpt-reentrant", s.ckpt_reentrant),
        # accelerate's fsdp_reshard_after_forward and torchrun's script take a bool only
        (f"--reshard-after-forward {s.reshard_after_forward}", s.reshard_after_forward is not None),
        # torchtune's custom_sharded_layers: neither accelerate's auto-wrap nor the script's units (torchtitan groups
        # the final norm with the output)
        ("--shard-embeddings", s.shard_embeddings)) if on]
    return [f for f in found if not f.startswith(EXPRESSED.get(kind, ()))]


def check_exportable(setup: TrainingSetup, flag: str = "--export", kind: str | None = None) -> None:
    """Refuse a set-up whose options no export (or the export `kind`) can write (decided by the set-up alone, so
    before any plan)."""
    if kind == "trl":
        check_trl_exportable(setup)
    extra = unexportable_options(setup, kind)
    if extra:
        raise LlmemError(f"{flag} writes the layout, batch, precision, checkpointing and optimizer offload of a "
                         f"full fine-tuning run with AdamW; it cannot express {', '.join(extra)}: plan without "
                         "--export, or export without these options")


def check_methods_exportable(setup: TrainingSetup, kind: str, methods: tuple[str, ...] | None) -> None:
    """Refuse, before any plan, an export `kind` that would refuse every plan of the searched `methods` (--method
    given: every layout, and every offload suggestion, the plan can export runs that method); and the launch style
    a kind cannot write (--sequence-parallel / --loss-parallel, decided by the set-up alone)."""
    tp_style(setup, kind)
    for name in methods or ():
        why = method_refusal(kind, METHODS[name], setup.gpus)
        if why is not None:
            raise LlmemError(why)


def method_refusal(kind: str, spec: MethodSpec, world_size: int) -> str | None:
    """Why an export `kind` cannot launch the method `spec` on `world_size` GPUs (None: it can): the one rule the
    check before a plan (the --method given, --gpus) and the writers after it (the plan's layout) both read."""
    if kind == "deepspeed" and spec.zero_stage is None and spec.deepspeed_stage is None:
        return (f"--export deepspeed: DeepSpeed has no equivalent of --method {spec.name} (its AutoTP works with ZeRO "
                "stages 0-2 only); export accelerate or torchrun for this plan")
    if kind in TORCH_EXPORTS and spec.zero_stage is not None:
        return (f"--export {kind}: --method {spec.name} runs DeepSpeed's engine: --export deepspeed writes its "
                f"config; {kind} launches PyTorch's own methods")
    if kind == "trl" and (spec.zero_stage is not None or not (spec.gradient_buckets or world_size == 1)):
        return (f"--export trl writes TRL's config with a DDP or one-GPU launch, not --method {spec.name}: plan "
                "with --method ddp (or export accelerate)")
    return None


def tp_style(setup: TrainingSetup, kind: str) -> None:
    """Refuse --sequence-parallel / --loss-parallel for a kind whose launch applies plain tensor parallelism."""
    if kind not in TP_STYLE_EXPORTS and (setup.sequence_parallel or setup.loss_parallel):
        raise LlmemError(f"--export {kind} launches plain tensor parallelism, not the planned --sequence-parallel / "
                         f"--loss-parallel: export {', '.join(TP_STYLE_EXPORTS)}, or plan without them")


OFFLOAD_SUGGESTIONS = ("offload_param", "offload_optimizer")    # what an export of a plan that fits nowhere can use


def offload_suggestion(p: Plan) -> dict:
    """The fastest offload suggestion that fits (FSDP2's CPU offload, or the optimizer's alone) and that an export
    can write, for a plan where nothing fits as given; refused when none does."""
    fitting = sorted((s for s in p.suggestions if s["kind"] in OFFLOAD_SUGGESTIONS and s["fits"]),
                     key=lambda s: -(s.get("tokens_per_s") or 0.0))
    if not fitting:
        raise LlmemError("nothing fits, not even with the parameters or the optimizer offloaded: there is no plan to "
                         "export")
    writable = [s for s in fitting if not s.get("changes", {}).get("fused_ce")]
    if not writable:
        sug = fitting[0]
        raise LlmemError(f"what fits is {sug['flags']} ({sug['label']}), and no export writes --fused-ce: plan "
                         f"with --method {sug['method']} --offload-param --grad-ckpt and export that")
    return writable[0]


def export_plan(p: Plan, kind: str | None = None) -> ExportPlan:
    """The recommended plan, or, when nothing fits, the fastest offload suggestion that fits."""
    check_exportable(p.setup, kind=kind)
    c = p.recommended
    offload = offload_param = False
    grad_ckpt = p.setup.grad_ckpt
    if c is None:
        sug = offload_suggestion(p)
        layout = next(lay for lay in p.what_if_layouts if lay.label == sug["label"])    # the one it was searched on
        micro, steps = accumulation_for(p.options.global_batch, sug["max_batch_size"], layout.dp)
        offload, offload_param = sug["kind"] == "offload_optimizer", sug["kind"] == "offload_param"
        grad_ckpt = grad_ckpt or bool(sug.get("changes", {}).get("grad_ckpt"))
    else:
        layout = c.layout
        micro, steps = c.time.micro_batch_size, c.time.accumulation_steps
    stage = layout.spec.zero_stage
    zero = None if stage is None else zero_config(replace(p.setup, offload_optimizer=offload or
                                                          p.setup.offload_optimizer), stage, p.anatomy.hidden_size)
    return ExportPlan(p.anatomy.name, p.anatomy.architecture, layout, micro, steps, p.setup.seq_len,
                      p.setup.precision, grad_ckpt, offload or p.setup.offload_optimizer, p.setup.optimizer,
                      layout.gpus_per_node, zero=zero, offload_param=offload_param or p.setup.offload_param,
                      sequence_parallel=p.setup.sequence_parallel and layout.spec.has_tp,
                      loss_parallel=p.setup.loss_parallel and layout.spec.has_tp)


def export_accelerate(e: ExportPlan, layer_cls: str) -> str:
    """An `accelerate launch --config_file` YAML for the plan (FSDP2 with a ParallelismConfig for tp)."""
    import yaml

    lay = e.layout
    cfg: dict = {
        "compute_environment": "LOCAL_MACHINE", "debug": False, "downcast_bf16": "no", "machine_rank": 0,
        "main_training_function": "main", "mixed_precision": PRECISIONS[e.precision].accelerate,
        "num_machines": lay.nodes, "num_processes": lay.world_size, "rdzv_backend": "static",
        "same_network": True, "use_cpu": False, "enable_cpu_affinity": False,
    }
    if lay.world_size == 1:
        cfg["distributed_type"] = "NO"
    elif lay.spec.gradient_buckets:
        cfg["distributed_type"] = "MULTI_GPU"
    else:
        cfg["distributed_type"] = "FSDP"
        cfg["fsdp_config"] = {
            "fsdp_version": 2,
            # FSDP2's default (reshard) unless the method keeps parameters gathered (zero2); pure TP: no FSDP shards
            "fsdp_reshard_after_forward": lay.spec.reshard_after_forward or not lay.spec.shards_model_states,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": layer_cls,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_offload_params": e.cpu_offload_policy,
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_activation_checkpointing": e.grad_ckpt,
        }
        if lay.tp > 1 or lay.replicas > 1:      # accelerate's ParallelismConfig: HSDP's replicas, TP's size
            cfg["parallelism_config"] = {
                "parallelism_config_dp_replicate_size": lay.replicas,
                "parallelism_config_dp_shard_size": lay.shard_degree,
                "parallelism_config_tp_size": lay.tp,
                "parallelism_config_cp_size": 1,
            }
    header = [
        f"# llmem plan for {e.model}: {lay.label} on {lay.world_size} GPU(s), {lay.nodes} node(s)",
        f"# per-GPU micro-batch {e.micro_batch_size}, gradient accumulation {e.accumulation_steps}, "
        f"seq {e.seq_len}, {e.precision}{', gradient checkpointing' if e.grad_ckpt else ''}",
    ]
    if e.offload_param:
        header.append("# fsdp_offload_params: FSDP2's CPUOffloadPolicy, as planned (--offload-param): parameters, "
                      "gradients and the optimizer step on the CPU")
    elif e.offload_optimizer:
        header.append("# FSDP2 has no optimizer-only offload: fsdp_offload_params moves parameters, gradients and "
                      "optimizer states to the CPU")
    if lay.spec.gradient_buckets and e.grad_ckpt:
        header.append("# enable gradient checkpointing in the script: model.gradient_checkpointing_enable()")
    if lay.nodes > 1:
        header.append("# set machine_rank, main_process_ip and main_process_port per node")
    return "\n".join(header) + "\n" + yaml.safe_dump(cfg, sort_keys=True)


def train_script_args(e: ExportPlan) -> list[str]:
    """The flags of llmem's training script (llmem.runtime.train_script) for the plan, checked by its own parser."""
    from llmem.runtime.train_script import SCRIPT_OPTIMIZERS, build_parser

    lay = e.layout
    if e.optimizer not in SCRIPT_OPTIMIZERS:
        raise LlmemError(f"--export torchrun: llmem's training script builds {', '.join(SCRIPT_OPTIMIZERS)}, not "
                         f"--optimizer {e.optimizer}: export accelerate for your own script")
    if e.offload_optimizer and not lay.spec.shards_model_states:
        raise LlmemError(f"--export torchrun: the optimizer offload of {lay.label} is DeepSpeed's ZeRO-Offload, which "
                         "PyTorch has no native form of: export deepspeed for this plan")
    args = ["--model", e.model, "--method", lay.method, "--dp", str(lay.dp), "--tp", str(lay.tp),
            *(("--dp-replicate", str(lay.replicas)) if lay.replicas > 1 else ()),
            "--micro-batch-size", str(e.micro_batch_size), "--gradient-accumulation-steps", str(e.accumulation_steps),
            "--seq-len", str(e.seq_len), "--precision", e.precision, "--optimizer", e.optimizer,
            "--gpus-per-node", str(e.gpus_per_node or lay.gpus_per_node)]
    if e.grad_ckpt:
        args.append("--grad-ckpt")
    args += [flag for flag, on in (("--sequence-parallel", e.sequence_parallel), ("--loss-parallel", e.loss_parallel))
             if on]
    if e.offload_optimizer or e.cpu_offload_policy:
        args.append("--offload-optimizer")   # the script's flag for FSDP2's CPUOffloadPolicy
    build_parser().parse_args(args)          # the script reads exactly these flags
    return args


def export_torchrun(e: ExportPlan) -> str:
    """A shell script launching llmem's training script with torchrun for the plan (extra flags such as --steps,
    --data or --pretrained pass through)."""
    from llmem.runtime.train_script import MODULE

    lay = e.layout
    per_node = lay.world_size // lay.nodes
    launcher = ["torchrun", "--nnodes", str(lay.nodes), "--nproc_per_node", str(per_node)]
    if lay.nodes == 1:
        launcher.append("--standalone")
    else:
        launcher += ["--node_rank", '"${NODE_RANK:?set NODE_RANK}"', "--rdzv_backend", "c10d",
                     "--rdzv_endpoint", '"${MASTER_ADDR:?set MASTER_ADDR}:${MASTER_PORT:-29500}"']
    script = ["-m", MODULE] + [shlex.quote(a) for a in train_script_args(e)]
    lines = [
        "#!/usr/bin/env bash",
        f"# llmem plan for {e.model}: {lay.label} on {lay.world_size} GPU(s), {lay.nodes} node(s)",
        f"# runs llmem's training script (python -m {MODULE} --help): random weights and tokens unless you add",
        "# --pretrained and --data TOKENS.npy; --steps N (default 10). It builds what llmem estimated:",
        f"# {lay.spec.torch_recipe.format(dp=lay.dp, tp=lay.tp)}",
        "# run it where llmem is installed (torchrun from the same environment)",
        "set -euo pipefail",
        " ".join(launcher + script) + ' "$@"',
        "",
    ]
    return "\n".join(lines)


def deepspeed_note(e: ExportPlan) -> str:
    """What the DeepSpeed JSON's memory is: llmem estimated PyTorch's method, not DeepSpeed's ZeRO."""
    lay = e.layout
    return (f"llmem estimated this plan's memory for PyTorch's {lay.method} "
            f"({lay.spec.torch_recipe.format(dp=lay.dp, tp=lay.tp)}), not for DeepSpeed: DeepSpeed ZeRO stage "
            f"{lay.spec.deepspeed_stage}'s memory differs from it (its own gradient and optimizer-state handling, "
            f"buckets and communication buffers); check micro-batch {e.micro_batch_size} with a short DeepSpeed run")


def export_deepspeed(e: ExportPlan) -> str:
    """A DeepSpeed JSON config: a ds-zero plan's ZeRO section as the estimate assumed it; for PyTorch's methods
    their nearest stage (ZeRO-3 for fsdp, ZeRO-2 for zero2, ZeRO-0 for ddp, AutoTP for tp), said not to match."""
    lay = e.layout
    stage = lay.spec.deepspeed_stage
    if e.zero is not None:
        return json.dumps(deepspeed_json(e, e.zero.to_json()), indent=2) + "\n"
    why = method_refusal("deepspeed", lay.spec, lay.world_size)
    if why is not None:
        raise LlmemError(why)
    zero: dict = {"stage": stage}
    if stage >= 2:
        zero.update({"overlap_comm": True, "contiguous_gradients": True})
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if e.offload_param and stage != 3:
        raise LlmemError(f"the plan offloads parameters (FSDP2's CPUOffloadPolicy on {lay.label}) and DeepSpeed "
                         "offloads them under ZeRO-3 only: export accelerate or torchrun for this plan")
    if e.offload_optimizer or e.offload_param:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 0:
            zero["stage"] = 1            # DeepSpeed offloads the optimizer from ZeRO stage 1 on
    if e.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg = deepspeed_json(e, zero)
    cfg = {"comment": deepspeed_note(e), **cfg}
    if lay.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": lay.tp}
    return json.dumps(cfg, indent=2) + "\n"


def deepspeed_json(e: ExportPlan, zero: dict) -> dict:
    """A DeepSpeed JSON around its `zero_optimization` block: the batch, accumulation and precision of the plan."""
    cfg: dict = {
        "train_micro_batch_size_per_gpu": e.micro_batch_size,
        "gradient_accumulation_steps": e.accumulation_steps,
        "train_batch_size": e.micro_batch_size * e.accumulation_steps * e.layout.dp,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
    }
    if PRECISIONS[e.precision].compute_dtype == "bfloat16":
        cfg["bf16"] = {"enabled": True}
    elif PRECISIONS[e.precision].compute_dtype == "float16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1}
    return cfg


# one writer per --export kind (llmem.planner.options.EXPORT_KINDS): (plan, its export, PATH) -> the files to write,
# {path: text}: PATH's, and any written beside it (trl's accelerate config)
EXPORTERS: dict[str, Callable[[Plan, ExportPlan, str], dict[str, str]]] = {
    "accelerate": lambda p, e, path: {path: export_accelerate(e, p.anatomy.decoder_layer_class)},
    "torchrun": lambda p, e, path: {path: export_torchrun(e)},
    "deepspeed": lambda p, e, path: {path: export_deepspeed(e)},
    "torchtitan": lambda p, e, path: {path: export_torchtitan(p, e)},
    "trl": lambda p, e, path: export_trl(p, e, path, export_accelerate(e, p.anatomy.decoder_layer_class)
                                         if e.layout.world_size > 1 else None),
}
EXECUTABLE_EXPORTS = ("torchrun",)      # written as a script the user runs
# what a kind's file does not match of the estimate, for the command line to print beside "wrote ..."
EXPORT_NOTES: dict[str, Callable[[ExportPlan], str]] = {"deepspeed": deepspeed_note}
# kinds that launch PyTorch's own methods: a plan of DeepSpeed's engine is exported as its JSON
TORCH_EXPORTS = ("accelerate", "torchrun", "torchtitan")
TP_STYLE_EXPORTS = ("torchtitan", "torchrun")   # kinds whose launch applies SequenceParallel and loss_parallel()


def write_export(p: Plan, kind: str, path: str) -> ExportPlan:
    writer = EXPORTERS.get(kind)
    if writer is None:
        raise LlmemError(f"unknown export {kind!r}: choose {', '.join(EXPORT_KINDS)}")
    tp_style(p.setup, kind)
    e = export_plan(p, kind)
    if (e.layout.pp > 1 or e.layout.cp > 1 or e.layout.ep > 1) and kind != "torchtitan":  # pp / cp / ep planned
        raise LlmemError(f"the plan runs {e.layout.label}, which only --export torchtitan writes (its "
                         f"pipeline_parallel_degree / context_parallel_degree / expert_parallel_degree): export "
                         "torchtitan")
    why = method_refusal(kind, e.layout.spec, e.layout.world_size)
    if why is not None:
        raise LlmemError(why)
    files = writer(p, e, path)          # refusals before any file is opened
    notes = (EXPORT_NOTES[kind](e),) if kind in EXPORT_NOTES and e.zero is None else ()
    notes += tuple(f"the accelerate config beside it: {name} (its accelerate_config)" for name in files if name != path)
    for name, text in files.items():
        with open(name, "w", encoding="utf-8") as f:
            f.write(text)
    if kind in EXECUTABLE_EXPORTS:
        os.chmod(path, 0o755)
    return replace(e, notes=notes) if notes else e
