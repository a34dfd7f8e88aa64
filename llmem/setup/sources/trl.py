"""TRL's configs and transformers' TrainingArguments (YAML or JSON): `trl sft --config` files (ModelConfig +
SFTConfig / DPOConfig / GRPOConfig fields in one mapping), and a TrainingArguments mapping (training_args.json).

TRL's defaults differ from TrainingArguments' (trl/trainer/sft_config.py): gradient_checkpointing True, bf16 True
unless fp16, max_length 1024; a model given by name loads in ModelConfig.dtype, float32 by default
(trl/trainer/model_config.py), so bf16 autocasts over fp32 weights: bf16-mixed; `dtype: bfloat16` trains bf16
weights (llmem's bf16; LoRA's fp32 adapters keep bf16-mixed). TRL never runs prepare_model_for_kbit_training: the
unquantised frozen parameters of a 4/8-bit base stay in the load dtype (fp32 under the default dtype, which
llmem's kbit upcast models). Under DeepSpeed ZeRO-3 with an unquantised base TRL builds the adapters in the base's
dtype (autocast_adapter_dtype=False, sft_trainer.py). A mapping without TRL's keys reads with TrainingArguments'
defaults (no checkpointing, no bf16, the sequence length from the command line)."""

from __future__ import annotations

from llmem.setup.generation import GENERATION_DEFAULTS
from llmem.setup.objectives import objective_spec
from llmem.setup.sources.adapters import Lora, apply_lora, targets_text
from llmem.setup.sources.deepspeed import GA_NOTE, TrainerValues
from llmem.setup.sources.evaluation import read_trainer_eval
from llmem.setup.sources.hf import (
    read_attention,
    read_bnb_4bit,
    read_checkpointing,
    read_liger,
    read_optimizer,
    trainer_distributed,
)
from llmem.setup.sources.reading import WHOLE_MODEL_COMPILE, Keys, Reading
from llmem.setup.sources.trl_trainers import TRAINER_KEYS, fit, not_modelled

# SFTConfig's sequence cap before TRL renamed it max_length (TRL 0.20): a file written for that TRL still caps there
OLD_MAX_LENGTH = "max_seq_length"
TRL_MARKS = ("model_name_or_path", "dataset_name", "max_length", OLD_MAX_LENGTH, "packing", "padding_free",
             "use_peft", "lora_r", "dataset_text_field", "completion_only_loss", "num_generations", "beta", "max_prompt_length",
             "max_completion_length", "model_init_kwargs")
PAIRED = ("dpo", "orpo", "simpo", "reward")     # per_device_train_batch_size counts pairs
REFERENCED = ("dpo", "kto")                   # precompute_ref_log_probs is theirs
GENERATING = tuple(GENERATION_DEFAULTS)       # grpo, rloo: num_generations, max_completion_length, beta, vLLM
TRL_COMMANDS = {"trl-sft": "sft", "simpo": "cpo"}   # the trl command of an objective not named alike
HF_MARKS = ("per_device_train_batch_size", "output_dir", "gradient_accumulation_steps", "optim",
            "gradient_checkpointing", "activation_checkpointing", "deepspeed", "fsdp", "learning_rate",
            "num_train_epochs")
DTYPES = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16",
          "auto": "bf16"}


def detect(data: dict) -> bool:
    return any(k in data for k in TRL_MARKS + HF_MARKS)


