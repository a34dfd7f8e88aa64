"""ms-swift's YAML (`swift sft --config` / `swift rlhf --config`), read as ms-swift 4.6.0's argument dataclasses
parse it (swift/arguments/: BaseArguments, ModelArguments, QuantizeArguments, TemplateArguments, TunerArguments,
SftArguments, RLHFArguments; swift/trainers/arguments.py TrainArgumentsMixin over transformers' TrainingArguments).

The defaults it relies on, where ms-swift sets them (file:line in the 4.6.0 wheel):
- tuner_type "lora" (base_args/base_args.py:121; 3.x's train_type is its old name); lora_rank 8, lora_alpha 32,
  lora_dropout 0.05, target_modules ["all-linear"] (tuner_args.py:126-135); freeze_llm False, freeze_vit True,
  freeze_aligner True (tuner_args.py:122-124);
- per_device_train_batch_size 1, gradient_checkpointing True (trainers/arguments.py:130, 135): ms-swift checkpoints
  unless told not to, where TrainingArguments does not; gradient_accumulation_steps None: 16 / batch / world
  (trainers/arguments.py __post_init__), 1 under GRPO (rlhf_args.py _set_default);
- use_reentrant: trainers/mixin.py _fix_gradient_checkpointing patches torch.utils.checkpoint.checkpoint with the
  reentrant checkpoint unless gradient_checkpointing_kwargs says otherwise or the run is distributed without
  DeepSpeed or FSDP (plain DDP: non-reentrant);
- torch_dtype None: the checkpoint's config.json (model_args.py:74); bf16 / fp16 None: bf16 over bfloat16 weights,
  fp16 over float16 or float32 ones (model_args.py _init_mixed_precision); the Trainer then trains the weights in
  that dtype (no fp32 upcast), LoRA's adapters in fp32 (peft's autocast_adapter_dtype) unless lora_dtype;
- max_length None: the model's max_model_len (base_args.py __post_init__): the data decides the length;
- quant_method / quant_bits: bitsandbytes 4 or 8 bits, bnb_4bit_quant_type nf4 and bnb_4bit_use_double_quant True
  (quant_args.py:41-42); ms-swift never runs peft's prepare_model_for_kbit_training;
- rlhf_type "dpo" where `swift rlhf` runs (rlhf_args.py:233); max_completion_length 512, beta 0.04 under GRPO else
  0.1 (rlhf_args.py _init_grpo / _set_default), num_generations 8 (rlhf_args.py:164), vllm_gpu_memory_utilization
  0.9 (rlhf_trainers/args_mixin.py:37);
- deepspeed: zero0 ... zero3_offload name swift/config/<name>.json (sft_args.py _init_deepspeed), fsdp: fsdp2 names
  swift/config/fsdp2.json (_init_fsdp): ms_swift_presets.json holds those files as 4.6.0 ships them.
Megatron-SWIFT's configs (`megatron sft / rlhf`, its Ray pipeline) train with Megatron-Core: refused."""

from __future__ import annotations

import json
import re
from importlib import resources
from typing import Any

from llmem.setup.sources.adapters import Lora, apply_lora, targets_text
from llmem.setup.sources.deepspeed import GA_NOTE, TrainerValues, read_deepspeed
from llmem.setup.sources.files import find_reference, load
from llmem.setup.sources.fsdp import read_fsdp_config, strategy_from_options
from llmem.setup.sources.hf import (
    read_attention,
    read_bnb_4bit,
    read_checkpointing,
    read_deepspeed_ref,
    read_liger,
    read_optimizer,
)
from llmem.setup.sources.reading import Keys, Reading
from llmem.setup.sources.trl import batch_note

MARKS = ("tuner_type", "train_type", "rlhf_type")
# keys only ms-swift's arguments have beside a `model` string (LLaMA-Factory, TRL: model_name_or_path; axolotl:
# base_model; torchtune: a model component)
MODEL_MARKS = ("freeze_vit", "freeze_llm", "freeze_aligner", "attn_impl", "quant_bits", "lora_rank",
               "target_modules", "torch_dtype", "max_length")
