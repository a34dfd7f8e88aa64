"""The job's evaluation phase beside its training step: the peak of tensor bytes on one GPU and of CPU RAM on one
node while HF Trainer's `evaluate` runs between steps (transformers 5.25 trainer.py, accelerate 1.16), worked out
from the code as read; llmem.setup.eval_phase says whether the set-up evaluates and what each eval step keeps.
Pure arithmetic over `EvalBytes`, which `eval_bytes` reads once from the resolved set-up.

What stays on the GPU is what the step keeps between steps, as a checkpoint's save finds it
(llmem.estimator.job_phases.between_steps_bytes: the training loop evaluates after optimizer.step and
zero_grad(set_to_none=True)): the model's weights and the optimizer's states, DDP's buckets, cuBLAS's workspace
(made at the step's first matmul, kept), under ZeRO-3 its gradient partitions and IPG bucket (ZeRO-1/2 release
theirs at the end of backward: stage_1_and_2.py _release_ipg_buffers); what the eval step adds:
- `inference_forward`: prediction_step's forward under no_grad at --eval-batch-size (compute_loss with the labels:
  the model's own ForCausalLMLoss): the batch; per decoder layer, the residual stream in and out and two adjacent
  blocks' tensors (what the layer's ops make, freed once the next block has used them, as
  llmem.estimator.objectives' no-grad forward); FSDP2's gathered units (the root kept, a layer and its
  prefetched successor, at the head the last layer's all-gather output until the root's post-forward; zero2: every
  layer kept gathered); a quantised base's dequantisation transients of its
  largest linear (one at a time); autocast's cache of the trained fp32 weights' casts
  (cached whatever the grad mode, cleared when the forward's autocast region exits); at the head the final norm's
  output, the logits in the matmuls' dtype, their fp32 upcast and log-softmax; after it accelerate's
  convert_outputs_to_fp32 (native AMP: every precision but DeepSpeed's) copies the logits to fp32;
- `kept_across_steps`: evaluation_loop's containers (EvalLoopContainer, eval_do_concat_batches): each step's kept
  tensors (the losses; with compute_metrics the logits, or preprocess_logits_for_metrics' token ids, and the
  labels) gathered from every rank (gather_for_metrics: all_gather_into_tensor, so each GPU holds all ranks') and
  torch.cat onto the previous ones: at step k the cat's output (k steps) beside its inputs (k - 1 steps and this
  one); the previous step's tensors stay bound to the loop's variables while the next forward runs. Every
  eval_accumulation_steps steps the containers go to the host (nested_numpify) and the GPU's are freed;
- the host: every rank keeps every rank's numpified predictions (bf16 converted to fp32), concatenated in numpy at
  each move (the old arrays, the moved ones and their concatenation).

Known limitations: analytic, not replayed or traced; tensor bytes (no allocator rounding or cache); the labels
and losses are counted as if concatenated with the predictions, 2 k steps of them at the cat (theirs comes after
the predictions': the loop then holds k - 1, so at most k + 1 steps' labels and losses too many, int64 per token
against the logits' vocabulary of fp32); the eval set's length decides how many steps keep their tensors when
eval_accumulation_steps is not set (--eval-samples; without it the phase counts one step and a note says so);
sequences are --seq-len long (pad_across_processes and the cat's padding add nothing); one eval dataset; the
loss's per-token scalars, the per-use casts of frozen fp32 weights, a packed batch's extra tensors and eager
attention's forward temporaries (its fp32 softmax beside the scores: a note says so) are left out.
`llmem trace` runs the eval (llmem.runtime.evaluation): the two agree within 0.01 % on tiny-llama, gpt2,
opt-1.3b and Qwen2.5-0.5B under single, ddp, fsdp, zero2 and QLoRA (tests/runtime/test_eval_trace.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from llmem.estimator.generation import policy_gathered_bytes
from llmem.estimator.job_phases import between_steps_bytes
from llmem.estimator.states import ModelStates
from llmem.memory.activations.profile import ActivationProfile, effective_attention
from llmem.memory.quant import events_peak, is_quantised, quant_args, transients
from llmem.model.peft import element_bytes
from llmem.model.resolved import ResolvedSetup
from llmem.model.sharding import MATMUL_KINDS, is_lm_head
from llmem.result import EVAL_PHASE, JobPhase
from llmem.setup.eval_phase import EVAL_KEEPS, eval_runs, eval_unmodelled, kept_steps, native_amp
from llmem.setup.precision import F32
from llmem.units import format_bytes

INT64 = 8
BATCH_TENSORS = 3        # input_ids, attention_mask, labels [eval batch, seq] int64


@dataclass(frozen=True)
class EvalBytes:
    """The bytes the eval phase is made of, on one GPU (`host_*`: on one rank's host)."""
    ranks_per_node: int
    resident_bytes: int            # what the step keeps between steps (job_phases.between_steps_bytes)
    batch_bytes: int               # the eval batch's input_ids, attention_mask and labels
    layer_gathered_bytes: int      # FSDP2: units gathered while a decoder layer runs (0 without FSDP2)
    head_gathered_bytes: int       # ... while the head runs (the root's forward: the last layer's output buffer too)
    kept_gathered_bytes: int       # ... after the forward (the root stays gathered: no backward reshards it)
    casts_bytes: int               # autocast's cached casts of the trained fp32 weights (0 without autocast)
    dequant_bytes: int             # a quantised base: the largest linear's dequantisation transients (0 without)
    layer_bytes: int               # one decoder layer's no-grad peak: stream in and out, two adjacent blocks, shared
    head_bytes: int                # the head's: final norm output, logits, their fp32 upcast, log-softmax
    output_bytes: int              # after the forward: the logits and convert_outputs_to_fp32's copy
    local_kept_bytes: int          # this rank's kept tensors of one step, before the gather
    step_kept_bytes: int           # one step's kept tensors gathered from every rank
    kept_steps: int                # the steps whose kept tensors are on the GPU at once
    gathers: bool                  # several ranks: gather_for_metrics makes a new tensor
    host_bytes: int                # one rank's host arrays at their peak


# ------------------------------------------------------------------------------------------------ the behaviours

def inference_forward(b: EvalBytes) -> int:
    """prediction_step's forward under torch.no_grad (compute_loss with the labels, the model's ForCausalLMLoss):
    the largest of a decoder layer's moment and the head's, with autocast's cache and FSDP2's gathered units, then
    the logits copied to fp32 once the autocast region has exited (its cache cleared)."""
    layer = b.casts_bytes + b.layer_gathered_bytes + b.layer_bytes + b.dequant_bytes
    head = b.casts_bytes + b.head_gathered_bytes + b.head_bytes
    return b.batch_bytes + max(layer, head, b.output_bytes)


def held_during_forward(b: EvalBytes) -> int:
    """What the containers hold while the last kept step's forward runs: k - 1 steps concatenated, and from the
    third step on the previous step's own tensors (still bound to evaluation_loop's variables; at the second the
    container is that tensor itself)."""
    k, g = b.kept_steps, b.step_kept_bytes
    return (k - 1) * g + (g if k >= 3 else 0)


def kept_across_steps(b: EvalBytes) -> int:
    """evaluation_loop after the last kept step's forward: the local kept tensors gathered from every rank
    (gather_for_metrics; one rank: the tensor itself), then torch.cat onto the k - 1 steps held (nested_concat):
    its output beside both inputs. FSDP2's root unit stays gathered after the forward (no backward reshards it)."""
    k, g = b.kept_steps, b.step_kept_bytes
    gather = (k - 1) * g + b.local_kept_bytes + g if b.gathers else 0
    cat = 2 * k * g if k >= 2 else g
    return b.batch_bytes + b.kept_gathered_bytes + max(gather, cat)


def trainer_evaluate(b: EvalBytes) -> tuple[int, int]:
    """HF Trainer's evaluate between training steps: (device bytes per GPU, host bytes per node)."""
    device = b.resident_bytes + max(held_during_forward(b) + inference_forward(b), kept_across_steps(b))
    return device, b.ranks_per_node * b.host_bytes


# ------------------------------------------------------------------------------------------------ the set-up's

def layer_no_grad_bytes(act: ActivationProfile, scale: float, stream: int) -> int:
    """One decoder layer under no_grad at the eval batch (the training profile's tensors scaled by the batch
    ratio): the stream in, two adjacent blocks' tensors (or the last block's and the layer's output), the shared
    tensors (rotary cos / sin, a packed mask)."""
    blocks = [ceil(sum(blk.tensors) * scale) for blk in act.blocks]
    pairs = [a + c for a, c in zip([0, *blocks], blocks, strict=False)] + [blocks[-1] + stream if blocks else stream]
    shared = ceil((sum(act.shared_tensors) + act.mask_bytes) * scale)
    return stream + max(pairs) + shared


def host_array_bytes(per_sample: int, samples: int | None, chunk_samples: int) -> int:
    """One rank's numpified arrays at their peak: all the eval's samples, and where they come in several moves the
    last concatenation's inputs beside its output (2 x all - the last move); without --eval-samples one move."""
    if samples is None:
        return per_sample * chunk_samples
    if chunk_samples >= samples:
        return per_sample * samples
    last = samples - (ceil(samples / chunk_samples) - 1) * chunk_samples
    return per_sample * (2 * samples - last)


def logits_out_bytes(r: ResolvedSetup) -> int:
    """Bytes per element of the logits prediction_step returns: fp32 under accelerate's native AMP
    (convert_outputs_to_fp32; every precision but DeepSpeed's, whose engine runs the model in its own dtype)."""
    return F32 if native_amp(r.setup) else r.setup.compute_bytes


def sample_kept_bytes(r: ResolvedSetup, logits_bytes: int) -> int:
    """One sample's kept tensors: the predictions (the logits at `logits_bytes` per element, or the token ids) and
    the labels where the Trainer keeps them, and its loss (fp32)."""
    s = r.setup
    keep = EVAL_KEEPS[s.eval_keeps]
    per_token = r.anatomy.vocab_size * logits_bytes if keep.token_bytes is None else keep.token_bytes
    return s.seq_len * (per_token + (INT64 if keep.labels else 0)) + F32


def local_kept_bytes(r: ResolvedSetup) -> int:
    """One eval step's kept tensors on this rank before the gather: its samples' predictions (logits or token ids)
    and labels where the Trainer keeps them, and the loss repeated per sample."""
    return r.setup.eval_batch_size * sample_kept_bytes(r, logits_out_bytes(r))


def host_sample_bytes(r: ResolvedSetup) -> int:
    """One sample's numpified arrays: the predictions (bf16 converted to fp32 by nested_numpify), the labels, the
    loss."""
    return sample_kept_bytes(r, F32 if r.setup.compute_dtype == "bfloat16" else logits_out_bytes(r))


def cached_casts_bytes(r: ResolvedSetup) -> int:
    """Autocast's cache at the forward's end: the casts of the trained fp32 parameters of the matmuls (weights and
    biases: leaves requiring grad, cached whatever the grad mode); a frozen fp32 weight's cast (the upcast lm_head of
    a quantised base) is made and freed at each use (nothing saves it under no_grad)."""
    s = r.setup
    if not r.regime.autocast:
        return 0
    return sum(p.numel for p in r.anatomy.params if p.trainable and element_bytes(p, s) == F32
               and (p.module_kind in MATMUL_KINDS or is_lm_head(p))) * r.regime.mm   # (a tied lm_head's too)


def dequant_bytes(r: ResolvedSetup, tokens: int) -> int:
    """A quantised base's largest forward transients of one linear at `tokens` tokens (bitsandbytes' dequantised
    weight and absmax, torchao's, LLM.int8's int8 matmul's: llmem.memory.quant), made and freed per matmul."""
    s = r.setup
    if not s.quant_spec.quantised:
        return 0
    args = quant_args(s, r.layout.shards_model_states)
    return max((events_peak(transients(p.shape, s.quant_base, args, tokens, s.compute_dtype == "float16",
                                       p.module_kind == "Conv1D").forward)
                for p in r.anatomy.params if is_quantised(p, s.quant_base)), default=0)


def eval_bytes(r: ResolvedSetup, ms: ModelStates, act: ActivationProfile) -> EvalBytes:
    """The bytes of `EvalBytes` for a resolved set-up that evaluates (`act`: its training step's profile)."""
    s, regime, world = r.setup, r.regime, r.layout.world_size
    b, h, v = s.eval_batch_size, r.anatomy.hidden_size, r.anatomy.vocab_size
    t = b * s.seq_len
    ld, mm, out = act.loss_bytes, regime.mm, logits_out_bytes(r)
    head = t * h * regime.res + t * v * mm + (t * v * ld if mm != ld else 0) + t * v * ld + t * v * act.nll_cast
    root, layer, layers = policy_gathered_bytes(r)
    kept_gathered = not r.method.reshard_after_forward      # zero2: every layer stays gathered
    steps = kept_steps(s, world)
    local = local_kept_bytes(r)
    return EvalBytes(
        ranks_per_node=min(r.layout.gpus_per_node, world),
        resident_bytes=between_steps_bytes(r, ms),
        batch_bytes=BATCH_TENSORS * t * INT64,
        # the unsharded units (zero2: every layer once gathered) and one unit's all-gather output: the next
        # layer's prefetch while a layer runs, the last layer's until the root's post-forward
        layer_gathered_bytes=root + (layers if kept_gathered else layer) + layer,
        head_gathered_bytes=root + (layers if kept_gathered else 0) + layer,
        kept_gathered_bytes=root + (layers if kept_gathered else 0),
        casts_bytes=cached_casts_bytes(r),
        dequant_bytes=dequant_bytes(r, t),
        layer_bytes=layer_no_grad_bytes(act, b / s.batch_size, t * h * regime.res),
        head_bytes=head, output_bytes=t * v * mm + (t * v * out if out != mm else 0),
        local_kept_bytes=local, step_kept_bytes=world * local, kept_steps=steps, gathers=world > 1,
        host_bytes=host_array_bytes(host_sample_bytes(r), s.eval_samples, steps * world * b),
    )


def eval_phase(r: ResolvedSetup, ms: ModelStates, act: ActivationProfile) -> JobPhase | None:
    """The eval phase of a set-up that evaluates where llmem.setup.eval_phase models it (None otherwise)."""
    if not eval_runs(r.setup) or eval_unmodelled(r.setup) is not None:
        return None
    device, host = trainer_evaluate(eval_bytes(r, ms, act))
    keep = EVAL_KEEPS[r.setup.eval_keeps]
    what = (f"HF Trainer's evaluate at {r.setup.eval_batch_size} per GPU under no_grad, keeping {keep.summary}")
    return JobPhase(EVAL_PHASE, keep.name, device, host, what)


def eval_notes(r: ResolvedSetup) -> list[str]:
    """What the answer says of its eval: not modelled and why; kept tensors whose number of steps is not known (the
    phase then counts one step on the GPU, one move on the host)."""
    s = r.setup
    if not eval_runs(s):
        return []
    why = eval_unmodelled(s)
    if why is not None:
        return [f"the eval phase (--eval-batch-size {s.eval_batch_size}) is not modelled under {why}: the job's "
                "peak may lie there"]
    notes = []
    if effective_attention(r.anatomy, s).keeps_scores:
        notes.append("eval under eager attention: the fp32 softmax of each layer's [batch, heads, seq, seq] scores "
                     "beside them is not counted in its moment (2.5 % low against the trace on opt-1.3b at 2 x 2048 "
                     "tokens)")
    if not EVAL_KEEPS[s.eval_keeps].labels or s.eval_samples is not None:
        return notes
    per_step = format_bytes(r.layout.world_size * local_kept_bytes(r))
    if s.eval_accumulation_steps is None:
        return notes + [f"eval keeps {s.eval_keeps} on the GPU across the whole eval set (no "
                        f"--eval-accumulation-steps): {per_step} more on each GPU per eval step; the phase counts one "
                        "step: give --eval-samples N (or --eval-accumulation-steps N) to size it"]
    return notes + [f"eval moves {s.eval_keeps} to the host every {s.eval_accumulation_steps} steps and keeps them "
                    f"all: {per_step} more per eval step on each rank's host; the phase counts one move: give "
                    "--eval-samples N to size it"]
