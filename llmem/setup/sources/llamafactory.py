"""LLaMA-Factory's YAML (0.9.5, src/llamafactory/hparams/): model_name_or_path, stage, finetuning_type, LoRA
(lora_rank 8, lora_alpha None = 2 x rank, lora_target "all" = every linear but the output layer; use_dora: DoRA),
OFT (peft's OFTConfig, model/adapter.py), use_muon, quantization_bit
(bitsandbytes, double quantisation on by default), cutoff_len (2048), packing (None: on for stage pt only),
flash_attn, enable_liger_kernel, disable_gradient_checkpointing (checkpointing is on unless disabled), pure_bf16, and
the TrainingArguments it passes on (batch, optim, bf16 / fp16, deepspeed).

Precision: the model loads in the checkpoint's dtype (torch_dtype "auto": bf16 for the Llama 3 / Qwen checkpoints),
then model/adapter.py init_adapter upcasts the trained parameters to fp32 unless pure_bf16 (or ZeRO-3, whose
partitions are fp32 already): bf16 is bf16-mixed for LoRA and full fine-tuning alike; pure_bf16 is llmem's bf16 with
the adapters in the base's dtype. It never runs prepare_model_for_kbit_training (--no-kbit-upcast)."""

from __future__ import annotations

from llmem.setup.liger import LIGER_DEFAULTS
from llmem.setup.sources.adapters import Lora, Oft, apply_lora, apply_oft, targets_text
from llmem.setup.sources.deepspeed import GA_NOTE, TrainerValues
from llmem.setup.sources.evaluation import read_llamafactory_eval
from llmem.setup.sources.hf import (
    LIGER_CE_NOTE,
    read_optimizer,
    set_liger,
    trainer_distributed,
)
from llmem.setup.sources.reading import UNSLOTH_KERNELS_NOTE, WHOLE_MODEL_COMPILE, Keys, Reading
from llmem.setup.sources.trl import batch_note

MARKS = ("stage", "finetuning_type", "cutoff_len", "template", "lora_target", "quantization_bit")
FLASH = {"auto": None, "disabled": "eager", "sdpa": "sdpa", "fa2": "flash", "fa3": "flash"}
PAIRED_STAGES = {"rm": 2}      # the stages read as a step of their rows (the reward model: not a trainer llmem models)
# LLaMA-Factory's preference stages (hparams/finetuning_args.py, 0.9.5) -> llmem's objective by pref_loss: stage dpo
# runs its CustomDPOTrainer (TRL's DPOTrainer; orpo and simpo drop the reference, use_ref_model), stage kto its
# CustomKTOTrainer (TRL's KTOTrainer); sigmoid, hinge and ipo are TRL's DPO loss types
PREF_LOSSES = {"sigmoid": ("dpo", "sigmoid"), "hinge": ("dpo", "hinge"), "ipo": ("dpo", "ipo"),
               "orpo": ("orpo", None), "simpo": ("simpo", None)}
OWN_FORWARD = ("LLaMA-Factory's own concatenated_forward keeps the whole fp32 logits (model(...).logits.to("
               "torch.float32)), where TRL's trainer, modelled, takes the log-probs chunk by chunk")


def detect(data: dict) -> bool:
    return "model_name_or_path" in data and any(k in data for k in MARKS)


