"""trl-sft on the runtime floor: TRL's SFTTrainer.compute_loss run in the traced step.

The step of --objective trl-sft is sft's prepared model (its method, adapters, checkpointing, Liger kernels) with
what SFTTrainer's __init__ adds and its compute_loss runs (trl/trainer/sft_trainer.py, the installed trl):
- TRL's fused LM head on the causal LM (under peft its base model): `add_fused_lm_head(model, outputs=("log_probs",
  "entropy", "is_top1"))`, the outputs SFTTrainer asks for; the model's forward in its own autocast region, as
  Accelerator.prepare_model wraps it (llmem.runtime.objectives.autocast_per_call);
- each iteration `SFTTrainer.compute_loss` (on an instance made with `SFTTrainer.__new__` carrying the attributes it
  reads: the config's loss_type, no compute_loss_func, no label smoother, no MoE aux loss, accelerate without
  sequence parallelism) on the collator's batch (`sft_inputs`), then backward and the optimizer step, as
  transformers' Trainer.training_step does (llmem.runtime.objectives.trainer_step).

Emulated on fake tensors as for the preference step (llmem.runtime.objectives' module docstring): TRL's CUDA path of
its fused head (only the label tokens projected, the Triton kernels in place), the label mask's true count from the
set-up (`completion_tokens` per row: every token but the first, or the completion after --prompt-len), the
all-ones attention mask's SDPA shortcut, host scalar reads (the metrics' `.item()`) 1.
"""

from __future__ import annotations

import types
from collections import defaultdict

import torch

from llmem.runtime.build import causal_lm
from llmem.runtime.losses import IGNORE_INDEX
from llmem.runtime.objectives import (
    KnownMasks,
    OneProcessAccelerator,
    TrainerRun,
    autocast_per_call,
    require_trl,
    trainer_step,
    trl_fake_contexts,
)
from llmem.setup.objectives import completion_tokens, loss_type_of, objective_notes, objective_spec


def sft_inputs(step) -> dict[str, torch.Tensor]:
    """DataCollatorForLanguageModeling's batch on the device: input_ids (the step's), labels (-100 on the first
    --prompt-len tokens: completion_only_loss), attention_mask of ones [B, S] int64; padding_free (--packing): the
    packed step's position_ids in place of the attention mask."""
    setup = step.setup
    ids = step.input_ids
    labels = ids.clone()
    labels[:, :setup.prompt_len] = IGNORE_INDEX     # DataCollatorForLanguageModeling's label padding
    batch = {"input_ids": ids, "labels": labels}
    if step.position_ids is not None:
        batch["position_ids"] = step.position_ids
    else:
        batch["attention_mask"] = torch.ones_like(ids)
    return batch


def _trainer_for(step):
    """An SFTTrainer carrying what its compute_loss reads (its __init__'s attributes, from SFTConfig's values)."""
    from trl import SFTTrainer

    accelerator = OneProcessAccelerator(next(step.model.parameters()).device, step.model)
    accelerator.parallelism_config = None       # no context / sequence parallelism
    trainer = SFTTrainer.__new__(SFTTrainer)
    attrs = {"model": step.model, "accelerator": accelerator,
             "args": types.SimpleNamespace(loss_type=loss_type_of(step.setup), average_tokens_across_devices=True),
             "aux_loss_enabled": False, "compute_loss_func": None, "label_smoother": None,
             "_metrics": {"train": defaultdict(list), "eval": defaultdict(list)}, "_total_train_tokens": 0,
             "_tp_size": 1}
    for name, value in attrs.items():
        object.__setattr__(trainer, name, value)
    return trainer


def sft_run(step) -> TrainerRun:
    """What the step keeps across iterations, made once before it starts: the fused head, the batch (as
    activations), the trainer."""
    run = step.__dict__.get("_sft_run")
    if run is not None:
        return run
    require_trl(step.setup.objective)
    from trl.trainer.utils import add_fused_lm_head

    setup = step.setup
    add_fused_lm_head(causal_lm(step.model), outputs=objective_spec(setup.objective).head_outputs)
    autocast_per_call(step.model, step)
    with step.hooks.category("activations"):
        inputs = sft_inputs(step)
    seq = setup.seq_len
    masks = KnownMasks({(2, seq - 1): completion_tokens(setup)})
    run = TrainerRun(_trainer_for(step), inputs, masks)
    step.__dict__["_sft_run"] = run
    return run


def sft_iteration(step, it: int) -> None:
    """One SFTTrainer step: compute_loss (the model's forward with its fused head, the loss), backward, the
    optimizer step and zero_grad, as Trainer.training_step runs them."""
    run = sft_run(step)
    cls = type(run.trainer)
    trainer_step(step, it, lambda: cls.compute_loss(run.trainer, step.runner, run.inputs),
                 on_fake=trl_fake_contexts(run.masks))


def sft_emulation_notes(setup) -> list[str]:
    """What the trace's result says about the SFTTrainer step it ran."""
    return objective_notes(setup) + [
        "trace: TRL's SFTTrainer.compute_loss (its __init__ not run: the fused head added as it adds it, the "
        "attributes from SFTConfig's values); its fused LM head on CUDA's path (only the label tokens projected, "
        "the Triton kernels in place without allocations, fp32 accumulation without copies); label counts from the "
        "set-up, host scalar reads 1; full-length rows (an all-ones attention mask); metric gathers across ranks "
        "not traced"]