# Megatron-SWIFT's (megatron/arguments/megatron_args.py) and its Ray pipeline's (ray/megatron/driver_utils.py)
MEGATRON_MARKS = ("micro_batch_size", "global_batch_size", "tensor_model_parallel_size",
                  "pipeline_model_parallel_size", "expert_model_parallel_size", "mcore_model", "colocate_groups")
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}
# ModelArguments.attn_impl: flash_attn is ms-swift's name for flash_attention_2 (model_args.py's docstring)
ATTN_ALIASES = {"flash_attn": "flash_attention_2"}
# swift rlhf's trainers (rlhf_trainers/): rlhf_type -> llmem's objective; simpo runs CPOTrainer with loss simpo
# (rlhf_args.py _init_simpo)
OBJECTIVES = {"dpo": "dpo", "kto": "kto", "orpo": "orpo", "simpo": "simpo", "grpo": "grpo"}
NOT_MODELLED_RLHF = {"rm": "the reward model's score head trained on pairs", "ppo": "PPO's policy, value and reward "
                     "models", "gkd": "generalised knowledge distillation (a teacher beside the student)"}
# rlhf_trainers/dpo_trainer.py concatenated_forward: model(**batch).logits, then get_per_token_logps over them
OWN_FORWARD = ("ms-swift's own concatenated_forward keeps the whole logits (outputs.logits, then "
               "get_per_token_logps), where TRL 1.16's DPOTrainer, modelled, takes the log-probs chunk by chunk")
OWN_TRAINERS = {"dpo": OWN_FORWARD,
                "kto": "ms-swift's KTOTrainer (over trl < 1.0's) is modelled by TRL 1.16's KTOTrainer step",
                "grpo": "ms-swift's GRPOTrainer (RolloutTrainerMixin over trl < 1.0's) is modelled by TRL 1.16's "
                        "GRPOTrainer step"}
# tuner_type values llmem does not model (base_args.py get_supported_tuners)
TUNERS = ("lora", "full")
# memory-changing keys llmem cannot model: key -> (is it on, why, fix)
REFUSED: dict[str, tuple[Any, str, str]] = {
    "sequence_parallel_size": (lambda v: v not in (None, 1), "splits each sequence over GPUs (Ulysses / ring "
                               "attention), which llmem does not model", "set it to 1"),
    "use_galore": (bool, "GaLore's projected optimizer states are not modelled", "drop it"),
    "lisa_activated_layers": (bool, "LISA's layer-wise training is not modelled", "set it to 0"),
    "freeze_parameters_ratio": (bool, "freezes a share of the layers, which llmem does not express", "set it to 0"),
    "freeze_parameters": (bool, "freezes parameters by name, which llmem does not express", "drop it"),
    "freeze_parameters_regex": (bool, "freezes parameters by pattern, which llmem does not express", "drop it"),
    "trainable_parameters": (bool, "trains parameters beside the adapters, which llmem does not express",
                             "drop it"),
    "trainable_parameters_regex": (bool, "trains parameters beside the adapters, which llmem does not express",
                                   "drop it"),
    "target_parameters": (bool, "puts LoRA on parameters (MoE experts), which llmem does not model", "drop it"),
    "vit_gradient_checkpointing": (lambda v: v is False, "checkpoints the language model and not the vision tower, "
                                   "which llmem does not express", "drop it (it follows gradient_checkpointing)"),
}
IGNORED = {
    "new_special_tokens": "the added tokens' embedding rows are not counted (a few MB)",
    "router_aux_loss_coef": "the router's auxiliary loss: no memory effect llmem models",
    "torch_compile": "the Trainer's torch.compile of the whole model is not modelled",
    "offload_model": "ms-swift moves the policy to the host during generation, which llmem does not model",
    "offload_optimizer": "ms-swift moves the optimizer states to the host during generation, which llmem does not "
                         "model",
    "ref_model": "a reference of another checkpoint: the policy's own is modelled",
}


def detect(data: dict) -> bool:
    named = isinstance(data.get("model"), str)
    return any(k in data for k in MARKS) or named and any(k in data for k in MODEL_MARKS + MEGATRON_MARKS)