def read(keys: Keys, r: Reading) -> None:
    trl = any(k in keys.data for k in TRL_MARKS) or any(k in TRAINER_KEYS for k in keys.data)
    r.multi_gpu_method = "ddp"
    if "model_name_or_path" in keys:
        r.set("model_name_or_path", keys.get("model_name_or_path"), "model", str(keys.get("model_name_or_path")))
    objective = _objective(r, keys) if trl else "sft"
    batch = r.integer("per_device_train_batch_size", keys.get("per_device_train_batch_size", 8), what="a micro-batch")
    r.set("per_device_train_batch_size" + ("" if "per_device_train_batch_size" in keys else " (default)"), batch,
          "batch_size", batch, batch_note(objective))
    objective_keys(r, keys, objective)
    if objective in GENERATING:
        read_generation_batch(r, keys, GENERATION_BATCH_KEYS)
    trl_sequence(r, keys, trl, objective)
    if "gradient_accumulation_steps" in keys and objective not in GENERATING:
        r.note_used("gradient_accumulation_steps", keys.get("gradient_accumulation_steps"), GA_NOTE)
    read_optimizer(r, "optim" if "optim" in keys else "optim (transformers' default)",
                   keys.get("optim", "adamw_torch_fused"))
    read_checkpointing(r, keys, default=trl)
    if trl and "activation_offloading" in keys and r.boolean("activation_offloading", keys.get("activation_offloading")):
        r.set("activation_offloading", True, "offload_activations", True)
    init = keys.sub("model_init_kwargs")
    attn = keys.get("attn_implementation") or init.get("attn_implementation")
    if attn:
        read_attention(r, "attn_implementation", attn)
    read_liger(r, keys, fused_head=objective_spec(objective).fused_lm_head)
    _dtypes(r, keys, init, trl)
    quantised = _quantisation(r, keys)
    _adapters(r, keys, quantised)
    accum = keys.get("gradient_accumulation_steps", 1)
    trainer = TrainerValues("TrainingArguments", batch, accum if isinstance(accum, int) else None, None,
                            r.dtypes.compute == "bf16", r.dtypes.compute == "fp16")
    trainer_distributed(r, keys, trainer)
    if r.values.get("lora_rank") or r.values.get("peft_config"):
        if r.zero_stage == 3 and not quantised:
            r.dtype(adapters="base")
            r.notes.append("TRL under ZeRO-3 builds the adapters in the base's dtype (autocast_adapter_dtype=False)")
    read_trainer_eval(r, keys)
    for key, why in (("torch_compile", WHOLE_MODEL_COMPILE),
                     ("auto_find_batch_size", "the batch is the one the file states (the search halves it on OOM)")):
        if keys.get(key):
            r.ignore(key, keys.get(key), why)
    r.not_read(keys)


def batch_note(objective: str) -> str:
    """What the micro-batch counts under `objective`, for the record: pairs where chosen and rejected run as one batch
    (every framework's preference trainers alike), else nothing to say."""
    return "pairs: chosen and rejected rows run as one batch of 2x" if objective in PAIRED else ""


def _objective(r: Reading, keys: Keys) -> str:
    """The trainer the file configures, told from the keys only its config has (llmem.setup.sources.trl_trainers):
    --objective."""
    found = fit(keys.data)
    if found is None:
        raise r.error("loss_type", keys.get("loss_type"), "is no loss type of a TRL trainer llmem models whose "
                      "config takes the file's keys", "check the loss_type against the trainer's config")
    config = found.config
    shown = ", ".join(found.evidence) or "no trainer key"
    if not_modelled(config) and not found.ambiguous:
        raise r.error("(trainer)", config.name, f"is what the keys ({shown}) configure: --objective "
                      f"{config.objective} is not modelled yet", "estimate another trainer's config")
    if not found.evidence:
        note = "no key only a trainer's config has: SFTConfig assumed (trl sft); --objective decides"
    elif found.ambiguous:
        names = ", ".join(c.name for c in found.configs)
        note = (f"ambiguous: {names} all take these keys; {config.name} assumed (the trl command decides): "
                "--objective decides")
        if config.name != "SFTConfig":   # a key SFTConfig lacks: some other trainer's, which one is not known
            # their steps differ (a reference model, paired rows, generation): not the file's run for sure until
            # --objective names it
            r.ignore("(trainer)", names, f"the keys fit {names}, whose steps differ: {config.name}'s is estimated; "
                     "give --objective for the trl command you run", settled_by="objective")
    else:
        note = f"only {config.name} has these keys (trl {TRL_COMMANDS.get(config.objective, config.objective)})"
    if objective_spec(config.objective).sft_step:
        note += ("; SFTTrainer computes the loss with TRL's fused LM head (log-probs, entropy and top-1 per label "
                 "token, no [tokens, vocab] logits)")
    r.set("(trainer)", f"{config.name}: {shown}", "objective", config.objective, note)
    for key in found.strays(keys.data):
        if key != OLD_MAX_LENGTH:       # older TRL's cap: read by trl_sequence
            r.ignore(key, keys.get(key), f"not a {config.name} field: TRL's parser leaves it unused",
                     approximates=False)
    return config.objective


