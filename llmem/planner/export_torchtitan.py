"""`llmem plan --export torchtitan PATH`: a torchtitan train-config TOML for the planned layout, batch and
checkpointing, in the [parallelism] schema (torchtitan 0.1-0.2's `--job.config_file`; llmem's `--from` reads it
back to the same set-up). torchtitan 0.3 replaced the TOMLs by Python presets (`--module llama3 --config
llama3_70b`) with command-line overrides of the same fields (tyro, torchtitan/config/manager.py): the file's header
gives that command line too, or says in one line why 0.3 cannot run the plan. In 0.3 the activation checkpointing
is a tyro subcommand of Trainer.Config's `activation_checkpoint` union (torchtitan/distributed/
activation_checkpoint.py ActivationCheckpointingConfig: selective, full, memory-budget or none), and each preset
picks one (llama3_8b selective, llama3_70b / 405b full): the command line names the planned one. 0.3's
`selective` is per-op (its SelectiveAC: the compute-intensive ops' outputs saved, every second matmul
recomputed), llmem's --ac-policy op; it has no every-k-layers option, and presets of llama3 8B, 70B and 405B only
(Trainer.Config's model_spec is not a command-line field).

What torchtitan runs and the plan must match: FSDP2 over data_parallel_shard_degree (HSDP with
data_parallel_replicate_degree), DDP-style replication alone when the shard degree is 1, TP with SequenceParallel
and loss parallel (torchtitan's parallelize_llama applies both), MixedPrecisionPolicy(bf16 params, fp32 reduce) or
fp32, its own AdamW (torch's, `implementation` fused or foreach), `[activation_checkpoint]` none / full /
selective. What it cannot express is refused (one line): a model without a torchtitan flavor, DeepSpeed's engine,
fp16, another optimizer, the optimizer alone offloaded.
"""

from __future__ import annotations

from llmem.errors import LlmemError
from llmem.setup.pipeline import torchtitan_pipeline
from llmem.setup.sources.torchtitan import FLAVORS, IMPLEMENTATIONS, PRECISION

# llmem's names -> torchtitan's (the reader's maps, inverted: one table serves both directions)
TORCHTITAN_FLAVORS = {hub: (name, flavor) for (name, flavor), hub in FLAVORS.items()}
TORCHTITAN_IMPLEMENTATIONS = {opt: impl for impl, opt in IMPLEMENTATIONS.items()}
TORCHTITAN_PARAM_DTYPES = {"bf16-mixed": "bfloat16", "fp32": "float32"}
assert set(TORCHTITAN_PARAM_DTYPES.values()) <= set(PRECISION)


def _flavor(model: str, layout) -> tuple[str, str]:
    got = TORCHTITAN_FLAVORS.get(model)
    if got is None:     # a pp / cp / ep layout has no other export (llmem.planner.export.write_export)
        fix = "export accelerate or torchrun" if layout.pp == layout.cp == layout.ep == 1 else \
            f"no other export launches {layout.label}: plan with --layouts dp-tp and export accelerate or torchrun"
        raise LlmemError(f"--export torchtitan: torchtitan has no model flavor llmem knows for {model} (it knows "
                         f"{', '.join(sorted(TORCHTITAN_FLAVORS))}): {fix}")
    name, flavor = got
    return name, flavor.upper()                              # torchtitan's flavors: "8B", "70B", ...


def _check(p, e) -> None:
    lay, setup = e.layout, p.setup
    if e.precision not in TORCHTITAN_PARAM_DTYPES:
        raise LlmemError(f"--export torchtitan: torchtitan trains bf16-mixed (MixedPrecisionPolicy) or fp32, not "
                         f"{e.precision}: plan with --precision bf16-mixed")
    if e.optimizer not in TORCHTITAN_IMPLEMENTATIONS:
        raise LlmemError(f"--export torchtitan: torchtitan's optimizer is torch's AdamW (fused or foreach), not "
                         f"--optimizer {e.optimizer}: plan with --optimizer adamw or adamw-fused")
    if e.offload_optimizer and not e.cpu_offload_policy:
        raise LlmemError(f"--export torchtitan: {lay.label} offloads the optimizer alone, which torchtitan cannot "
                         "(its enable_cpu_offload is FSDP2's CPUOffloadPolicy): plan with --method fsdp "
                         "--offload-param")
    if setup.reshard_after_forward is not None:
        raise LlmemError(f"torchtitan's fsdp_reshard_after_forward is default / always / never, not FSDP2's int "
                         f"(--reshard-after-forward {setup.reshard_after_forward}): plan without it to export torchtitan")
    if lay.spec.has_tp and not (setup.sequence_parallel and setup.loss_parallel):
        raise LlmemError("--export torchtitan: torchtitan's TP applies SequenceParallel and loss parallel, which "
                         "this plan did not estimate: plan with --sequence-parallel --loss-parallel")


# torchtitan 0.3's presets (torchtitan/models/llama3/config_registry.py) and activation checkpointing subcommands,
# by the 0.1-0.2 [activation_checkpoint] section written for the same plan (mode, selective_ac_option)
TORCHTITAN_03_PRESETS = {("llama3", "8B"): "llama3_8b", ("llama3", "70B"): "llama3_70b",
                         ("llama3", "405B"): "llama3_405b"}
TORCHTITAN_03_AC = {("none", None): "activation-checkpoint:none", ("full", None): "activation-checkpoint:full",
                    ("selective", "op"): "activation-checkpoint:selective"}


def _activation_checkpoint(setup, grad_ckpt: bool) -> dict:
    if getattr(setup, "ac_policy", "full") == "op" and grad_ckpt:
        return {"mode": "selective", "selective_ac_option": "op"}
    if grad_ckpt and setup.ckpt_every > 1:
        return {"mode": "selective", "selective_ac_option": str(setup.ckpt_every)}
    return {"mode": "full" if grad_ckpt else "none"}