def read(keys: Keys, r: Reading) -> None:
    r.multi_gpu_method = "ddp"
    r.set("model_name_or_path", keys.get("model_name_or_path"), "model", str(keys.get("model_name_or_path")))
    if keys.get("trust_remote_code"):
        r.set("trust_remote_code", True, "trust_remote_code", True)
    stage = str(keys.get("stage", "sft")).lower()
    batch = r.integer("per_device_train_batch_size", keys.get("per_device_train_batch_size", 8), what="a micro-batch")
    _stage(r, keys, stage, batch)
    cutoff = keys.get("cutoff_len", 2048)
    r.set("cutoff_len" if "cutoff_len" in keys else "cutoff_len (default)", cutoff, "seq_len",
          r.integer("cutoff_len", cutoff, what="a sequence length"))
    packing = keys.get("packing")
    packing = stage == "pt" if packing is None else r.boolean("packing", packing)
    if keys.get("neat_packing"):
        packing = True
    if packing or "packing" in keys:
        r.set("packing" if "packing" in keys else "packing (default: stage pt)", keys.get("packing", packing),
              "packing", packing)
    if "gradient_accumulation_steps" in keys:
        r.note_used("gradient_accumulation_steps", keys.get("gradient_accumulation_steps"), GA_NOTE)
    read_optimizer(r, "optim" if "optim" in keys else "optim (transformers' default)",
                   keys.get("optim", "adamw_torch_fused"))
    if "use_muon" in keys and r.boolean("use_muon", keys.get("use_muon")):
        # train/trainer_utils.py _create_muon_optimizer: Muon for the 2-D matrices but embeddings and lm_head,
        # AdamW for the rest (its third_party Muon, one momentum buffer per matrix)
        r.set("use_muon", True, "optimizer", "muon", "LLaMA-Factory's Muon, modelled by torch.optim.Muon for the "
              "hidden matrices with AdamW for the rest")
    disabled = keys.get("disable_gradient_checkpointing", False)
    checkpointed = not r.boolean("disable_gradient_checkpointing", disabled)
    r.set("disable_gradient_checkpointing" + ("" if "disable_gradient_checkpointing" in keys else " (default)"),
          disabled, "grad_ckpt", checkpointed)
    unsloth_gc = keys.get("use_unsloth_gc")
    if _unsloth(r, keys) or not checkpointed:
        pass          # (use_unsloth: Unsloth's own checkpoint, whatever disable_gradient_checkpointing says)
    elif unsloth_gc:
        # model_utils/checkpointing.py: get_unsloth_gradient_checkpointing_func, Unsloth's first offloaded checkpoint
        r.set("use_unsloth_gc", unsloth_gc, "ckpt_offload", "unsloth-classic", "LLaMA-Factory's copy "
              "of Unsloth_Offloaded_Gradient_Checkpointer: each layer's input to the host, back for its recompute")
    else:
        # prepare_model_for_training: gradient_checkpointing_kwargs={"use_reentrant": use_reentrant_gc}
        raw = keys.get("use_reentrant_gc", True)
        key = "use_reentrant_gc" + ("" if "use_reentrant_gc" in keys else " (default)")
        if r.boolean("use_reentrant_gc", raw):
            r.set(key, raw, "ckpt_reentrant", True, "torch's reentrant checkpoint: each layer's forward under no_grad")
        else:
            r.note_used(key, raw, "the non-reentrant checkpoint")
    flash = str(keys.get("flash_attn", "auto")).lower()
    attn = r.choice("flash_attn", flash, FLASH)
    if attn is not None:
        r.set("flash_attn", flash, "attn", attn)
    if keys.get("enable_liger_kernel"):
        r.set("enable_liger_kernel", True, "fused_ce", True, LIGER_CE_NOTE)
        set_liger(r, "enable_liger_kernel", True, list(LIGER_DEFAULTS))
    _dtypes(r, keys)
    quantised = _quantisation(r, keys)
    _finetuning(r, keys, stage, quantised)
    _multimodal(r, keys)
    accum = keys.get("gradient_accumulation_steps", 1)
    trainer = TrainerValues("TrainingArguments", batch, accum if isinstance(accum, int) else None, None,
                            r.dtypes.compute == "bf16", r.dtypes.compute == "fp16")
    trainer_distributed(r, keys, trainer)
    read_llamafactory_eval(r, keys)
    if r.zero_stage == 3 and not quantised:
        r.notes.append("LLaMA-Factory under ZeRO-3 keeps the trained parameters in ZeRO-3's fp32 partitions")
    for key, why in (("upcast_layernorm", "the norms upcast to fp32: not modelled (a few MB)"),
                     ("use_galore", "GaLore's projected optimizer states are not modelled"),
                     ("use_apollo", "APOLLO's optimizer states are not modelled"),
                     ("use_badam", "BAdam's block-wise training is not modelled"),
                     ("use_adam_mini", "Adam-mini's optimizer states are not modelled"),
                     ("use_llama_pro", "LLaMA Pro's expanded blocks (trainable copies of some layers) are not "
                      "modelled"),
                     ("use_mca", "Megatron-Core training (mcore_adapter) is not modelled"),
                     ("use_kt", "KTransformers' CPU / GPU offloaded kernels are not modelled"),
                     ("torch_compile", WHOLE_MODEL_COMPILE),
                     ("shift_attn", "LongLoRA's shifted attention is not modelled"),
                     ("mixture_of_depths", "mixture of depths is not modelled")):
        if keys.get(key):
            r.ignore(key, keys.get(key), why)
    r.not_read(keys)