def read(keys: Keys, r: Reading) -> None:
    megatron = [k for k in MEGATRON_MARKS if k in keys]
    if megatron:
        raise r.error(megatron[0], keys.get(megatron[0]), "makes this a Megatron-SWIFT config (megatron sft / rlhf: "
                      "Megatron-Core's training, which llmem does not model)", "give the set-up with flags (llmem "
                      "estimate MODEL --lora-rank ... --gpus ...)")
    r.multi_gpu_method = "ddp"
    model = keys.get("model")
    if not isinstance(model, str) or not model.strip():
        raise r.error("model", model, "is not a model id or path", "give e.g. model: Qwen/Qwen2.5-7B-Instruct")
    r.set("model", model, "model", model.strip())
    _refusals(r, keys)
    tuner_key = "tuner_type" if "tuner_type" in keys or "train_type" not in keys else "train_type"
    tuner = str(keys.get(tuner_key, "lora")).lower()
    if tuner not in TUNERS:
        raise r.error(tuner_key, tuner, "is a tuner llmem does not model (it models lora and full)",
                      "estimate tuner_type lora or full")
    batch = r.integer("per_device_train_batch_size", keys.get("per_device_train_batch_size", 1), what="a micro-batch")
    objective = _objective(r, keys, batch)
    _sequence(r, keys, objective)
    _checkpointing(r, keys)
    attn = keys.get("attn_impl")
    if attn is not None:
        read_attention(r, "attn_impl", ATTN_ALIASES.get(str(attn), attn))
    else:
        r.note_used("attn_impl (default)", None, "transformers picks sdpa where the model has it (llmem's default)")
    read_liger(r, keys, fused_head=False)
    _packing(r, keys, objective)
    optimizer = keys.get("optimizer")
    if optimizer in ("multimodal", "lorap"):
        r.note_used("optimizer", optimizer, "AdamW with its own learning rates per part: the same states")
    elif optimizer is not None:
        r.ignore("optimizer", optimizer, "an ms-swift optimizer plugin llmem does not model: AdamW stands in")
    read_optimizer(r, "optim" if "optim" in keys else "optim (transformers' default)",
                   keys.get("optim", "adamw_torch_fused"))
    quantised = _quantisation(r, keys)
    _dtypes(r, keys)
    all_linear = False
    if tuner == "lora":
        all_linear = _lora(r, keys, quantised)
    else:
        r.note_used(tuner_key, tuner, "full fine-tuning")
    _multimodal(r, keys, tuner, all_linear)
    if objective == "sft":
        _logits_to_keep(r, keys)
    _distributed(r, keys, batch)
    for key, why in IGNORED.items():
        if keys.get(key):
            r.ignore(key, keys.get(key), why)
    r.not_read(keys)


def _refusals(r: Reading, keys: Keys) -> None:
    for key, (on, why, fix) in REFUSED.items():
        if key in keys and on(keys.get(key)):
            raise r.error(key, keys.get(key), why, fix)
    task = str(keys.get("task_type", "causal_lm")).lower()
    if task != "causal_lm":
        raise r.error("task_type", task, "trains a head llmem does not model (it models causal_lm)",
                      "estimate task_type causal_lm")
    if str(keys.get("tuner_backend", "peft")).lower() != "peft":
        raise r.error("tuner_backend", keys.get("tuner_backend"), "loads and patches the model through Unsloth "
                      "(load_by_unsloth: its offloaded checkpoint and Triton kernels), which llmem does not model "
                      "for ms-swift", "estimate tuner_backend peft")
    quant = keys.get("quant_method")
    if quant is not None and str(quant).lower() != "bnb":
        raise r.error("quant_method", quant, "is a quantisation llmem does not model (it models bitsandbytes)",
                      "use quant_method bnb with quant_bits 4 or 8")