def objective_keys(r: Reading, keys: Keys, objective: str) -> None:
    """The trainer's own keys that decide memory (the rest are the loss's coefficients: no memory effect)."""
    if objective in REFERENCED and "precompute_ref_log_probs" in keys:
        r.set("precompute_ref_log_probs", keys.get("precompute_ref_log_probs"), "precompute_ref_log_probs",
              r.boolean("precompute_ref_log_probs", keys.get("precompute_ref_log_probs")),
              "the reference's log-probs computed before training: no reference in the step")
    raw = keys.get("loss_type")
    if raw is not None:
        losses = raw if isinstance(raw, list) else [raw]
        if not objective_spec(objective).runs_trainer:
            r.ignore("loss_type", raw, "SFTConfig's loss_type: llmem models the causal-LM loss (nll)",
                     approximates=False)
        elif losses:
            r.set("loss_type", raw, "loss_type", str(losses[0]), "" if len(losses) == 1 else
                  "the losses combined are per-pair scalars on the same log-probs: the first's step is modelled")
    if objective in GENERATING:
        for key, name in (("num_generations", "num_generations"), ("max_completion_length", "max_completion_length")):
            if key in keys:
                r.set(key, keys.get(key), name, r.integer(key, keys.get(key)))
        if "beta" in keys:
            beta = keys.get("beta")
            if isinstance(beta, bool) or not isinstance(beta, (int, float)) or beta < 0:
                raise r.error("beta", beta, "is not a KL coefficient", "give a number >= 0")
            r.set("beta", beta, "beta", float(beta), "a reference model scored per step" if beta > 0 else
                  "no reference model (beta 0)")
        if "use_vllm" in keys and r.boolean("use_vllm", keys.get("use_vllm")):
            r.set("use_vllm", True, "use_vllm", True, "vLLM's pool modelled, not run (llmem.memory.vllm)")
            _vllm(r, keys)
    elif "beta" in keys:
        r.note_used("beta", keys.get("beta"), "the loss's temperature: no memory effect")
    if objective not in GENERATING and "max_prompt_length" in keys:
        r.ignore("max_prompt_length", keys.get("max_prompt_length"), "no field of trl 1.16's configs (older TRL's "
                 "prompt truncation): TRL's parser leaves it unused; --prompt-len gives the prompt", approximates=False)
    if objective_spec(objective).full_logits and "max_completion_length" in keys:
        r.note_used("max_completion_length", keys.get("max_completion_length"), "the completion's truncation; "
                    "--seq-len is each sequence's length after TRL's truncation")
    for key in ("completion_only_loss", "assistant_only_loss"):
        if objective_spec(objective).sft_step and keys.get(key):
            r.ignore(key, True, "the prompt's (or the non-assistant) tokens get labels -100, which TRL's fused head "
                     "skips; how many is the data's: give --prompt-len N (every token is scored without it)",
                     settled_by="prompt_len")
    if keys.get("disable_dropout") is False:
        r.ignore("disable_dropout", False, "llmem models the preference step with dropout off (TRL's default)")
    for key in ("sync_ref_model", "ref_model_sync_steps", "ref_model_mixup_alpha"):
        if key in keys:
            r.note_used(key, keys.get(key), "the reference's weights updated in place: no memory effect")


# The generation batch's keys (GRPOConfig's and RLOOConfig's, TrainingArguments' accumulation): key -> (field, note)
GENERATION_BATCH_KEYS = {
    "gradient_accumulation_steps": ("gradient_accumulation_steps", "GRPOConfig's default steps_per_generation"),
    "steps_per_generation": ("steps_per_generation", "each generation batch serves this many steps"),
    "generation_batch_size": ("generation_batch_size", "completions generated at once on all processes"),
}


