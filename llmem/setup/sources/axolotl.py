"""axolotl's YAML (axolotl 0.19's schema, utils/schemas/): the model, micro_batch_size, sequence_len, sample_packing,
bf16 / fp16 ("auto": bf16 where the GPU has it, utils/config resolve_dtype), the optimizer, checkpointing and
activation offloading, LoRA / QLoRA (load_in_4bit / load_in_8bit; peft_use_dora: DoRA / QDoRA; the per-layer
peft keys as a peft config), attention, Liger and Cut Cross-Entropy, FSDP,
DeepSpeed, and Ray's worker count.

Precision: axolotl loads the model in bf16 under bf16 (cfg.torch_dtype) and HF Trainer autocasts over it, so a full
fine-tune trains bf16 parameters (llmem's bf16) and LoRA trains fp32 adapters (peft's default) on the bf16 base
(bf16-mixed); under FSDP or DeepSpeed the trained parameters are fp32 masters (bf16-mixed). The kbit upcast
(prepare_model_for_kbit_training) runs on a quantised base except where axolotl skips it (loaders/model.py
_prepare_model_for_quantization): QLoRA under FSDP, FSDP's cpu_ram_efficient_loading, ZeRO-3, LoftQ."""

from __future__ import annotations

from llmem.setup.sections import REGEX_TARGETS
from llmem.setup.sources.adapters import Lora, apply_lora, targets_text
from llmem.setup.sources.deepspeed import GA_NOTE, TrainerValues
from llmem.setup.sources.evaluation import read_axolotl_eval
from llmem.setup.sources.fsdp import read_fsdp_config
from llmem.setup.sources.hf import (
    LIGER_CE_NOTE,
    read_attention,
    read_deepspeed_ref,
    read_optimizer,
    set_liger,
)
from llmem.setup.sources.reading import WHOLE_MODEL_COMPILE, Keys, Reading
from llmem.setup.sources.trl import (
    GENERATING,
    GENERATION_BATCH_KEYS,
    batch_note,
    objective_keys,
    read_generation_batch,
    trl_sequence,
)

# axolotl's RLType (utils/schemas/enums.py, axolotl 0.19) -> (llmem's objective, the TRL trainer its builder runs,
# the loss_type it sets): core/builders/rl.py _get_trainer_cls / _build_training_arguments; ipo is DPO with
# loss_type ["ipo"], simpo TRL's CPOTrainer with loss_type "simpo", gdpo GRPO's trainer with TRL's
# multi_objective_aggregation "normalize_then_sum" (each reward normalised over its group before the sum: arithmetic
# on the [batch, reward functions] rewards, nothing on the device that GRPO's step does not hold); ebft is not
# modelled. reward: `reward_model: true` (TRL's RewardTrainer)
AXOLOTL_RL = {"dpo": ("dpo", "DPOTrainer", None), "ipo": ("dpo", "DPOTrainer", "ipo"),
              "orpo": ("orpo", "ORPOTrainer", None), "kto": ("kto", "KTOTrainer", None),
              "simpo": ("simpo", "CPOTrainer", None), "grpo": ("grpo", "GRPOTrainer", None),
              "gdpo": ("grpo", "GRPOTrainer", None), "reward": ("reward", "RewardTrainer", None)}
# axolotl's LoraConfig keys (utils/schemas/peft.py) that loaders/adapter.py passes to peft's LoraConfig under these
# names: only peft expresses them (an uneven set of adapted layers, per-module ranks)
PEFT_FIELDS = {"peft_layers_to_transform": "layers_to_transform", "peft_layers_pattern": "layers_pattern",
               "lora_rank_pattern": "rank_pattern", "lora_alpha_pattern": "alpha_pattern"}
# ... and those llmem does not model, with why
PEFT_UNMODELLED = {
    "lora_target_parameters": "LoRA on parameters (peft's ParamWrapper, MoE expert weights) is not modelled",
    "peft_trainable_token_indices": "trainable token rows of embed_tokens (peft's TrainableTokens) are not modelled",
    "peft_layer_replication": "replicated decoder layers (peft's layer_replication) are not modelled",
}
CCE_PLUGIN = "cut_cross_entropy"
LIGER_PLUGIN = "liger"