def _objective(r: Reading, keys: Keys, batch: int) -> str:
    """The trainer: `swift sft` (no rlhf_type) or `swift rlhf`'s (rlhf_args.py), as llmem's --objective."""
    if "rlhf_type" not in keys:
        r.set("per_device_train_batch_size" + ("" if "per_device_train_batch_size" in keys else " (default)"),
              batch, "batch_size", batch)
        if "gradient_accumulation_steps" in keys:
            r.note_used("gradient_accumulation_steps", keys.get("gradient_accumulation_steps"), GA_NOTE)
        return "sft"
    if "gradient_accumulation_steps" in keys and str(keys.get("rlhf_type")).lower() != "grpo":
        r.note_used("gradient_accumulation_steps", keys.get("gradient_accumulation_steps"), GA_NOTE)
    kind = str(keys.get("rlhf_type")).lower()
    loss = keys.get("loss_type")
    if kind in NOT_MODELLED_RLHF:
        raise r.error("rlhf_type", kind, f"trains {NOT_MODELLED_RLHF[kind]}, which llmem does not model",
                      "estimate rlhf_type dpo, kto, orpo, simpo or grpo")
    if kind == "cpo" and str(loss).lower() == "simpo":
        kind = "simpo"
    if kind not in OBJECTIVES:
        raise r.error("rlhf_type", kind, "is not a trainer llmem models", "estimate rlhf_type dpo, kto, orpo, "
                      "simpo or grpo (cpo with loss_type simpo)")
    objective = OBJECTIVES[kind]
    r.set("rlhf_type", keys.get("rlhf_type"), "objective", objective, f"ms-swift's {kind} trainer")
    if objective in OWN_TRAINERS:
        r.ignore("rlhf_type", kind, OWN_TRAINERS[objective])
    r.set("per_device_train_batch_size" + ("" if "per_device_train_batch_size" in keys else " (default)"), batch,
          "batch_size", batch, batch_note(objective))
    default_loss = {"dpo": "sigmoid", "grpo": "grpo"}.get(objective)
    if objective in ("dpo", "grpo"):
        raw = loss if loss is not None else default_loss
        losses = raw if isinstance(raw, list) else [raw]
        r.set("loss_type" if loss is not None else "loss_type (ms-swift's default)", raw, "loss_type",
              str(losses[0]), "" if len(losses) == 1 else "the losses share one step: the first's is modelled")
    if objective == "grpo":
        _grpo(r, keys)
    elif "beta" in keys:
        r.note_used("beta", keys.get("beta"), "the loss's temperature: no memory effect")
    return objective


def _grpo(r: Reading, keys: Keys) -> None:
    """GRPOArguments' generation keys (rlhf_args.py, rlhf_trainers/args_mixin.py) with ms-swift's defaults."""
    for key, name, default in (("num_generations", "num_generations", 8),
                               ("max_completion_length", "max_completion_length", 512)):
        raw = keys.get(key, default)
        r.set(key if key in keys else f"{key} (ms-swift's default)", raw, name, r.integer(key, raw))
    beta = keys.get("beta", 0.04)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or beta < 0:
        raise r.error("beta", beta, "is not a KL coefficient", "give a number >= 0")
    r.set("beta" if "beta" in keys else "beta (ms-swift's GRPO default)", beta, "beta", float(beta),
          "a reference model scored per step" if beta > 0 else "no reference model (beta 0)")
    accum = keys.get("gradient_accumulation_steps", 1)
    r.set("gradient_accumulation_steps" if "gradient_accumulation_steps" in keys else
          "gradient_accumulation_steps (ms-swift's GRPO default)", accum, "gradient_accumulation_steps",
          r.integer("gradient_accumulation_steps", accum), "the generation batch's default steps_per_generation")
    for key in ("steps_per_generation", "generation_batch_size"):
        if key in keys:
            r.set(key, keys.get(key), key, r.integer(key, keys.get(key)))
    if r.integer("num_iterations", keys.get("num_iterations", 1)) > 1:
        r.ignore("num_iterations", keys.get("num_iterations"), "each generation batch trained on several times "
                 "(the old policy's log-probs scored too) is not modelled: one iteration's step stands in")
    if "use_vllm" not in keys or not r.boolean("use_vllm", keys.get("use_vllm")):
        return
    r.set("use_vllm", True, "use_vllm", True, "vLLM's pool modelled, not run (llmem.memory.vllm)")
    mode = keys.get("vllm_mode")
    if mode is None:
        raise r.error("vllm_mode", None, "is required with use_vllm (rlhf_args.py _init_rollout)",
                      "set vllm_mode colocate or server")
    r.set("vllm_mode", mode, "vllm_mode", r.choice("vllm_mode", mode, ("colocate", "server")))
    share = keys.get("vllm_gpu_memory_utilization", 0.9)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1:
        raise r.error("vllm_gpu_memory_utilization", share, "is not a share of the device", "give a number in (0, 1)")
    r.set("vllm_gpu_memory_utilization" + ("" if "vllm_gpu_memory_utilization" in keys else " (ms-swift's default)"),
          share, "vllm_gpu_memory_utilization", float(share))
    if keys.get("vllm_max_model_len") is not None:
        raw = keys.get("vllm_max_model_len")
        r.set("vllm_max_model_len", raw, "vllm_max_model_length", r.integer("vllm_max_model_len", raw))
    if (keys.get("sleep_level") or 0) > 0:
        r.set("sleep_level", keys.get("sleep_level"), "vllm_enable_sleep_mode", True, "vLLM sleeps while training "
              "(level 1 moves its weights to the host, 2 drops them: either frees the device, as TRL's level 2)")
    if (keys.get("vllm_tensor_parallel_size") or 1) != 1:
        r.ignore("vllm_tensor_parallel_size", keys.get("vllm_tensor_parallel_size"), "vLLM's own tensor parallelism "
                 "is not modelled: its pool is estimated unsplit (an upper bound)")


