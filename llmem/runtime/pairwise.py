"""Pairwise objectives on the runtime floor: TRL's ORPO / SimPO / reward loss code run in the traced step.

The step of TRL's pairwise objectives without a reference (--objective orpo / simpo / reward) on the prepared
model: TRL's own loss code.

- orpo, simpo: trl.experimental's ORPOTrainer / CPOTrainer (loss_type simpo) `get_batch_loss_metrics`
  (trl/experimental/orpo/orpo_trainer.py, trl/experimental/cpo/cpo_trainer.py): `concatenated_inputs` cats the
  chosen and rejected rows (input ids, attention mask, labels: three new [2B, S] int64 tensors), the model returns
  full [2B, S, V] logits, the chosen rows' NLL (`cross_entropy_loss`: a contiguous copy of the shifted chosen logits,
  then nn.CrossEntropyLoss) and the per-token log-probs of every row (`get_batch_logps` -> trl.trainer.utils
  `selective_log_softmax`, which on CUDA with Triton is trl/kernels/logprob_entropy.py's fused kernel).
- reward: RewardTrainer.compute_loss (trl/trainer/reward_trainer.py): the sequence-classification model
  (num_labels=1) on the [2B, S] batch, its pooled [2B, 1] scores chunked into chosen and rejected,
  -logsigmoid(r_c - r_r).mean().

The trainer objects are made with `__new__`, carrying the attributes the loss reads (as llmem.runtime.objectives
does for DPO). Under mixed precision each model forward runs in its own autocast region and its outputs are cast
to fp32, as accelerate's Accelerator.prepare_model wraps it (`convert_outputs_to_fp32`, accelerate/accelerator.py):
the logits the loss sees are fp32.

Emulated, because fake tensors cannot run it (`pairwise_emulation_notes`): logprob_entropy's Triton kernels (its
autograd Function's allocations: four fp32 [rows, S-1] outputs, the logits and index saved, the gradient
`empty_like(logits)`; the kernels themselves write in place), the boolean-mask count of CPO's
`labels[labels == -100] = 0` (the prompt tokens), full-length padding masks, host scalar reads (1).
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections import defaultdict
from collections.abc import Iterator

import torch

from llmem.errors import LlmemError
from llmem.runtime.build import causal_lm, vocab_size
from llmem.runtime.losses import IGNORE_INDEX
from llmem.runtime.objectives import (
    KnownMasks,
    OneProcessAccelerator,
    TrainerRun,
    autocast_per_call,
    config_defaults,
    full_length_padding_mask,
    require_trl,
    trainer_step,
)
from llmem.runtime.patches import patched
from llmem.setup.objectives import check_dropout_free, completion_tokens, objective_notes, objective_spec


# ---------------------------------------------------------------------------------------------------- CUDA's path
class _LogProbEntropy(torch.autograd.Function):
    """trl/kernels/logprob_entropy.py _LogProbEntropyFunction's allocations (its Triton kernels write in place)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, index: torch.Tensor, temperature: float, row_mask):
        logprobs = torch.empty(logits.shape[:-1], device=logits.device, dtype=torch.float32)
        entropy = torch.empty_like(logprobs)
        log_z = torch.empty_like(logprobs)
        expected_logit = torch.empty_like(logprobs)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, index, log_z, expected_logit, row_mask)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, _index, _log_z, _expected, _mask = ctx.saved_tensors
        if grad_logprobs is not None:
            grad_logprobs.contiguous()
        return torch.empty_like(logits, memory_format=torch.contiguous_format), None, None, None


def _fused_logprob_entropy(logits, index, temperature: float = 1.0, row_mask=None):
    return _LogProbEntropy.apply(logits, index, temperature, row_mask)


def _supports_kernel(logits, index=None, row_mask=None) -> bool:
    """trl.trainer.utils._supports_trl_loss_kernel on the step's (CUDA) device."""
    ok = logits.dtype in (torch.float16, torch.bfloat16, torch.float32) and 1 <= logits.ndim <= 3 \
        and logits.stride(-1) == 1 and logits.shape[-1] > 0
    return ok and (index is None or (index.shape == logits.shape[:-1] and index.dtype in (torch.int32, torch.int64)))


@contextlib.contextmanager
def trl_logprob_kernel() -> Iterator[None]:
    """selective_log_softmax as it runs on CUDA with Triton (its fused log-prob / entropy kernel); restored on exit."""
    from trl.trainer import utils as trl_utils

    if not hasattr(trl_utils, "_supports_trl_loss_kernel"):
        raise LlmemError("the trace of a TRL objective emulates trl 1.16's selective_log_softmax kernel, and the "
                         "installed trl has none: pip install 'trl>=1.16,<1.17'")
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(trl_utils, "is_triton_available", lambda: True))
        stack.enter_context(patched(trl_utils, "_supports_trl_loss_kernel", _supports_kernel))
        stack.enter_context(patched(trl_utils, "_fused_logprob_entropy", _fused_logprob_entropy))
        yield


def fp32_outputs(module: torch.nn.Module, step) -> None:
    """Accelerator.prepare_model under mixed precision: the forward's fp16/bf16 outputs cast to fp32
    (accelerate.utils.convert_outputs_to_fp32), also under FSDP2, whose MixedPrecisionPolicy replaces autocast
    here (accelerate's native_amp wraps the forward whatever the distributed type)."""
    if step.autocast_dtype is None and not (step.setup.mixed and step.layout.spec.shards_model_states):
        return
    from accelerate.utils import convert_outputs_to_fp32

    module.forward = convert_outputs_to_fp32(module.forward)