def _planned_microbatches(p, e) -> int:
    """The pipeline micro-batches per step of the plan's chosen pipeline layout (its micro-batch size is
    e.micro_batch_size: llmem.planner.search.layout_setup); 1 otherwise."""
    c = getattr(p, "recommended", None)
    if e.layout.pp > 1 and c is not None and c.layout == e.layout and c.time is not None:
        return c.time.pp_microbatches
    return 1


def torchtitan_sections(p, e) -> dict[str, dict]:
    """The TOML's sections for the plan (what torchtitan reads; the reader's names)."""
    _check(p, e)
    lay = e.layout
    name, flavor = _flavor(e.model, lay)
    # torchtitan folds cp into FSDP2's mesh itself: data_parallel_shard_degree is dp_shard alone
    shards = lay.dp // lay.replicas if lay.shards_model_states else 1
    replicas = lay.replicas if lay.shards_model_states else lay.dp       # ddp: replication alone
    microbatches = _planned_microbatches(p, e)      # a planned pipeline: m micro-batches of the planned size
    local = e.micro_batch_size * microbatches
    training = {"local_batch_size": local,
                "global_batch_size": local * e.accumulation_steps * lay.dp,
                "seq_len": e.seq_len, "mixed_precision_param": TORCHTITAN_PARAM_DTYPES[e.precision],
                "mixed_precision_reduce": "float32"}
    if e.cpu_offload_policy:
        training["enable_cpu_offload"] = True
    parallelism = {"data_parallel_replicate_degree": replicas, "data_parallel_shard_degree": shards,
                   "tensor_parallel_degree": lay.tp, "pipeline_parallel_degree": 1,
                   "context_parallel_degree": lay.cp,
                   "expert_parallel_degree": lay.ep}     # torchtitan's EP borrows from dp_shard (efsdp x ep)
    if getattr(lay, "pp", 1) > 1:   # the schedule, micro-batch size and stages per rank (llmem.setup.pipeline)
        parallelism.update(torchtitan_pipeline(lay.pp, p.setup.pp_schedule, local // microbatches,
                                               p.anatomy.num_layers, p.setup.pp_virtual_stages))
    if lay.shards_model_states and not lay.spec.reshard_after_forward:
        parallelism["fsdp_reshard_after_forward"] = "never"
    return {"job": {"description": f"llmem plan: {lay.label}"},
            "model": {"name": name, "flavor": flavor},
            "optimizer": {"name": "AdamW", "implementation": TORCHTITAN_IMPLEMENTATIONS[e.optimizer]},
            "training": training, "parallelism": parallelism,
            "activation_checkpoint": _activation_checkpoint(p.setup, e.grad_ckpt)}


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _overrides(sections: dict[str, dict]) -> str:
    """torchtitan 0.3's command-line overrides of the same fields (tyro: --section.key value, a bool a bare flag)."""
    out = []
    for sec in ("optimizer", "training", "parallelism"):
        for k, v in sections[sec].items():
            if k != "name":
                out.append(f"--{sec}.{k}" if v is True else f"--{sec}.{k} {v}")
    return " ".join(out)


def torchtitan_03_command(launch: str, sections: dict[str, dict]) -> str:
    """The torchtitan 0.3 command line that runs the plan, or why 0.3 cannot (one line)."""
    name, flavor = sections["model"]["name"], sections["model"]["flavor"]
    preset = TORCHTITAN_03_PRESETS.get((name, flavor))
    if preset is None:
        return (f"cannot run this plan: 0.3 has presets of llama3 8B, 70B and 405B only, not {name} {flavor} "
                "(its model is not a command-line field); use 0.1-0.2 with this file")
    ac = sections["activation_checkpoint"]
    subcommand = TORCHTITAN_03_AC.get((ac["mode"], ac.get("selective_ac_option")))
    if subcommand is None:
        return (f"cannot run this plan: 0.3's activation checkpointing is full, selective (per op), memory-budget "
                f"or none, with no every-{ac['selective_ac_option']}-layers option; use 0.1-0.2 with this file")
    # 0.3 captures the forward and backward in a CUDA graph unless told not to (TrainingConfig.disable_cuda_graphs;
    # it refuses the capture under PP): llmem plans the eager step, whose allocations the graph's pool would not follow
    return f"{launch} --module {name} --config {preset} {_overrides(sections)} --training.disable_cuda_graphs {subcommand}"


def export_torchtitan(p, e) -> str:
    sections = torchtitan_sections(p, e)
    lay = e.layout
    per_node = min(lay.world_size, e.gpus_per_node or lay.gpus_per_node)
    launch = f"torchrun --nproc_per_node {per_node} --nnodes {lay.nodes} -m torchtitan.train"
    header = [
        f"# llmem plan for {e.model}: {lay.label} on {lay.world_size} GPU(s), {lay.nodes} node(s); per-GPU "
        f"micro-batch {e.micro_batch_size}, gradient accumulation {e.accumulation_steps}, seq {e.seq_len}",
        f"# torchtitan 0.1-0.2: {launch} --job.config_file THIS_FILE",
        f"# torchtitan 0.3+:   {torchtitan_03_command(launch, sections)}",
    ]
    if lay.nodes > 1:
        header.append("# multi-node: add --node_rank, --rdzv_endpoint (or your launcher's equivalents) per node")
    body = []
    for sec, kv in sections.items():
        body.append(f"\n[{sec}]")
        body += [f"{k} = {_toml_value(v)}" for k, v in kv.items()]
    return "\n".join(header) + "\n" + "\n".join(body).lstrip("\n") + "\n"