def detect(data: dict) -> bool:
    return "base_model" in data or ("micro_batch_size" in data and "sequence_len" in data)


def read(keys: Keys, r: Reading, bf16_capable: bool) -> None:
    r.multi_gpu_method = "ddp"
    if "base_model" in keys:
        r.set("base_model", keys.get("base_model"), "model", str(keys.get("base_model")))
    for key in ("base_model_config", "model_type", "tokenizer_type", "tokenizer_config"):
        keys.get(key)
    if keys.get("trust_remote_code"):
        r.set("trust_remote_code", True, "trust_remote_code", True)
    batch = r.integer("micro_batch_size", keys.get("micro_batch_size", 1), what="a micro-batch")
    seq = r.integer("sequence_len", keys.get("sequence_len", 512), what="a sequence length")
    r.set("sequence_len", keys.get("sequence_len", 512), "seq_len", seq,
          "" if "sequence_len" in keys else "axolotl's default")
    _objective(r, keys, batch, seq)
    if "sample_packing" in keys:
        r.set("sample_packing", keys.get("sample_packing"), "packing", r.boolean("sample_packing",
                                                                                keys.get("sample_packing")))
    if "pad_to_sequence_len" in keys:
        r.note_used("pad_to_sequence_len", keys.get("pad_to_sequence_len"), "rows of sequence_len: llmem's shape")
    for key in ("eval_sample_packing", "min_sample_len"):
        keys.get(key)
    read_axolotl_eval(r, keys, batch)
    if "gradient_accumulation_steps" in keys and r.values.get("objective") not in GENERATING:
        r.note_used("gradient_accumulation_steps", keys.get("gradient_accumulation_steps"), GA_NOTE)
    keys.get("batch_size")
    optimizer = keys.get("optimizer", "adamw_torch_fused")
    read_optimizer(r, "optimizer" if "optimizer" in keys else "optimizer (default)", optimizer)
    _dtypes(r, keys, bf16_capable)
    _checkpointing(r, keys)
    _attention(r, keys)
    _kernels(r, keys)
    quantised = _quantised(r, keys)
    _adapters(r, keys, quantised)
    _distributed(r, keys, quantised)
    _multimodal(r, keys)
    _unmodelled(r, keys)
    r.not_read(keys)


def _multimodal(r: Reading, keys: Keys) -> None:
    """A vision-language model's images (axolotl's multimodal config, processing_strategies.py): `image_size` resizes
    every image to that size (an int: a square; [height, width]) before the processor's own resize, so it is
    llmem's --image-size. How many images a sample holds is the data's: --images-per-sample on the command line
    (without it the key is dropped: llmem.setup.sources.build)."""
    for key in ("processor_type", "image_resize_algorithm", "skip_prepare_dataset", "remove_unused_columns"):
        keys.get(key)
    if "image_size" not in keys or keys.get("image_size") is None:
        return
    raw = keys.get("image_size")
    size = [raw, raw] if isinstance(raw, int) and not isinstance(raw, bool) else raw
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(n, int) and n > 0 for n in size)):
        raise r.error("image_size", raw, "is not an image size (axolotl takes an int or [height, width])",
                      "give image_size: 512 or [448, 672]")
    r.set("image_size", raw, "image_size", f"{size[0]}x{size[1]}", "every image resized to it (axolotl), then "
          "the processor's own resize")