# ---------------------------------------------------------------------------------------------------- the trainer
def trainer_class(objective: str):
    spec = objective_spec(objective)
    return getattr(importlib.import_module(spec.trainer_module), spec.trainer)


def _trainer_for(step):
    """An ORPOTrainer / CPOTrainer / RewardTrainer carrying what its loss reads, from its config's defaults."""
    setup = step.setup
    defaults = config_defaults(setup.objective)
    cls = trainer_class(setup.objective)
    trainer = cls.__new__(cls)
    attrs = {"model": step.model, "accelerator": OneProcessAccelerator(next(step.model.parameters()).device, step.model),
             "is_encoder_decoder": False, "aux_loss_enabled": False, "padding_value": 0, "pad_token_id": 0,
             "_metrics": {"train": defaultdict(list), "eval": defaultdict(list)}, "_total_train_tokens": 0,
             "_tp_size": 1}
    spec = objective_spec(setup.objective)
    if spec.scalar_head:       # RewardTrainer: the score head's loss reads args
        attrs["args"] = types.SimpleNamespace(center_rewards_coefficient=defaults["center_rewards_coefficient"])
    else:
        attrs["beta"] = defaults["beta"]
    if spec.loss_types:        # CPOTrainer under loss_type simpo (ORPOTrainer has no loss_type)
        attrs.update({"loss_type": spec.default_loss_type, "simpo_gamma": defaults["simpo_gamma"],
                      "cpo_alpha": defaults["cpo_alpha"], "alpha": defaults["alpha"],
                      "label_smoothing": defaults["label_smoothing"]})
    for name, value in attrs.items():
        object.__setattr__(trainer, name, value)
    return trainer


def pairwise_inputs(step) -> dict[str, torch.Tensor]:
    """The collator's batch on the device. ORPO / CPO (DPODataCollatorWithPadding over tokenize_row's fields):
    prompt_input_ids, prompt_attention_mask [B, P] (when there is a prompt), chosen_ and rejected_ input_ids,
    attention_mask, labels [B, S] int64 (labels -100 on the prompt). Reward (its DataCollatorForPreference):
    input_ids, attention_mask [2B, S] int64, chosen rows then rejected rows."""
    setup = step.setup
    device = step.input_ids.device
    b, seq, prompt = setup.batch_size, setup.seq_len, setup.prompt_len
    vocab = vocab_size(causal_lm(step.model))

    def ids(rows: int, cols: int) -> torch.Tensor:
        return torch.randint(1, vocab, (rows, cols), dtype=torch.int64, device=device)

    def ones(rows: int, cols: int) -> torch.Tensor:
        return torch.ones((rows, cols), dtype=torch.int64, device=device)

    if objective_spec(setup.objective).scalar_head:
        return {"input_ids": ids(2 * b, seq), "attention_mask": ones(2 * b, seq)}
    batch = {"prompt_input_ids": ids(b, prompt), "prompt_attention_mask": ones(b, prompt)} if prompt else {}
    for side in ("chosen", "rejected"):
        labels = ids(b, seq)
        labels[:, :prompt] = IGNORE_INDEX
        batch.update({f"{side}_input_ids": ids(b, seq), f"{side}_attention_mask": ones(b, seq),
                      f"{side}_labels": labels})
    return batch


def pairwise_run(step) -> TrainerRun:
    """What the step keeps across iterations, made once before it starts: dropout off, the batch, the trainer."""
    run = step.__dict__.get("_pairwise_run")
    if run is not None:
        return run
    require_trl(step.setup.objective)
    from trl.trainer.utils import disable_dropout_in_model

    setup = step.setup
    region = step.hooks.category
    check_dropout_free(setup.objective, causal_lm(step.model).config.to_dict())
    disable_dropout_in_model(step.model)
    if objective_spec(setup.objective).scalar_head:   # RewardTrainer sets the tokenizer's pad id (the ids avoid it)
        causal_lm(step.model).config.get_text_config().pad_token_id = 0
    autocast_per_call(step.model, step)
    fp32_outputs(step.model, step)
    with region("activations"):
        inputs = pairwise_inputs(step)
    # CPO's labels[labels == -100] = 0: the prompt tokens of each shifted row (ORPO uses torch.where)
    masks = KnownMasks({(2, setup.seq_len - 1): setup.seq_len - 1 - completion_tokens(setup)})
    run = TrainerRun(_trainer_for(step), inputs, masks)
    step.__dict__["_pairwise_run"] = run
    return run


def pairwise_loss(run: TrainerRun, model, objective: str) -> torch.Tensor:
    cls = type(run.trainer)
    if objective_spec(objective).scalar_head:
        return cls.compute_loss(run.trainer, model, dict(run.inputs))
    loss, _metrics = cls.get_batch_loss_metrics(run.trainer, model, run.inputs, train_eval="train")
    return loss


def pairwise_iteration(step, it: int) -> None:
    """One training step: TRL's loss (the model's forward inside), backward, the optimizer step and zero_grad, as
    Trainer.training_step runs them."""
    run = pairwise_run(step)
    trainer_step(step, it, lambda: pairwise_loss(run, step.runner, step.setup.objective),
                 on_fake=(trl_logprob_kernel(), full_length_padding_mask(), run.masks))


def pairwise_emulation_notes(setup) -> list[str]:
    spec = objective_spec(setup.objective)
    return objective_notes(setup) + [
        f"trace: TRL's {spec.trainer} loss code (its __init__ not run: the attributes from "
        f"{spec.trainer.replace('Trainer', 'Config')}'s defaults); model outputs cast to fp32 as accelerate's "
        "prepare_model does under mixed precision; selective_log_softmax's Triton kernel by its allocations; "
        "boolean-mask counts from the set-up, host scalar reads 1; full-length pairs (no padding mask)"]
