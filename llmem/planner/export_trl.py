"""`llmem plan --export trl PATH`: the trainer config YAML for the `trl` CLI (`trl dpo --config PATH`, `trl sft`,
`trl kto`, `trl reward`): one mapping of TrlParser's dataclasses (trl/scripts/<command>.py make_parser:
ScriptArguments, the trainer's config, ModelConfig, DatasetMixtureConfig; `trl sft` for --objective trl-sft, whose
SFTConfig states loss_type so that `--from` tells SFTConfig by it), with the planned micro-batch,
accumulation, max_length (the planned --seq-len: TRL truncates each sequence to it), checkpointing, precision,
the objective's loss options and the LoRA adapters (ModelConfig's use_peft / lora_*). On more than one GPU the
accelerate config (llmem.planner.export's) is written beside it and named by `accelerate_config`, which the CLI
turns into `accelerate launch --config_file` (trl/cli/accelerate_config.py).

Values that are TRL's defaults for the installed trl are written anyway where they decide memory (TRL's
gradient_checkpointing and bf16 default to True, unlike TrainingArguments)."""

from __future__ import annotations

import os
from dataclasses import replace

from llmem.errors import LlmemError
from llmem.planner.plan import Plan
from llmem.setup.generation import (
    GENERATION_DEFAULTS,
    beta,
    completion_length,
    num_generations,
    prompt_length,
    vllm_mode,
    vllm_utilization,
)
from llmem.setup.objectives import fixed_steps_per_generation, loss_type_of, objective_spec
from llmem.setup.precision import PRECISIONS
from llmem.setup.training import LORA_ALL_LINEAR, TrainingSetup

# llmem's precision -> (bf16, fp16, ModelConfig.dtype): TRL loads a model by name in ModelConfig.dtype (float32 by
# default) and autocasts in bf16 / fp16; pure low precision loads the weights in it
TRL_PRECISION = {"fp32": (False, False, None), "bf16-mixed": (True, False, None), "fp16-mixed": (False, True, None),
                 "bf16": (True, False, "bfloat16"), "fp16": (False, True, "float16")}


def check_trl_exportable(setup: TrainingSetup) -> None:
    """What the trl CLI cannot run as planned (one line each)."""
    spec = objective_spec(setup.objective)
    if not spec.runs_trainer:
        raise LlmemError(f"--export trl: `trl sft` runs TRL's SFTTrainer, whose loss comes from its fused LM head, not "
                         f"the full logits --objective {spec.name} estimates: plan with --objective trl-sft")
    if spec.cli_command is None:
        raise LlmemError(f"--export trl: the trl CLI has no command for --objective {spec.name} (TRL's "
                         f"{spec.trainer} lives in {spec.trainer_module}, without a script): export accelerate and "
                         "launch your own script")
    if setup.ref_dtype != "policy":
        raise LlmemError("--export trl: TRL loads the reference copy in the policy's dtype; drop --ref-dtype")
    if setup.prompt_len:
        raise LlmemError("--export trl: --prompt-len describes the data, not the trainer config; plan without it")


def trl_config(p: Plan, e) -> dict:
    """The trl CLI's mapping for the plan `p` exported as `e` (llmem.planner.export.ExportPlan)."""
    setup = p.setup
    check_trl_exportable(setup)
    spec = objective_spec(setup.objective)
    bf16, fp16, dtype = TRL_PRECISION[e.precision]
    cfg: dict = {"model_name_or_path": e.model, "attn_implementation": setup.attn,
                 "per_device_train_batch_size": e.micro_batch_size,
                 "gradient_accumulation_steps": e.accumulation_steps, "max_length": e.seq_len,
                 "gradient_checkpointing": e.grad_ckpt, "bf16": bf16, "fp16": fp16}
    if dtype is not None:
        cfg["dtype"] = dtype
    if setup.ckpt_reentrant:    # TrainingArguments passes it to gradient_checkpointing_enable
        cfg["gradient_checkpointing_kwargs"] = {"use_reentrant": True}
    if spec.beta is not None:
        cfg["beta"] = spec.beta
    if spec.generates:
        cfg.pop("max_length")             # GRPOConfig has none: the sequence is the prompt + max_completion_length
        cfg.update(generation_config(planned_generation(p, e)))
    elif spec.loss_type_list:
        cfg["loss_type"] = [loss_type_of(setup)]          # DPOConfig.loss_type is a list
    elif spec.loss_types:
        cfg["loss_type"] = loss_type_of(setup)
    if spec.keeps_reference and not spec.generates:
        cfg["precompute_ref_log_probs"] = setup.precompute_ref_log_probs
    if spec.scalar_head:      # RewardConfig's default, the one key only it has: `--from` tells the trainer by it
        cfg["center_rewards_coefficient"] = None
    if setup.lora_rank:
        targets = setup.lora_targets
        cfg.update({"use_peft": True, "lora_r": setup.lora_rank, "lora_alpha": setup.lora_alpha,
                    "lora_dropout": setup.lora_dropout,
                    "lora_target_modules": targets if targets == LORA_ALL_LINEAR else targets.split(",")})
    return cfg