def _sequence(r: Reading, keys: Keys, objective: str) -> None:
    """max_length (TemplateArguments): each sample's cap; under GRPO the prompt's, the completion on top."""
    if "max_length" not in keys:
        r.ignore("max_length (default)", None, "ms-swift caps a sample at the model's max_model_len: its length is "
                 "the data's; give --seq-len for yours (llmem's default 2048)", settled_by="seq_len")
        return
    length = r.integer("max_length", keys.get("max_length"), what="a sequence length")
    if objective == "grpo":
        completion = r.values["max_completion_length"]
        r.set("max_length + max_completion_length", f"{length} + {completion}", "seq_len", length + completion,
              "the prompt truncated to max_length (truncation_strategy left), every completion to its cap")
        return
    r.set("max_length", length, "seq_len", length, "each sample's cap: its longest length")
    if objective in ("dpo", "kto", "orpo", "simpo"):
        r.set("max_length", length, "max_length", length, "ms-swift truncates each sequence to it")


def _checkpointing(r: Reading, keys: Keys) -> None:
    """gradient_checkpointing and its kwargs as TrainingArguments reads them (hf.read_checkpointing), on unless told
    not to (TrainArgumentsMixin, trainers/arguments.py:135); without use_reentrant in the kwargs, the reentrant
    checkpoint trainers/mixin.py _fix_gradient_checkpointing patches in."""
    read_checkpointing(r, keys, default=True)
    if r.values["grad_ckpt"] and not any(u.key.endswith("_kwargs.use_reentrant") for u in r.used):
        r.set(REENTRANT_DEFAULT, True, "ckpt_reentrant", True, "trainers/mixin.py _fix_gradient_checkpointing: the "
              "reentrant checkpoint on one GPU and under DeepSpeed or FSDP")


# the entry build() drops under plain DDP, where _fix_gradient_checkpointing picks the non-reentrant checkpoint
REENTRANT_DEFAULT = "use_reentrant (ms-swift's default)"
DDP_NOTE = "ms-swift's _fix_gradient_checkpointing: the non-reentrant checkpoint under DDP (trainers/mixin.py)"


def _logits_to_keep(r: Reading, keys: Keys) -> None:
    """use_logits_to_keep None (trainers/arguments.py:165) turns on where the model's forward takes logits_to_keep
    (trainers/mixin.py get_use_logits_to_keep, under transformers 5): prepare_logits_to_keep then keeps the logits
    of the labelled tokens only (a batch of one) or from the first labelled one on, which llmem's sft step does not
    model (its whole sequence's logits: an upper bound); Liger's fused cross-entropy builds none either way."""
    raw = keys.get("use_logits_to_keep")
    if raw is not None and not r.boolean("use_logits_to_keep", raw):
        r.note_used("use_logits_to_keep", raw, "the whole sequence's logits, as llmem's sft step")
    elif str(keys.get("loss_scale")) == "all":      # swift pt's default (pretrain_args.py): every token labelled
        r.note_used("loss_scale", "all", "every token labelled: logits_to_keep keeps them all, as llmem's sft step")
    elif not r.values.get("fused_ce"):
        r.ignore("use_logits_to_keep" + ("" if raw is not None else " (ms-swift's default)"), raw, "ms-swift "
                 "computes the logits of the labelled (response) tokens only (prepare_logits_to_keep): the whole "
                 "sequence's stand in (an upper bound; use_logits_to_keep false is the run llmem models)")