def _objective(r: Reading, keys: Keys, batch: int, seq: int) -> None:
    """axolotl's `rl:` (or `reward_model:`) as the TRL trainer its builder runs, with the settings it passes
    (core/builders/rl.py, core/trainers/dpo and grpo); no `rl:`: supervised fine-tuning."""
    rl = str(keys.get("rl", "")).lower()
    if keys.get("process_reward_model"):
        raise r.error("process_reward_model", True, "runs TRL's PRMTrainer (a token-classification process reward "
                      "model), which llmem does not model", "estimate another trainer's config")
    if keys.get("reward_model"):
        rl = "reward"
        r.note_used("reward_model", True, "TRL's RewardTrainer (axolotl's AxolotlRewardTrainer)")
    if not rl:
        r.set("micro_batch_size", batch, "batch_size", batch)
        return
    if rl not in AXOLOTL_RL:
        raise r.error("rl", rl, f"runs a trainer llmem does not model (modelled: {', '.join(AXOLOTL_RL)})",
                      "estimate another trainer's config")
    objective, trainer, loss_type = AXOLOTL_RL[rl]
    if rl == "gdpo" and keys.sub("trl").get("multi_objective_aggregation") == "sum_then_normalize":
        # axolotl's check_gdpo (utils/schemas/validation.py) refuses the pair before training
        raise r.error("rl", rl, "with trl.multi_objective_aggregation 'sum_then_normalize' is GRPO: axolotl refuses "
                      "the pair", "write rl: grpo, or drop multi_objective_aggregation (gdpo normalises then sums)")
    if rl != "reward":
        r.set("rl", rl, "objective", objective, f"axolotl runs TRL's {trainer}" + (
            " with multi_objective_aggregation 'normalize_then_sum' (GDPO: the rewards' aggregation, no device "
            "memory of its own)" if rl == "gdpo" else ""))
    else:
        r.set("reward_model", True, "objective", objective)
    r.set("micro_batch_size", batch, "batch_size", batch, batch_note(objective))
    dpo_losses = keys.get("dpo_loss_type") if rl == "dpo" else None
    if loss_type or dpo_losses:
        r.set("dpo_loss_type" if dpo_losses else "rl", dpo_losses or rl, "loss_type",
              str(dpo_losses[0]) if dpo_losses else loss_type)
    if rl in ("dpo", "ipo") and keys.get("precompute_ref_log_probs"):
        r.set("precompute_ref_log_probs", True, "precompute_ref_log_probs", True,
              "the reference's log-probs computed before training: no reference in the step")
    if objective in GENERATING:       # GRPOStrategy: the trl block's keys, max_length / max_prompt_length dropped
        trl = keys.sub("trl")
        objective_keys(r, trl, objective)
        if "beta" not in trl and "rl_beta" in keys:
            r.set("rl_beta", keys.get("rl_beta"), "beta", float(keys.get("rl_beta")))
        trl_sequence(r, trl, True, objective)
        # GRPOStrategy passes trl.generation_batch_size (no steps_per_generation); the accumulation is
        # TrainingArguments' (core/trainers/grpo/__init__.py set_training_args_kwargs)
        read_generation_batch(r, keys, {"gradient_accumulation_steps": GENERATION_BATCH_KEYS[
            "gradient_accumulation_steps"]})
        read_generation_batch(r, trl, {"generation_batch_size": GENERATION_BATCH_KEYS["generation_batch_size"]})
    else:                             # _set_base_training_args: max_length = sequence_len under rl / reward_model
        r.set("sequence_len", seq, "max_length", seq, "axolotl passes it as TRL's max_length")


def _dtypes(r: Reading, keys: Keys, bf16_capable: bool) -> None:
    """utils/config resolve_dtype: bf16 'auto' -> the GPU's bf16 support; torch_dtype bf16 / fp16 / fp32."""
    bf16 = keys.get("bf16", False)
    fp16 = keys.get("fp16")
    if bf16 == "auto":
        bf16 = bf16_capable and not fp16
        if not bf16 and fp16 is None and not keys.get("float16"):
            fp16 = True
        r.note_used("bf16", "auto", f"{'bf16' if bf16 else 'no bf16'} on the GPU (--gpu)")
    else:
        bf16 = r.boolean("bf16", bf16)
        if "bf16" in keys:
            r.note_used("bf16", bf16, "autocast in bf16" if bf16 else "off")
    fp16 = bool(fp16) and not bf16
    if fp16:
        r.note_used("fp16", True, "autocast in fp16")
    pure_bf16, pure_fp16 = keys.get("bfloat16"), keys.get("float16")
    weights = "bf16" if bf16 or pure_bf16 else "fp16" if (fp16 or pure_fp16 or keys.get("load_in_8bit")) else "fp32"
    compute = "bf16" if bf16 or pure_bf16 else "fp16" if fp16 or pure_fp16 else "fp32"
    r.dtype(compute=compute, weights=weights)
    if keys.get("float32"):
        r.dtype(compute="fp32", weights="fp32")
    keys.get("tf32")


