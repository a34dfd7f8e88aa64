"""How a validation row is named in the reports: the model, the layout and every option that is not the default,
in one line ("tiny-llama fsdp(2) bf16-mixed adamw 2x256 ckpt")."""

from __future__ import annotations

from pathlib import Path

from llmem.setup.deepspeed import ZERO_FIELDS
from llmem.setup.methods import METHODS
from llmem.setup.training import TrainingSetup


def label(s: TrainingSetup) -> str:
    layout = s.method if METHODS[s.method].one_gpu else f"{s.method}({s.gpus}" + (f",tp{s.tp}" if s.tp else "") \
        + (f",hsdp{s.dp_replicate}" if s.dp_replicate > 1 else "") + ")"
    if s.pp > 1:      # pipeline: degree, schedule and micro-batches
        layout += f"+pp{s.pp}:{s.pp_schedule}x{s.microbatches}" + (f"v{s.pp_virtual_stages}" if s.pp_virtual_stages
                                                                    else "")
    if s.cp > 1:      # context parallelism: its degree
        layout += f"+cp{s.cp}"
    if s.ep > 1:      # expert parallelism: its degree (and the assumed imbalance)
        layout += f"+ep{s.ep}" + (f"x{s.ep_imbalance:g}" if s.ep_imbalance != 1.0 else "")
    extras = [s.precision, s.optimizer, f"{s.batch_size}x{s.seq_len}"] + (["ckpt"] if s.grad_ckpt else []) \
        + (["eager"] if s.attn == "eager" else []) + ([f"lora{s.lora_rank}:{s.lora_targets}"] if s.lora_rank else []) \
        + (["optimizer-in-backward"] if s.optimizer_in_backward else []) \
        + ([f"ckpt-every-{s.ckpt_every}"] if s.grad_ckpt and s.ckpt_every > 1 else []) \
        + ([f"ac-{s.ac_policy}"] if s.ac_policy != "full" else []) \
        + (["flash"] if s.attn == "flash" else []) + (["fused-ce"] if s.fused_ce else []) \
        + ([f"logits-{s.logits_dtype}"] if s.logits_dtype != "fp32" else []) \
        + ([f"output-chunks{s.output_chunks}"] if s.output_chunks else []) \
        + ([f"liger:{s.liger}"] if s.liger != "none" else []) \
        + ([f"float8:{s.float8}" + ("+ag" if s.float8_all_gather else "")] if s.float8 != "none" else []) \
        + (["compile"] if s.compile else []) \
        + (["offload-act"] if s.offload_activations else []) + (["packing"] if s.packing else []) \
        + (["offload-opt"] if s.offload_optimizer else []) \
        + ([f"dropout{s.lora_dropout:g}"] if s.lora_dropout else []) \
        + ([f"peft:{Path(s.peft_config).name}"] if s.peft_config else []) \
        + [f"{name}={getattr(s, name)}" for name in ZERO_FIELDS if getattr(s, name) is not None
           and getattr(s, name) is not False] \
        + ([s.objective] if s.objective != "sft" else []) + ([f"loss={s.loss_type}"] if s.loss_type else []) \
        + (["precomputed-ref"] if s.precompute_ref_log_probs else []) \
        + ([f"prompt{s.prompt_len}"] if s.prompt_len else []) \
        + (["sequence-parallel"] if s.sequence_parallel else []) + (["loss-parallel"] if s.loss_parallel else []) \
        + ([f"reshard-after-forward={s.reshard_after_forward}"] if s.reshard_after_forward else []) \
        + (["shard-embeddings"] if s.shard_embeddings else []) \
        + ([f"gen{s.num_generations}"] if s.num_generations else []) \
        + ([f"completion{s.max_completion_length}"] if s.max_completion_length else []) \
        + ([f"beta{s.beta:g}"] if s.beta is not None else []) \
        + ([f"images{s.images_per_sample}x{s.image_size}"] if s.images_per_sample else []) + [f[7:].replace(
            "_", "-") + "-frozen" for f in ("freeze_vision_tower", "freeze_projector", "freeze_language_model")
            if getattr(s, f)] \
        + [f"{tag}{getattr(s, name)}" for name, tag in (("gradient_accumulation_steps", "ga"),
                                                         ("steps_per_generation", "spg"),
                                                         ("generation_batch_size", "gbs"))
           if getattr(s, name) is not None]
    return f"{s.model} {layout} {' '.join(extras)}"