# SftArguments._check_padding_free: the attention implementations packing / padding_free run with
FLASH_IMPLS = ("flash_attn", "flash_attention_2", "flash_attention_3", "flash_attention_4")


def _packing(r: Reading, keys: Keys, objective: str) -> None:
    """packing turns padding_free on (sft_args.py _check_padding_free): the batch's samples in one row, position_ids
    restarting per sample; ms-swift refuses it without flash attention, and under rlhf_type other than grpo, dpo,
    kto and gkd (rlhf_args.py _check_padding_free)."""
    for key in ("packing", "padding_free"):
        if key in keys and r.boolean(key, keys.get(key)):
            if keys.get("attn_impl") not in FLASH_IMPLS:
                raise r.error(key, keys.get(key), "needs flash attention (ms-swift's _check_padding_free refuses "
                              f"attn_impl {keys.get('attn_impl')})", "add attn_impl: flash_attn")
            if "rlhf_type" in keys and objective not in ("grpo", "dpo", "kto"):
                raise r.error(key, keys.get(key), f"is refused by ms-swift under rlhf_type {keys.get('rlhf_type')}",
                              "set it false")
            r.set(key, True, "packing", True, "flash attention over the samples laid end to end")
            return


def _dtypes(r: Reading, keys: Keys) -> None:
    raw = keys.get("torch_dtype")
    if raw is not None:
        weights = r.choice("torch_dtype", raw, DTYPES)
        r.note_used("torch_dtype", raw, f"the model loaded in {weights}")
    else:
        weights = "bf16"
        r.note_used("torch_dtype (default)", None, "the checkpoint's config.json torch_dtype: bf16 assumed (give "
                    "torch_dtype for another)")
    bf16 = r.boolean("bf16", keys.get("bf16")) if "bf16" in keys else weights == "bf16"
    fp16 = r.boolean("fp16", keys.get("fp16")) if "fp16" in keys else weights != "bf16" and not bf16
    compute = "bf16" if bf16 else "fp16" if fp16 else weights      # no autocast: the weights' own dtype
    r.note_used("bf16 / fp16" + ("" if "bf16" in keys or "fp16" in keys else " (from torch_dtype)"),
                f"{bf16} / {fp16}", f"autocast in {compute}" if bf16 or fp16 else "no autocast")
    r.dtype(compute=compute, weights=weights, kbit_upcast=False)


def _quantisation(r: Reading, keys: Keys) -> bool:
    if "quant_bits" not in keys:
        return False
    if "quant_method" not in keys:
        raise r.error("quant_bits", keys.get("quant_bits"), "quantises nothing without quant_method "
                      "(quant_args.py get_quantization_config)", "add quant_method: bnb")
    bits = r.choice("quant_bits", keys.get("quant_bits"), {"4": 4, "8": 8}, "bitsandbytes takes 4 or 8")
    r.note_used("quant_method", keys.get("quant_method"), "bitsandbytes")
    if bits == 8:
        r.set("quant_bits", bits, "quant_base", "int8", "bitsandbytes LLM.int8")
        return True
    r.set("quant_bits", bits, "quant_base", "nf4", "bitsandbytes 4-bit")
    read_bnb_4bit(r, keys, "bnb_4bit_use_double_quant", True, "default")
    keys.get("bnb_4bit_compute_dtype")
    return True


