"""`llmem trace` of the job's eval phase: HF Trainer's evaluation_loop (transformers 5.25) run on the traced step's
model after its training iterations, its allocations recorded under the ledger's "eval" phase.

What runs for real: the model in eval mode under torch.no_grad, called as prediction_step's compute_loss calls it
(input_ids and labels; the model's own loss on full logits), under the step's autocast; transformers'
EvalLoopContainer and nested_concat keeping what --eval-keeps says. What is emulated: accelerate's
convert_outputs_to_fp32 (the logits copied to fp32 under native AMP), gather_for_metrics (a new tensor of every
rank's rows; one rank: the tensor itself), preprocess_logits_for_metrics' argmax (token ids), the batch's
attention_mask (all ones: allocated, not passed, as the traced step passes none), and the move to the host every
eval_accumulation_steps steps (the device tensors released; the host's numpy arrays are not traced).
"""

from __future__ import annotations

import contextlib

import torch

from llmem.result import EVAL_PHASE, JobPhase
from llmem.runtime.ledger import Ledger
from llmem.runtime.losses import IGNORE_INDEX
from llmem.runtime.replay import phase_tensor_peak
from llmem.setup.eval_phase import EVAL_KEEPS, eval_runs, eval_unmodelled
from llmem.units import format_bytes


def _gathered(t: torch.Tensor, world: int) -> torch.Tensor:
    """gather_for_metrics' all_gather_into_tensor: every rank's rows in a new tensor (one rank: `t` itself)."""
    if world == 1:
        return t
    out = t.new_empty((world * t.shape[0], *t.shape[1:]))
    out[: t.shape[0]].copy_(t)
    return out


def prediction_step(step, batch: dict, keeps):
    """prediction_step under torch.no_grad: (loss, logits or None); the model's outputs die as it returns. The trace
    runs no DeepSpeed engine (llmem.runtime.deepspeed runs its own), so accelerate's native AMP always applies."""
    ctx = torch.autocast(step.device_type, dtype=step.autocast_dtype) if step.autocast_dtype is not None \
        else contextlib.nullcontext()
    with torch.no_grad():
        with ctx:
            out = step.runner(input_ids=batch["input_ids"], labels=batch["labels"])
        if step.autocast_policy is not None:          # autocast's exit clears its cache
            step.autocast_policy.cache.clear()
        logits = out.logits
        if logits.dtype != torch.float32:             # accelerate's convert_outputs_to_fp32
            logits = logits.float()
        loss = out.loss.detach().mean()
        del out
    return loss, (logits if keeps.labels else None)


def evaluation_loop(step, steps: int) -> None:
    """evaluation_loop over `steps` eval batches (losses, then predictions and labels gathered and concatenated),
    releasing the device containers every eval_accumulation_steps steps."""
    from transformers.trainer_pt_utils import EvalLoopContainer

    setup, world = step.setup, step.layout.world_size
    keeps, batch_size, every = EVAL_KEEPS[setup.eval_keeps], setup.eval_batch_size, setup.eval_accumulation_steps
    step.runner.eval()
    containers = [EvalLoopContainer(True, padding_index=IGNORE_INDEX) for _ in range(3)]   # losses, predictions, labels
    loss = logits = labels = None
    for i in range(steps):
        ids = torch.zeros((batch_size, setup.seq_len), dtype=torch.int64, device=step.input_ids.device)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        loss, logits = prediction_step(step, batch, keeps)
        labels = batch["labels"] if keeps.labels else None
        containers[0].add(_gathered(loss.repeat(batch_size), world))
        if logits is not None:
            if keeps.token_bytes is not None:          # preprocess_logits_for_metrics: the argmax
                logits = logits.argmax(dim=-1)
            logits = _gathered(logits, world)
            containers[1].add(logits)
            labels = _gathered(labels, world)
            containers[2].add(labels)
        del batch, ids
        if every is not None and (i + 1) % every == 0:   # to_cpu_and_numpy: the device tensors released
            for c in containers:
                c.tensors = None
            loss = logits = labels = None
    del loss, logits, labels
    for c in containers:
        c.tensors = None
    step.runner.train()


def eval_traced(setup) -> bool:
    """Whether the trace runs the job's eval: a set-up that evaluates, where the estimate models the phase. Asked
    only of the trace's own step: DeepSpeed's engine runs its own trace (llmem.runtime.deepspeed), no eval there."""
    return eval_runs(setup) and eval_unmodelled(setup) is None


def eval_job_phase(ledger: Ledger, setup, step_events: int) -> list[JobPhase]:
    """The eval phase's peak of tensor bytes over the whole ledger (a running sum of its events: replay_ledger's
    number, without replaying the allocator); the ledger then keeps the step's own events (the training
    iterations: the step's answer)."""
    peak = phase_tensor_peak(ledger, EVAL_PHASE)
    ledger.events = ledger.events[:step_events]
    keep = EVAL_KEEPS[setup.eval_keeps]
    what = (f"traced: the model's forward under no_grad at {setup.eval_batch_size} per GPU, evaluation_loop's "
            f"containers keeping {keep.summary}")
    return [JobPhase(EVAL_PHASE, keep.name, peak, 0, what)]


def eval_trace_notes(setup, job: list[JobPhase]) -> list[str]:
    """What the trace says of its eval: traced (the host's arrays not), or not traced and why."""
    if job:
        return [f"eval traced after the step: {format_bytes(job[0].device_bytes)} of tensors per GPU at its peak "
                "(the host's numpy arrays are not traced: host 0)"]
    if not eval_runs(setup):
        return []
    why = eval_unmodelled(setup) or "DeepSpeed (its engine's own trace)"
    return [f"the eval (--eval-batch-size {setup.eval_batch_size}) is not traced under {why}"]