def _unsloth(r: Reading, keys: Keys) -> bool:
    """use_unsloth: FastLanguageModel.from_pretrained / get_peft_model with use_gradient_checkpointing="unsloth"
    and max_seq_length = cutoff_len (model_utils/unsloth.py), whatever disable_gradient_checkpointing says; Unsloth's
    apply_unsloth_gradient_checkpointing runs torch's reentrant checkpoint below 512. Its Triton kernels are not
    modelled. Whether it applies (False: no use_unsloth)."""
    if not keys.get("use_unsloth") or not r.boolean("use_unsloth", keys.get("use_unsloth")):
        return False
    cutoff = r.integer("cutoff_len", keys.get("cutoff_len", 2048), what="a sequence length")
    if cutoff >= 512:
        r.set("use_unsloth", True, "ckpt_offload", "unsloth", "FastLanguageModel's use_gradient_checkpointing="
              "\"unsloth\": Unsloth's smart offloaded checkpoint (cutoff_len >= 512)")
    else:
        r.set("use_unsloth", True, "ckpt_reentrant", True, "FastLanguageModel below max_seq_length 512: torch's "
              "reentrant checkpoint (Unsloth's offloading is off there)")
    if keys.get("use_unsloth_gc"):
        r.note_used("use_unsloth_gc", keys.get("use_unsloth_gc"), "unused under use_unsloth (LLaMA-Factory skips "
                    "prepare_model_for_training)")
    r.ignore("use_unsloth", True, UNSLOTH_KERNELS_NOTE)
    return True


def _stage(r: Reading, keys: Keys, stage: str, batch: int) -> None:
    """The trainer the stage runs: supervised (sft, pt), TRL's preference trainers as LLaMA-Factory subclasses them
    (dpo by pref_loss, kto), or a step of the doubled batch for the reward model (rm) and PPO, not modelled."""
    if stage in ("dpo", "kto"):
        objective, loss_type, trainer = "kto", None, "LLaMA-Factory's CustomKTOTrainer"
        if stage == "dpo":
            loss = str(keys.get("pref_loss", "sigmoid")).lower()
            if loss not in PREF_LOSSES:
                raise r.error("pref_loss", loss, f"is not a loss llmem models ({', '.join(PREF_LOSSES)})",
                              "estimate another pref_loss")
            (objective, loss_type), trainer = PREF_LOSSES[loss], f"LLaMA-Factory's CustomDPOTrainer, pref_loss {loss}"
        r.set("stage", stage, "objective", objective, trainer)
        if loss_type:
            r.set("pref_loss", loss, "loss_type", loss_type)
        r.set("per_device_train_batch_size", batch, "batch_size", batch, batch_note(objective))
        r.set("cutoff_len", keys.get("cutoff_len", 2048), "max_length", r.integer("cutoff_len", keys.get(
              "cutoff_len", 2048)), "LLaMA-Factory truncates each sequence to it")
        r.ignore("stage", stage, OWN_FORWARD)
        return
    factor = PAIRED_STAGES.get(stage, 1)
    r.set("per_device_train_batch_size", batch, "batch_size", factor * batch,
          f"stage {stage}: chosen and rejected rows run as one batch of {factor}x" if factor > 1 else "")
    if stage in ("sft", "pt") and "stage" in keys:
        r.note_used("stage", stage, "supervised fine-tuning" if stage == "sft" else "pre-training")
    if stage in ("ppo", "rm"):
        r.ignore("stage", stage, "the reward model's value head and PPO's models are not modelled: the step of the "
                 "policy stands in, the value head as the lm_head")


def _dtypes(r: Reading, keys: Keys) -> None:
    """hparams/parser.py: compute_dtype bf16 under bf16 or pure_bf16, fp16 under fp16; the trained parameters upcast
    to fp32 unless pure_bf16 (model/adapter.py)."""
    bf16 = r.boolean("bf16", keys.get("bf16", False))
    fp16 = r.boolean("fp16", keys.get("fp16", False))
    pure = r.boolean("pure_bf16", keys.get("pure_bf16", False))
    compute = "bf16" if bf16 or pure else "fp16" if fp16 else "fp32"
    for key, on in (("bf16", bf16), ("fp16", fp16), ("pure_bf16", pure)):
        if key in keys:
            r.note_used(key, on, {"bf16": "autocast in bf16", "fp16": "autocast in fp16",
                                  "pure_bf16": "bf16 weights and adapters, no fp32 upcast"}[key] if on else "off")
    r.dtype(compute=compute, weights="bf16" if compute != "fp32" else "fp32", masters=not pure,
            adapters="base" if pure else "fp32", kbit_upcast=False)