def _lora(r: Reading, keys: Keys, quantised: bool) -> bool:
    """prepare_adapter (pipelines/train/tuner.py): peft's LoraConfig from TunerArguments; all-linear is every linear
    but the output layer (find_all_linears), on a vision-language model the language model's alone while freeze_vit
    and freeze_aligner hold (get_multimodal_target_regex). Whether the targets are all-linear."""
    rank = r.integer("lora_rank", keys.get("lora_rank", 8), what="a LoRA rank")
    regex = keys.get("target_regex")
    raw_targets = keys.get("target_modules", ["all-linear"])
    if "all-embedding" in (raw_targets if isinstance(raw_targets, list) else str(raw_targets).split(",")):
        raise r.error("target_modules", raw_targets, "puts LoRA on the embeddings (get_target_modules' "
                      "all-embedding), which llmem does not model", "drop all-embedding")
    targets = f"re:{regex}" if regex else targets_text(raw_targets)
    save = keys.get("modules_to_save") or []
    save = [save] if isinstance(save, str) else [str(m) for m in save]
    aliases = [m for m in save if m in ("all-embedding", "all-norm")]
    if aliases:
        raise r.error("modules_to_save", aliases[0], "names modules by the model's layout (find_embedding / "
                      "find_norm), which llmem does not resolve", "name the modules (e.g. embed_tokens, lm_head)")
    lora = Lora(rank, float(keys.get("lora_alpha", 32.0)), r.fraction("lora_dropout", keys.get("lora_dropout", 0.05)),
                targets, tuple(save), r.boolean("use_dora", keys.get("use_dora", False)))
    sources = {name: (key, keys.get(key)) for name, key in (
        ("lora_rank", "lora_rank"), ("lora_alpha", "lora_alpha"), ("lora_dropout", "lora_dropout"),
        ("lora_targets", "target_regex" if regex else "target_modules"), ("modules_to_save", "modules_to_save"),
        ("use_dora", "use_dora")) if key in keys}
    sources.setdefault("lora_alpha", ("lora_alpha (ms-swift's default)", 32.0))
    sources.setdefault("lora_dropout", ("lora_dropout (ms-swift's default)", 0.05))
    sources.setdefault("lora_targets", ("target_modules (ms-swift's default)", ["all-linear"]))
    kind = "DoRA" if lora.use_dora else "LoRA"
    r.note_used("tuner_type" if "tuner_type" in keys else "train_type" if "train_type" in keys else
                "tuner_type (default)", "lora", f"{kind} adapters" + (" on a quantised base" if quantised else ""))
    apply_lora(r, lora, sources)
    dtype = keys.get("lora_dtype")
    if dtype is not None:      # tuners/peft.py _cast_adapter_dtype_hook: an explicit lora_dtype is kept
        adapters = r.choice("lora_dtype", dtype, DTYPES)
        r.note_used("lora_dtype", dtype, f"the adapters in {adapters}")
        if adapters != "fp32":
            r.dtype(adapters="base")
    for key in ("use_rslora", "init_weights", "lora_bias"):
        keys.get(key)
    if str(keys.get("lora_bias", "none")) != "none":
        r.ignore("lora_bias", keys.get("lora_bias"), "the biases trained beside the adapters are not counted")
    return lora.targets == targets_text(["all-linear"])


# TunerArguments' vision-language switches (tuner_args.py:122-124) -> llmem's set-up fields
FREEZE_KEYS = (("freeze_vit", True, "freeze_vision_tower"), ("freeze_aligner", True, "freeze_projector"),
               ("freeze_llm", False, "freeze_language_model"))


def _multimodal(r: Reading, keys: Keys, tuner: str, all_linear: bool) -> None:
    """Full fine-tuning: the parts frozen (_init_multimodal_full). LoRA: all-linear puts adapters on the language
    model's linears only under ms-swift's defaults, which is what llmem's all-linear adapts; adapters on the vision
    tower or the aligner (freeze_vit / freeze_aligner false), or none on the language model, are refused. The
    images are the data's: --images-per-sample and --image-size (without them build() drops these fields)."""
    values = {key: r.boolean(key, keys.get(key)) if key in keys else default for key, default, _ in FREEZE_KEYS}
    if tuner == "lora":
        for key, default, _ in FREEZE_KEYS:
            if values[key] != default and all_linear:
                raise r.error(key, keys.get(key), "changes which parts all-linear puts LoRA on (llmem adapts the "
                              "language model's linears only)", f"set {key} {str(default).lower()} "
                              "(ms-swift's default)")
            if key in keys:
                r.note_used(key, keys.get(key), "LoRA: the base is frozen whatever it says")
    else:
        for key, default, name in FREEZE_KEYS:
            r.set(key if key in keys else f"{key} (default)", keys.get(key, default), name, values[key])
    if "max_pixels" in keys:
        pixels = r.integer("max_pixels", keys.get("max_pixels"), what="a pixel count")
        r.set("max_pixels", keys.get("max_pixels"), "max_pixels", pixels, "the processor's max_pixels")