def read_generation_batch(r: Reading, keys: Keys, table: dict[str, tuple[str, str]]) -> None:
    """GRPO's / RLOO's generation batch, rows of `table` (key -> (field, note)); a None value is TRL's unset."""
    for key, (name, note) in table.items():
        raw = keys.get(key)
        if raw is not None:
            r.set(key, raw, name, r.integer(key, raw), note)


def trl_sequence(r: Reading, keys: Keys, trl: bool, objective: str) -> None:
    if objective in GENERATING:
        prompt = keys.get("max_prompt_length", 512)
        completion = keys.get("max_completion_length", GENERATION_DEFAULTS[objective].max_completion_length)
        total = r.integer("max_prompt_length", prompt) + r.integer("max_completion_length", completion)
        r.set("max_prompt_length + max_completion_length", f"{prompt} + {completion}", "seq_len", total,
              "the prompt: " + ("max_prompt_length (older TRL's; trl 1.16 does not truncate prompts)"
                                if "max_prompt_length" in keys else "512 tokens assumed (trl 1.16 does not truncate "
                                "prompts): give --seq-len for yours"))
    elif "max_length" in keys or OLD_MAX_LENGTH in keys or trl:
        key = "max_length" if "max_length" in keys or OLD_MAX_LENGTH not in keys else OLD_MAX_LENGTH
        spec = objective_spec(objective)
        if spec.runs_trainer and not spec.sft_step and objective not in GENERATING and key in keys:
            r.set(key, keys.get(key), "max_length", r.integer(key, keys.get(key)),
                  f"TRL's truncation; --seq-len {keys.get(key)}, each sequence's length after it")
        raw = keys.get(key, 1024)
        note = "older TRL's SFTConfig spelling of max_length (renamed in TRL 0.20)" if key == OLD_MAX_LENGTH else ""
        if key != OLD_MAX_LENGTH and OLD_MAX_LENGTH in keys:
            r.ignore(OLD_MAX_LENGTH, keys.get(OLD_MAX_LENGTH), "older TRL's spelling of max_length, which the file "
                     "also gives: max_length is the cap", approximates=False)
        r.set(key if key in keys else "max_length (TRL's default)", raw, "seq_len",
              r.integer(key, raw, what="a sequence length"), note)
    for key in ("packing", "padding_free"):
        if key in keys and r.boolean(key, keys.get(key)):
            if key == "padding_free" and objective_spec(objective).padding_free_off:
                r.ignore(key, True, f"{objective_spec(objective).trainer} turns padding_free off in trl 1.16 (a "
                         "warning, then standard padding): each pair padded", approximates=False)
                continue
            r.set(key, True, "packing", True, "position_ids restart per sample" if key == "padding_free" else "")
    for key in ("packing_strategy", "eval_packing", "dataset_text_field", "dataset_name", "dataset_config"):
        keys.get(key)


def _dtypes(r: Reading, keys: Keys, init: Keys, trl: bool) -> None:
    fp16 = r.boolean("fp16", keys.get("fp16", False))
    bf16 = r.boolean("bf16", keys.get("bf16", trl and not fp16))
    compute = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    r.note_used("bf16" if "bf16" in keys else "bf16 (TRL's default)" if trl else "bf16 (default)", bf16,
                "autocast in bf16" if bf16 else "off")
    if fp16:
        r.note_used("fp16", True, "autocast in fp16")
    raw = keys.get("dtype") or keys.get("torch_dtype") or init.get("dtype") or init.get("torch_dtype")
    if raw is not None:
        weights = r.choice("dtype", raw, DTYPES)
        r.note_used("dtype", raw, f"the model loaded in {weights}" + (" (the checkpoint's: bf16 assumed)"
                                                                      if str(raw) == "auto" else ""))
    else:
        weights = "fp32" if trl else "bf16"
        if trl:
            r.note_used("dtype (TRL's default)", "float32", "the model loaded in fp32")
    r.dtype(compute=compute, weights=weights, kbit_upcast=False)