def _quantisation(r: Reading, keys: Keys) -> bool:
    if "quantization_bit" not in keys:
        return False
    bits = r.choice("quantization_bit", keys.get("quantization_bit"), {"2": 2, "3": 3, "4": 4, "8": 8})
    method = str(keys.get("quantization_method", "bnb")).lower()
    if method != "bnb" or bits not in (4, 8):
        r.ignore("quantization_bit", bits, f"{method} {bits}-bit quantisation is not modelled (llmem models "
                 "bitsandbytes' 4-bit NF4 and LLM.int8): estimated with the base unquantised")
        return False
    if bits == 4:
        r.set("quantization_bit", bits, "quant_base", "nf4", "bitsandbytes 4-bit")
        qtype = str(keys.get("quantization_type", "nf4")).lower()
        if qtype != "nf4":
            r.ignore("quantization_type", qtype, "FP4 is stored as NF4 is (4 bits per weight, the same absmax): "
                     "modelled as nf4", approximates=False)
        double = r.boolean("double_quantization", keys.get("double_quantization", True))
        r.set("double_quantization" if "double_quantization" in keys else "double_quantization (default)", double,
              "double_quant", double)
    else:
        r.set("quantization_bit", bits, "quant_base", "int8", "bitsandbytes LLM.int8")
    if "quantization_method" in keys:
        r.note_used("quantization_method", method, "bitsandbytes")
    return True


def _finetuning(r: Reading, keys: Keys, stage: str, quantised: bool) -> None:
    kind = str(keys.get("finetuning_type", "lora")).lower()
    if kind == "full":
        r.note_used("finetuning_type", kind, "full fine-tuning")
        return
    if kind == "freeze":
        r.ignore("finetuning_type", kind, "freeze tuning (the last freeze_trainable_layers layers trained) is not "
                 "expressible: full fine-tuning stands in (an upper bound)")
        return
    if kind == "oft":
        _oft(r, keys, quantised)
        return
    if kind != "lora":
        r.ignore("finetuning_type", kind, f"{kind} adapters are not modelled: full fine-tuning stands in")
        return
    rank = r.integer("lora_rank", keys.get("lora_rank", 8), what="a LoRA rank")
    alpha = keys.get("lora_alpha", rank * 2)
    dropout = r.fraction("lora_dropout", keys.get("lora_dropout", 0.0))
    targets = targets_text(keys.get("lora_target", "all"))
    extra = keys.get("additional_target")
    save = tuple(targets_text(extra).split(",")) if extra else ()
    sources = {name: (key, keys.get(key)) for name, key in (
        ("lora_rank", "lora_rank"), ("lora_alpha", "lora_alpha"), ("lora_dropout", "lora_dropout"),
        ("lora_targets", "lora_target"), ("modules_to_save", "additional_target"), ("use_dora", "use_dora"))
        if key in keys}
    if "lora_alpha" not in keys:
        sources["lora_alpha"] = ("lora_alpha (default: 2 x lora_rank)", None)
    dora = bool(keys.get("use_dora", False))
    r.note_used("finetuning_type", kind, ("DoRA" if dora else "LoRA") + " adapters" + (" on a quantised base (QDoRA)"
                if dora and quantised else " on a quantised base" if quantised else ""))
    apply_lora(r, Lora(rank, float(alpha), dropout, targets, save, dora), sources)
    for key in ("use_rslora", "pissa_init", "pissa_convert", "create_new_adapter", "adapter_name_or_path"):
        keys.get(key)


# hparams/finetuning_args.py FreezeArguments... (0.9.5): what a vision-language model's full fine-tuning leaves
# frozen (model/adapter.py _setup_full_tuning: forbidden modules), and in LoRA which parts are not targeted
FREEZE_KEYS = (("freeze_vision_tower", True, "freeze_vision_tower"),
               ("freeze_multi_modal_projector", True, "freeze_projector"),
               ("freeze_language_model", False, "freeze_language_model"))