def _reentrant(r: Reading, keys: Keys, on: bool) -> None:
    """Which torch checkpoint HF's Trainer runs: gradient_checkpointing_kwargs.use_reentrant as written, else axolotl's
    normalize_config default ({"use_reentrant": True} with checkpointing on, no unfrozen_parameters and no rl; the
    trainer builder passes {"use_reentrant": False} otherwise)."""
    kwargs = keys.get("gradient_checkpointing_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise r.error("gradient_checkpointing_kwargs", kwargs, "is not a mapping", "write e.g. use_reentrant: false")
    if kwargs and "use_reentrant" in kwargs:
        key, raw = "gradient_checkpointing_kwargs.use_reentrant", kwargs["use_reentrant"]
        reentrant = on and r.boolean(key, raw)
    elif kwargs is None and on and keys.get("unfrozen_parameters") is None and keys.get("rl") is None:
        key, raw, reentrant = "gradient_checkpointing_kwargs (axolotl's default)", {"use_reentrant": True}, True
    else:
        if kwargs:
            r.note_used("gradient_checkpointing_kwargs", kwargs, "the non-reentrant checkpoint")
        return
    if reentrant:
        r.set(key, raw, "ckpt_reentrant", True, "torch's reentrant checkpoint: each layer's forward under no_grad")
    else:
        r.note_used(key, raw, "the non-reentrant checkpoint")


# utils/schemas/validation.py check_deprecated_unsloth_fields: axolotl refuses a config that sets any of them
REMOVED_UNSLOTH_KEYS = ("unsloth_cross_entropy_loss", "unsloth_lora_mlp", "unsloth_lora_qkv", "unsloth_lora_o",
                        "unsloth_rms_norm", "unsloth_rope")
# axolotl's own Triton LoRA kernels (kernels/lora.py, adapted from Unsloth's fast LoRA)
LORA_KERNEL_KEYS = ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel")


def _unsloth_keys(r: Reading, keys: Keys) -> None:
    """axolotl 0.19 has no Unsloth of its own: its schema refuses the removed unsloth_* keys and
    gradient_checkpointing: unsloth; its legacy activation offloading is Unsloth's first offloaded checkpoint."""
    for key in REMOVED_UNSLOTH_KEYS:
        if keys.get(key):
            raise r.error(key, keys.get(key), "was removed from axolotl, which refuses the config",
                          "use lora_mlp_kernel / lora_qkv_kernel / lora_o_kernel (not modelled) or drop it")
    gc = keys.get("gradient_checkpointing", False)
    if isinstance(gc, str) and gc.strip().lower() == "unsloth":
        raise r.error("gradient_checkpointing", gc, "is not a value axolotl 0.19 accepts (true, false, offload, "
                      "offload_disk)", "for Unsloth's offloaded checkpoint write gradient_checkpointing: true with "
                      "activation_offloading: legacy (--ckpt-offload unsloth-classic)")
    for key in LORA_KERNEL_KEYS:
        if keys.get(key):
            r.ignore(key, keys.get(key), "axolotl's Triton LoRA kernels (adapted from Unsloth's fast LoRA) are not "
                     "modelled: peft's LoRA layers' saved tensors stand in")


def _checkpointing(r: Reading, keys: Keys) -> None:
    _unsloth_keys(r, keys)
    gc = keys.get("gradient_checkpointing", False)
    off = keys.get("activation_offloading", False)
    if off == "legacy" and gc not in (False, None, "offload", "offload_disk") \
            and r.boolean("gradient_checkpointing", gc):
        # loaders/patch_manager.py _apply_gradient_checkpointing_patches: transformers.modeling_utils.checkpoint =
        # hf_grad_checkpoint_offload_wrapper, CPU_Offloaded_Gradient_Checkpointer around each layer (whatever
        # gradient_checkpointing_kwargs say)
        r.set("gradient_checkpointing", gc, "grad_ckpt", True)
        r.set("activation_offloading", off, "ckpt_offload", "unsloth-classic", "axolotl's legacy offload: "
              "CPU_Offloaded_Gradient_Checkpointer, Unsloth's first offloaded checkpoint")
        if keys.get("gradient_checkpointing_kwargs"):
            r.note_used("gradient_checkpointing_kwargs", keys.get("gradient_checkpointing_kwargs"), "unused by "
                        "the legacy offload's wrapper")
        return
    if gc in ("offload", "offload_disk"):
        r.set("gradient_checkpointing", gc, "grad_ckpt", True)
        r.set("gradient_checkpointing", gc, "offload_activations", True, "the checkpointed layer inputs offloaded "
              "(modelled as activation offloading)")
    elif "gradient_checkpointing" in keys:
        r.set("gradient_checkpointing", gc, "grad_ckpt", r.boolean("gradient_checkpointing", gc))
    _reentrant(r, keys, gc not in (False, None) and gc not in ("offload", "offload_disk"))
    if off:
        note = {"legacy": "the legacy offloader", "disk": "offloaded to disk, modelled as to CPU",
                "hidden_states": "the checkpoint inputs offloaded, modelled as activation offloading"}.get(str(off), "")
        r.set("activation_offloading", off, "offload_activations", True, note)
    if keys.get("selective_checkpointing"):
        r.ignore("selective_checkpointing", keys.get("selective_checkpointing"), "selective checkpointing (saving "
                 "attention inside checkpointed layers) is not modelled: full checkpointing stands in")


def _attention(r: Reading, keys: Keys) -> None:
    if "attn_implementation" in keys:
        read_attention(r, "attn_implementation", keys.get("attn_implementation"))
    for key, value in (("flash_attention", "flash_attention_2"), ("sdp_attention", "sdpa"),
                       ("eager_attention", "eager"), ("flex_attention", "flex_attention")):
        if keys.get(key):
            read_attention(r, key, value)
    if keys.get("xformers_attention"):
        r.ignore("xformers_attention", True, "xformers' memory-efficient attention is not modelled: sdpa stands in")
    for key in ("s2_attention", "sample_packing_eff_est"):
        keys.get(key)


def _kernels(r: Reading, keys: Keys) -> None:
    plugins = [str(p) for p in keys.get("plugins", []) or []]
    if keys.get("liger_fused_linear_cross_entropy"):
        r.set("liger_fused_linear_cross_entropy", True, "fused_ce", True, LIGER_CE_NOTE)
    # axolotl's LigerPlugin: liger_rope, liger_rms_norm, liger_glu_activation (SwiGLU on Llama-like models)
    for key, kernel in (("liger_rope", "rope"), ("liger_rms_norm", "rms_norm"), ("liger_glu_activation", "swiglu")):
        if keys.get(key):
            set_liger(r, key, True, [kernel])
    for key in ("liger_layer_norm", "liger_cross_entropy"):
        if keys.get(key):
            r.ignore(key, True, "a Liger kernel llmem does not model: HF's op stands in")
    cce = any(CCE_PLUGIN in p.lower().replace("crossentropy", "cross_entropy") for p in plugins)
    if cce and keys.get("cut_cross_entropy", True):
        r.set("plugins", "CutCrossEntropyPlugin", "fused_ce", True, "Cut Cross-Entropy, modelled by the fused linear "
              "cross-entropy (neither holds the full logits)")
    keys.get("cut_cross_entropy")
    for p in plugins:
        if CCE_PLUGIN not in p.lower().replace("crossentropy", "cross_entropy") and LIGER_PLUGIN not in p.lower():
            r.ignore("plugins", p, "a plugin llmem does not model")


def _quantised(r: Reading, keys: Keys) -> bool:
    bnb = keys.get("bnb_config_kwargs") or {}
    if keys.get("load_in_4bit"):
        r.set("load_in_4bit", True, "quant_base", "nf4", "bitsandbytes NF4")
        double = bool(bnb.get("bnb_4bit_use_double_quant", True)) if isinstance(bnb, dict) else True
        r.values["double_quant"] = double
        if isinstance(bnb, dict) and "bnb_4bit_use_double_quant" in bnb:
            r.set("bnb_config_kwargs.bnb_4bit_use_double_quant", double, "double_quant", double)
        return True
    if keys.get("load_in_8bit"):
        r.set("load_in_8bit", True, "quant_base", "int8", "bitsandbytes LLM.int8")
        return True
    keys.get("load_in_4bit")
    keys.get("load_in_8bit")
    return False


def _adapters(r: Reading, keys: Keys, quantised: bool) -> None:
    adapter = str(keys.get("adapter", "") or "").lower()
    for key in ("lora_model_dir", "lora_fan_in_fan_out", "peft_use_rslora", "lora_on_cpu"):
        keys.get(key)
    if not adapter:
        return
    if adapter not in ("lora", "qlora"):
        r.ignore("adapter", adapter, "only LoRA / QLoRA adapters are read from axolotl configs: full fine-tuning "
                 "stands in")
        return
    rank = r.integer("lora_r", keys.get("lora_r", 8), what="a LoRA rank")
    linear = bool(keys.get("lora_target_linear"))
    raw = keys.get("lora_target_modules")
    # _build_peft_lora_config passes lora_target_modules to peft as written: a string is peft's regular expression
    targets = "all-linear" if linear else (REGEX_TARGETS + raw if isinstance(raw, str) and raw.strip() else
                                           targets_text(raw or "q_proj,v_proj"))
    save = tuple(str(m) for m in keys.get("lora_modules_to_save", []) or [])
    dora = bool(keys.get("peft_use_dora", False))
    fields = tuple((name, keys.get(key)) for key, name in PEFT_FIELDS.items() if key in keys)
    lora = Lora(rank, float(keys.get("lora_alpha", rank)), r.fraction("lora_dropout", keys.get("lora_dropout", 0.0)),
                targets, save, dora, fields)
    sources = {name: (key, keys.get(key)) for name, key in (
        ("lora_rank", "lora_r"), ("lora_alpha", "lora_alpha"), ("lora_dropout", "lora_dropout"),
        ("lora_targets", "lora_target_linear" if linear else "lora_target_modules"),
        ("modules_to_save", "lora_modules_to_save"), ("use_dora", "peft_use_dora")) if key in keys}
    sources |= {name: (key, keys.get(key)) for key, name in PEFT_FIELDS.items() if key in keys}
    r.note_used("adapter", adapter, ("DoRA" if dora else "LoRA") + " adapters" + (" on a quantised base (QDoRA)"
                if dora and quantised else " on a quantised base" if quantised else ""))
    apply_lora(r, lora, sources)
    for key, why in PEFT_UNMODELLED.items():
        if keys.get(key):
            r.ignore(key, keys.get(key), why)
    if keys.get("peft_autocast_adapter_dtype") is False:
        r.set("peft_autocast_adapter_dtype", False, "adapter_dtype", "base", "adapters in the base's dtype")
        r.dtype(adapters="base")
    if quantised and keys.get("embeddings_skip_upcast"):
        r.ignore("embeddings_skip_upcast", True, "embed_tokens / lm_head kept in low precision while the norms are "
                 "upcast: not modelled (the kbit upcast counts them in fp32)")


def _distributed(r: Reading, keys: Keys, quantised: bool) -> None:
    fsdp = keys.get("fsdp")
    fsdp_config = keys.sub("fsdp_config")
    version = keys.get("fsdp_version")
    if fsdp or version or (fsdp_config.data and ("fsdp_version" in fsdp_config or "version" in fsdp_config)):
        if fsdp:
            r.note_used("fsdp", fsdp, "FSDP")
        read_fsdp_config(r, fsdp_config, version=version)
    trainer = TrainerValues("TrainingArguments", r.values.get("batch_size"), _accum(r, keys),
                            None, r.dtypes.compute == "bf16", r.dtypes.compute == "fp16")
    if "deepspeed" in keys:
        read_deepspeed_ref(r, "deepspeed", keys.get("deepspeed"), trainer)
    zero3 = r.zero_stage == 3
    cpu_ram = fsdp_config.data.get("fsdp_cpu_ram_efficient_loading", fsdp_config.data.get("cpu_ram_efficient_loading"))
    fsdp_on = bool(fsdp or version)
    skip = (quantised and fsdp_on) or (fsdp_on and bool(cpu_ram)) or zero3
    r.dtype(kbit_upcast=not skip)
    if quantised and skip:
        r.notes.append("axolotl skips prepare_model_for_kbit_training here (QLoRA under FSDP, cpu_ram_efficient_loading "
                       "or ZeRO-3): the unquantised frozen parameters stay in the base's dtype")
    if keys.get("use_ray"):
        workers = r.integer("ray_num_workers", keys.get("ray_num_workers", 1), what="a worker count")
        r.gpus = workers
        r.note_used("ray_num_workers", workers, f"gpus = {workers} (one GPU per Ray worker)")
    keys.get("ray_num_workers")
    tp = r.integer("tensor_parallel_size", keys.get("tensor_parallel_size", 1), what="a tensor-parallel degree")
    shard = keys.get("dp_shard_size")
    if shard is not None:
        r.note_used("dp_shard_size", shard, "FSDP's shard count: all GPUs but the tensor-parallel ones")
    if tp > 1:
        r.set("tensor_parallel_size", tp, "tp", tp)
        r.method = "fsdp+tp" if fsdp_on or (shard or 1) > 1 else "tp"
    for key in ("context_parallel_size", "sequence_parallel_degree"):
        if key in keys and r.integer(key, keys.get(key)) > 1:
            r.ignore(key, keys.get(key), "context parallelism (each sequence split over GPUs) is not modelled: "
                     "estimated at the whole sequence per GPU; give --seq-len for one GPU's share")
    if "dp_replicate_size" in keys and (replicate := r.integer("dp_replicate_size", keys.get("dp_replicate_size"))) > 1:
        r.set("dp_replicate_size", replicate, "dp_replicate", replicate, "HSDP: FSDP2 shards within each replica")
    if keys.get("tensor_parallel"):
        r.ignore("tensor_parallel", keys.get("tensor_parallel"), "a branch-only key (tensor_parallel 'auto': all "
                 "GPUs) without a degree: give --method tp --gpus N")


def _accum(r: Reading, keys: Keys) -> int | None:
    raw = keys.get("gradient_accumulation_steps")
    return r.integer("gradient_accumulation_steps", raw, what="a step count") if raw is not None else 1


def _unmodelled(r: Reading, keys: Keys) -> None:
    for key, why in (
            ("unfrozen_parameters", "training only the parameters matching these patterns is not expressible: "
             "full fine-tuning stands in (an upper bound)"),
            ("torch_compile", WHOLE_MODEL_COMPILE),
            ("tiled_mlp", "tiled MLP (the MLP computed in sequence tiles) is not modelled: the whole MLP's "
             "activations are counted"),
            ("layer_offloading", "offload of layer parameters is not modelled"),
            ("model_quantization_config", "a quantisation config of the checkpoint (e.g. MXFP4 dequantized on load) "
             "is not modelled: the weights are counted in the load dtype"),
            ("model_config", "overrides of the model's config are not applied (llmem reads the model's own config)"),
            ("output_router_logits", "the MoE router's auxiliary loss tensors are not modelled")):
        if key in keys and keys.get(key) not in (False, [], {}):
            r.ignore(key, keys.get(key), why)
    keys.get("model_quantization_config_kwargs")