def _quantisation(r: Reading, keys: Keys) -> bool:
    if keys.get("load_in_4bit"):
        r.set("load_in_4bit", True, "quant_base", "nf4", "bitsandbytes 4-bit")
        read_bnb_4bit(r, keys, "use_bnb_nested_quant", False, "TRL's default")
        return True
    if keys.get("load_in_8bit"):
        r.set("load_in_8bit", True, "quant_base", "int8", "bitsandbytes LLM.int8")
        return True
    return False


def _adapters(r: Reading, keys: Keys, quantised: bool) -> None:
    if not keys.get("use_peft", False):
        for key in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_modules_to_save"):
            if key in keys:
                r.ignore(key, keys.get(key), "use_peft is not set, so TRL trains the whole model", approximates=False)
        return
    rank = r.integer("lora_r", keys.get("lora_r", 16), what="a LoRA rank")
    raw_targets = keys.get("lora_target_modules")
    targets = targets_text(raw_targets) if raw_targets else "q_proj,v_proj"
    save = tuple(str(m) for m in keys.get("lora_modules_to_save", []) or [])
    lora = Lora(rank, float(keys.get("lora_alpha", 32)), r.fraction("lora_dropout", keys.get("lora_dropout", 0.05)),
                targets, save, bool(keys.get("use_dora", False)))
    sources = {name: (key, keys.get(key)) for name, key in (
        ("lora_rank", "lora_r"), ("lora_alpha", "lora_alpha"), ("lora_dropout", "lora_dropout"),
        ("lora_targets", "lora_target_modules"), ("modules_to_save", "lora_modules_to_save"),
        ("use_dora", "use_dora")) if key in keys}
    if not raw_targets:
        sources["lora_targets"] = ("lora_target_modules (peft's default for the model type)", None)
    r.note_used("use_peft", True, "LoRA adapters on a quantised base" if quantised else "LoRA adapters")
    apply_lora(r, lora, sources)
    for key in ("lora_task_type", "use_rslora"):
        keys.get(key)
    if keys.get("lora_target_parameters"):
        r.ignore("lora_target_parameters", keys.get("lora_target_parameters"), "LoRA on parameters (peft's "
                 "ParamWrapper, MoE expert weights) is not modelled: those adapters are left out")


def _vllm(r: Reading, keys: Keys) -> None:
    """GRPOConfig's vllm_* fields that decide the colocated engine's memory (the server's own stay unread)."""
    if "vllm_mode" in keys:
        r.set("vllm_mode", keys.get("vllm_mode"), "vllm_mode", r.choice("vllm_mode", keys.get("vllm_mode"),
                                                                          ("colocate", "server")))
    if "vllm_gpu_memory_utilization" in keys:
        u = keys.get("vllm_gpu_memory_utilization")
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u < 1:
            raise r.error("vllm_gpu_memory_utilization", u, "is not a share of the device", "give a number in (0, 1)")
        r.set("vllm_gpu_memory_utilization", u, "vllm_gpu_memory_utilization", float(u))
    if "vllm_enable_sleep_mode" in keys and r.boolean("vllm_enable_sleep_mode", keys.get("vllm_enable_sleep_mode")):
        r.set("vllm_enable_sleep_mode", True, "vllm_enable_sleep_mode", True)
    if keys.get("vllm_max_model_length") is not None:
        raw = keys.get("vllm_max_model_length")
        r.set("vllm_max_model_length", raw, "vllm_max_model_length", r.integer("vllm_max_model_length", raw))
    if (keys.get("vllm_tensor_parallel_size") or 1) != 1:
        r.ignore("vllm_tensor_parallel_size", keys.get("vllm_tensor_parallel_size"), "vLLM's own tensor "
                 "parallelism across the training ranks is not modelled: its pool is estimated unsplit (an upper "
                 "bound)")