def _multimodal(r: Reading, keys: Keys) -> None:
    """A vision-language model's switches: the parts left frozen (LLaMA-Factory's defaults: the vision tower and the
    projector), and image_max_pixels (hparams/model_args.py ProcessorArguments: 768 x 768), to which mm_plugin's
    _preprocess_image scales each larger image before the processor's own smart resize (llmem's --max-pixels bounds
    that resize: the same bound, within a patch row). The images themselves are the data's: --images-per-sample and
    --image-size on the command line; without them these keys are dropped (llmem.setup.sources.build)."""
    for key, default, name in FREEZE_KEYS:
        given = key in keys
        value = r.boolean(key, keys.get(key)) if given else default
        r.set(key if given else f"{key} (default)", keys.get(key, default), name, value)
    if any(k in keys for k in ("image_max_pixels", "image_min_pixels", "video_max_pixels", *(k for k, *_ in
                                                                                           FREEZE_KEYS))):
        r.notes.append("LLaMA-Factory's cutoff_len caps a sample's text and image tokens together; llmem's "
                       "--seq-len counts its text tokens and adds the images' (an upper bound with images: give "
                       "--seq-len as cutoff_len less the visual tokens for a full sample)")
    if "image_max_pixels" in keys or "image_min_pixels" in keys or "video_max_pixels" in keys:
        pixels = r.integer("image_max_pixels", keys.get("image_max_pixels", 768 * 768), what="a pixel count")
        r.set("image_max_pixels" if "image_max_pixels" in keys else "image_max_pixels (default)",
              keys.get("image_max_pixels", pixels), "max_pixels", pixels,
              "each image scaled to fit it, then the processor's own resize")
    if r.boolean("image_do_pan_and_scan", keys.get("image_do_pan_and_scan", False)):
        raise r.error("image_do_pan_and_scan", keys.get("image_do_pan_and_scan"), "adds Gemma 3's pan-and-scan "
                      "crops (each 256 image tokens more), which llmem does not model", "set it false (the "
                      "processor's default)")
    for key in ("image_min_pixels", "video_max_pixels", "video_min_pixels", "video_fps", "video_maxlen",
                "crop_to_patches"):
        keys.get(key)


def _oft(r: Reading, keys: Keys, quantised: bool) -> None:
    """finetuning_type oft (OFTArguments, model/adapter.py _setup_lora_tuning): peft's OFTConfig with r oft_rank
    (0), oft_block_size (32), module_dropout (0.0) and modules_to_save additional_target; its target_modules are
    lora_target's ("all": every linear but the output layer), as 0.9.5 builds them (oft_target is parsed, not
    passed)."""
    rank = r.integer("oft_rank", keys.get("oft_rank", 0), low=0, what="an OFT rank")
    block = r.integer("oft_block_size", keys.get("oft_block_size", 32), low=0, what="an OFT block size")
    if (rank == 0) == (block == 0):
        raise r.error("oft_rank", rank, f"and oft_block_size = {block} give peft's OFTConfig both or neither",
                      "set exactly one of them (LLaMA-Factory's default: oft_block_size 32, oft_rank 0)")
    extra = keys.get("additional_target")
    oft = Oft(rank, block, r.fraction("module_dropout", keys.get("module_dropout", 0.0)),
              targets_text(keys.get("lora_target", "all")), tuple(targets_text(extra).split(",")) if extra else ())
    sources = {name: (key, keys.get(key)) for name, key in (
        ("r", "oft_rank"), ("oft_block_size", "oft_block_size"), ("module_dropout", "module_dropout"),
        ("target_modules", "lora_target"), ("modules_to_save", "additional_target")) if key in keys}
    sources.setdefault("target_modules", ("lora_target (default: all)", "all"))
    if "oft_target" in keys:
        r.ignore("oft_target", keys.get("oft_target"), "LLaMA-Factory 0.9.5 passes lora_target as OFT's "
                 "target_modules (oft_target is parsed, not used)", approximates=False)
    apply_oft(r, oft, "finetuning_type", "oft", sources)
    r.note_used("finetuning_type", "oft", "OFT adapters" + (" on a quantised base" if quantised else ""))
    for key in ("create_new_adapter", "adapter_name_or_path"):
        keys.get(key)