def _distributed(r: Reading, keys: Keys, batch: int) -> None:
    """deepspeed (a preset name, a path or the JSON), fsdp (fsdp2 or a path), and a Ray launch's device group."""
    accum = keys.get("gradient_accumulation_steps")
    trainer = TrainerValues("TrainingArguments", batch, accum if isinstance(accum, int) else None, None,
                            r.dtypes.compute == "bf16", r.dtypes.compute == "fp16")
    presets = json.loads(resources.files(__package__).joinpath("ms_swift_presets.json").read_text())
    ds = keys.get("deepspeed")
    if isinstance(ds, str) and ds.strip() in presets["deepspeed"]:
        r.note_used("deepspeed", ds, f"ms-swift's swift/config/{ds.strip()}.json")
        read_deepspeed(r, presets["deepspeed"][ds.strip()], f"{ds.strip()}.json (ms-swift)", trainer)
    elif isinstance(ds, str) and ds.strip().startswith("{"):
        read_deepspeed_ref(r, "deepspeed", _json(r, "deepspeed", ds), trainer)
    elif ds:
        read_deepspeed_ref(r, "deepspeed", ds, trainer)
    fsdp = keys.get("fsdp")
    if fsdp and ds:
        raise r.error("fsdp", fsdp, "with deepspeed is refused by ms-swift (sft_args.py _init_fsdp)", "keep one")
    if fsdp:
        config = presets["fsdp"].get(str(fsdp).strip())
        if config is None:
            config = _json(r, "fsdp", fsdp) if str(fsdp).strip().startswith("{") else _fsdp_file(r, str(fsdp))
        strategy = strategy_from_options(r, "fsdp", config.get("fsdp", "full_shard auto_wrap"))
        options = config.get("fsdp_config", {})
        read_fsdp_config(r, Keys(options, "fsdp_config."), strategy, version=options.get("fsdp_version", 2))
        if options.get("activation_checkpointing") and r.values.get("grad_ckpt"):
            r.note_used("fsdp_config.activation_checkpointing", True, "ms-swift turns gradient_checkpointing off "
                        "for it (_check_fsdp2_compatibility): one checkpoint per decoder layer")
    if keys.get("use_ray"):
        _ray_gpus(r, keys)


def _json(r: Reading, key: str, text: str) -> dict:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        raise r.error(key, text[:60], "is not a JSON mapping", "give a preset name, a path or a JSON mapping")
    return data


def _fsdp_file(r: Reading, ref: str) -> dict:
    path = find_reference(ref.strip(), r.path, "fsdp")
    _, data = load(path)
    r.files.append((str(path), "fsdp"))
    return data


RANGE = re.compile(r"^\s*list\(\s*range\(\s*(\d+)\s*,\s*(\d+)\s*\)\s*\)\s*$")


def _ray_gpus(r: Reading, keys: Keys) -> None:
    """use_ray: `swift sft` runs its trainer on device_groups' `default` group (pipelines/train/sft.py
    RayHelper.worker(group=['default'])), its ranks an int, a list or "list(range(a, b))" (ray_utils/
    resource_manager.py): the GPU count."""
    groups = keys.sub("device_groups")
    group = groups.sub("default")
    ranks = group.get("ranks")
    match = RANGE.match(ranks) if isinstance(ranks, str) else None
    count = (ranks if isinstance(ranks, int) and not isinstance(ranks, bool) else len(ranks)
             if isinstance(ranks, list) else int(match.group(2)) - int(match.group(1)) if match else None)
    r.note_used("use_ray", True, "ms-swift's Ray launch: the trainer runs on device_groups.default")
    if not count or count < 1:
        r.ignore("device_groups.default.ranks", ranks, "not a rank list llmem reads: the launcher decides the GPUs",
                 settled_by="gpus")
        return
    r.gpus = count
    r.note_used("device_groups.default.ranks", ranks, f"{count} GPUs")
    per_node = groups.get("nproc_per_node")
    if isinstance(per_node, int) and per_node > 0:
        r.gpus_per_node = per_node
        r.note_used("device_groups.nproc_per_node", per_node, "GPUs per node")
    for key in ("device", "workers"):
        group.get(key)