# RLOOConfig's default of a key GRPOConfig has not: every other RLOO key is GRPOConfig's too, so `--from` tells
# the trainer by it (llmem.setup.sources.trl_trainers), as it tells RewardConfig by center_rewards_coefficient
GENERATION_TELLING_KEYS = {"rloo": {"normalize_advantages": False}}


def planned_generation(p: Plan, e) -> TrainingSetup:
    """The set-up with the colocated vLLM utilization the plan chose for the exported layout (plan.generation:
    llmem.planner.generation_plan), else as given."""
    g = getattr(p, "generation", None)
    if g and g.get("from") == "recommended" and g.get("label") == e.layout.label and g.get("vllm_chosen"):
        return replace(p.setup, vllm_gpu_memory_utilization=g["vllm_gpu_memory_utilization"])
    return p.setup


def generation_config(setup: TrainingSetup) -> dict:
    """GRPOConfig's generation fields as planned (trl/trainer/grpo_config.py): the sizes, beta, loss_type (where
    the config has one), the generation batch the plan estimated (its generation_batch_size when the set-up gives
    one, else its steps_per_generation: given, or --gradient-accumulation-steps, 1 unless given; written out, since
    TRL's default, the exported gradient_accumulation_steps, would generate all the accumulated micro-batches' at
    once), and vLLM's fields under --use-vllm."""
    cfg: dict = {"num_generations": num_generations(setup), "max_completion_length": completion_length(setup),
                 "beta": beta(setup)}
    defaults = GENERATION_DEFAULTS[setup.objective]
    if defaults.loss_types:              # GRPOConfig's loss_type (RLOOConfig has none)
        cfg["loss_type"] = setup.loss_type or defaults.loss_type
    cfg.update(GENERATION_TELLING_KEYS.get(setup.objective, {}))
    if setup.generation_batch_size is not None:
        cfg["generation_batch_size"] = setup.generation_batch_size
    else:
        cfg["steps_per_generation"] = fixed_steps_per_generation(setup)
    cfg["use_vllm"] = setup.use_vllm
    mode = vllm_mode(setup)
    if mode is not None:
        cfg["vllm_mode"] = mode
    if mode == "colocate":
        cfg.update({"vllm_gpu_memory_utilization": vllm_utilization(setup),
                    "vllm_enable_sleep_mode": setup.vllm_enable_sleep_mode})
        if setup.vllm_max_model_length is not None:
            cfg["vllm_max_model_length"] = setup.vllm_max_model_length
    return cfg


def trl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trl")
    except PackageNotFoundError:
        return "1.16"


def accelerate_path(path: str) -> str:
    """Where the accelerate config goes beside the trl config: PATH's stem + '.accelerate.yaml'."""
    return os.path.splitext(path)[0] + ".accelerate.yaml"


def export_trl(p: Plan, e, path: str, accelerate_text: str | None) -> dict[str, str]:
    """The files to write: the trl config at `path` and, on more than one GPU, `accelerate_text` beside it."""
    import yaml

    cfg = trl_config(p, e)
    spec = objective_spec(p.setup.objective)
    files = {}
    if e.layout.world_size > 1 and accelerate_text is not None:
        cfg["accelerate_config"] = accelerate_path(path)
        files[cfg["accelerate_config"]] = accelerate_text
    header = [f"# llmem plan for {e.model}: trl {spec.cli_command} --config {os.path.basename(path)} "
              "--dataset_name <your dataset>",
              f"# {e.layout.label} on {e.layout.world_size} GPU(s), per-GPU micro-batch {e.micro_batch_size}"
              + (" pairs" if spec.paired else "") + f", accumulation {e.accumulation_steps}, max_length "
              f"{e.seq_len} (the planned --seq-len), {e.precision} ({PRECISIONS[e.precision].compute_dtype})"]
    if spec.generates:
        s = p.setup
        header[1] = header[1].replace(f", max_length {e.seq_len} (the planned --seq-len)", "")
        header.append(f"# prompts of {prompt_length(s)} tokens + max_completion_length {completion_length(s)} = "
                      f"--seq-len {s.seq_len} as planned (trl {trl_version()} does not truncate prompts: keep yours "
                      f"to {prompt_length(s)} tokens; llmem's --from reads a 512-token prompt unless given --seq-len)")
    files[path] = "\n".join(header) + "\n" + yaml.safe_dump(cfg, sort_keys=False)
    return files
