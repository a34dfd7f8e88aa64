"""Preference objectives on the runtime floor: TRL's DPO / KTO trainer code run in the traced step.

The step of a TRL preference objective (--objective dpo / kto) on the prepared model: TRL's own trainer code.

Each iteration calls the trainer's `_compute_loss` (trl/trainer/dpo_trainer.py or kto_trainer.py, the installed trl)
on the step's model, then backward and the optimizer step, as transformers' Trainer.training_step does. The
trainer object is not constructed (its __init__ loads a tokenizer, tokenizes a dataset and builds an Accelerator):
`_compute_loss` runs on an instance made with `DPOTrainer.__new__` / `KTOTrainer.__new__` carrying the attributes it
reads, set from the config's defaults and the set-up (`_trainer_for`); the policy gets TRL's fused LM head
(`add_fused_lm_head`, with the per-token fields the trainer's metrics read) and TRL's `disable_dropout_in_model` as
the trainer's __init__ gives them, and each model's forward runs in its own autocast region, as
Accelerator.prepare_model wraps it. The batch is what the collator returns, on the device (`preference_inputs`):
DPO's chosen rows then rejected rows, KTO's completions (half desirable) and their KL sequences, each `--seq-len`
tokens, the first `--prompt-len` of them prompt.

The reference, as the trainers hold it: a second model built like the policy (the same class and attention,
materialised on fake tensors in the policy's dtype, TRL's `dtype=self.model.dtype`, or --ref-dtype compute), frozen,
in eval mode, with its own fused head (log-probs only), made before the step starts (TRL loads it at trainer init,
before DDP's buckets); under peft none (TRL's `use_adapter(model, None)` disables the adapters for the reference
forward); with --precompute-ref-log-probs none (the log-probs come with the batch). Under FSDP2 (--method fsdp /
zero2) the copy is sharded as trl's `prepare_fsdp` does it: one `fully_shard` on the whole model (`prepare_fsdp`
below), so its forward all-gathers it whole; the policy keeps llmem's FSDP2 layout (each decoder layer, then the
root). Under DeepSpeed (--method ds-zero1/2/3) it goes through TRL's prepare_deepspeed (llmem.runtime.deepspeed).

Emulated, because fake tensors cannot run it (`emulation_notes`):
- TRL's CUDA path of its fused head (`_use_triton` is true on CUDA): only the completion tokens are projected
  (`hidden[mask]`), its Triton kernels fold each [tokens, vocab] tile in place (no allocations: here a no-op), and
  the gradient GEMMs accumulate with `addmm(out_dtype=float32, out=acc)` (no fp32 copies of the tile);
- the data-dependent shapes of boolean-mask indexing (`x[mask]`, `masked_select`, `nonzero`): the number of true
  entries of a completion mask is known from the set-up (`completion_tokens` per row), KTO's labels are half
  desirable; the index tensor CUDA's nonzero makes is allocated as on the device; host reads of a scalar (`.item()`,
  `if t > 0`: only the trainers' metrics read any) read 1;
- the padding mask: every sequence is full length (all ones), so transformers' SDPA skips the causal mask, as it does
  for real tensors (it keeps it for fake ones);
- `disable_gradient_checkpointing` around the reference forward turns the layers' checkpointing off and restores it
  as it was (TRL's re-enables it with the trainer's kwargs, which here are llmem's);
- the metrics' gathers across ranks (a few scalars) are the identity.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass, fields

import torch

from llmem.errors import LlmemError
from llmem.runtime.build import causal_lm, init_real_weights, materialize, meta_model_for, vocab_size
from llmem.runtime.cuda import is_fake_tensor
from llmem.runtime.known_masks import KnownMasks
from llmem.runtime.patches import patched, quiet
from llmem.setup.objectives import (
    REF_COPY,
    check_dropout_free,
    completion_tokens,
    kl_sequences,
    loss_type_of,
    objective_notes,
    objective_spec,
    reference_mode,
)


# ---------------------------------------------------------------------------------------------------- CUDA's path
class _InPlaceKernel:
    """A Triton kernel launched as `kernel[grid](...)` that writes only into tensors it is given: no allocation."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _addmm_fp32_cuda(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """chunked_logprob._addmm_fp32 on CUDA: one addmm into the fp32 accumulator (out_dtype=float32 for 16-bit
    inputs), no fp32 copies of its operands."""
    if a.dtype in (torch.float16, torch.bfloat16):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a, b)


@contextlib.contextmanager
def trl_cuda_head() -> Iterator[None]:
    """TRL's fused LM head as it runs on CUDA (module docstring); restored on exit."""
    from trl.kernels import chunked_logprob
    from trl.trainer import utils as trl_utils

    needed = [(trl_utils, "_use_triton"), (chunked_logprob, "_use_triton"), (chunked_logprob, "_forward_kernel"),
              (chunked_logprob, "_backward_kernel"), (chunked_logprob, "_addmm_fp32")]
    missing = [f"{m.__name__}.{name}" for m, name in needed if not hasattr(m, name)]
    if missing:
        raise LlmemError(f"the trace of a TRL objective emulates trl 1.16's fused LM head, and the installed trl has "
                         f"no {', '.join(missing)}: pip install 'trl>=1.16,<1.17'")
    on_cuda = lambda device: True  # noqa: E731 - the step's device is a CUDA GPU
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(trl_utils, "_use_triton", on_cuda))
        stack.enter_context(patched(chunked_logprob, "_use_triton", on_cuda))
        stack.enter_context(patched(chunked_logprob, "_forward_kernel", _InPlaceKernel()))
        stack.enter_context(patched(chunked_logprob, "_backward_kernel", _InPlaceKernel()))
        stack.enter_context(patched(chunked_logprob, "triton", types.SimpleNamespace(cdiv=lambda a, b: -(-a // b))))
        stack.enter_context(patched(chunked_logprob, "_addmm_fp32", _addmm_fp32_cuda))
        yield


@contextlib.contextmanager
def full_length_padding_mask() -> Iterator[None]:
    """transformers' SDPA mask shortcut for a padding mask of all ones (every pair full length): the check the real
    run evaluates (`padding_mask.all()`), then its answer for no padding, also for fake tensors."""
    from transformers import masking_utils

    orig = masking_utils._ignore_causal_mask_sdpa

    def ignore(padding_mask, *args, **kwargs):
        if padding_mask is not None and is_fake_tensor(padding_mask):
            padding_mask.all()
            padding_mask = None
        return orig(padding_mask, *args, **kwargs)

    with patched(masking_utils, "_ignore_causal_mask_sdpa", ignore):
        yield


@contextlib.contextmanager
def policy_checkpointing_paused(model, gradient_checkpointing_kwargs=None) -> Iterator[None]:
    """trl.models.utils.disable_gradient_checkpointing for the reference forward: every layer's checkpointing off,
    then each layer's flag as it was (TRL re-enables it with its trainer's kwargs; here llmem enabled it)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    flags = [layer.gradient_checkpointing for layer in layers]
    for layer in layers:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        for layer, flag in zip(layers, flags, strict=True):
            layer.gradient_checkpointing = flag


# ---------------------------------------------------------------------------------------------------- the trainer
class OneProcessAccelerator:
    """What TRL's `_compute_loss` (and GRPO's `_get_per_token_logps_and_entropies`) ask of the trainer's Accelerator
    on one process: the device, the unwrapped model, its autocast (the model's forward runs in its own region:
    autocast_per_call), gathers and reduces (the identity: the metrics' scalars of the other ranks are not
    traced)."""

    def __init__(self, device: torch.device, model, world_size: int = 1) -> None:
        self.device, self.model, self.num_processes, self.process_index = device, model, world_size, 0
        self.sync_gradients = self.is_main_process = True

    def autocast(self):
        return contextlib.nullcontext()

    def unwrap_model(self, model):
        return self.model

    def gather_for_metrics(self, x):
        return x

    def gather(self, x):
        return x

    def reduce(self, x, reduction: str = "sum"):
        return x


def config_defaults(objective: str) -> dict:
    """The trainer config's field defaults (the installed trl's DPOConfig / KTOConfig), without building a
    TrainingArguments."""
    import importlib

    spec = objective_spec(objective)
    out = {}
    for f in fields(getattr(importlib.import_module(spec.trainer_module), spec.trainer.replace("Trainer", "Config"))):
        if f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
        elif f.default is not MISSING:
            out[f.name] = f.default
    return out


def trainer_class(objective: str):
    import trl

    return getattr(trl, objective_spec(objective).trainer)


def _dpo_loss_attrs(setup, defaults: dict, loss_type: str) -> dict:
    """DPOTrainer's __init__: a list of loss types with their weights, and its divergence settings."""
    return {"loss_types": [loss_type], "loss_weights": [1.0], "ld_alpha": defaults["ld_alpha"],
            "f_divergence_type": defaults["f_divergence_type"],
            "f_alpha_divergence_coef": defaults["f_alpha_divergence_coef"],
            # exo_pair needs a label smoothing > 0 (DPOTrainer refuses 0): the EXO paper's 1e-3
            "label_smoothing": 1e-3 if loss_type == "exo_pair" else defaults["label_smoothing"],
            "use_weighting": defaults["use_weighting"]}


def _kto_loss_attrs(setup, defaults: dict, loss_type: str) -> dict:
    """KTOTrainer's __init__: one loss type, the desirable / undesirable weights, the KL term's switch."""
    return {"loss_type": loss_type, "desirable_weight": defaults["desirable_weight"],
            "undesirable_weight": defaults["undesirable_weight"], "calculate_KL": kl_sequences(setup)}


# the loss attributes each trainer's __init__ sets, by the objective row's trainer class
_LOSS_ATTRS: dict[str, Callable[..., dict]] = {"DPOTrainer": _dpo_loss_attrs, "KTOTrainer": _kto_loss_attrs}


def _trainer_for(step, ref_model):
    """A DPOTrainer / KTOTrainer carrying what its `_compute_loss` reads (its __init__'s attributes, from its
    config's defaults and the set-up)."""
    setup = step.setup
    defaults = config_defaults(setup.objective)
    loss_type = loss_type_of(setup)
    trainer = trainer_class(setup.objective).__new__(trainer_class(setup.objective))
    attrs = {
        "model": step.model, "ref_model": ref_model,
        "accelerator": OneProcessAccelerator(next(step.model.parameters()).device, step.model),
        "args": types.SimpleNamespace(gradient_checkpointing_kwargs=None, discopop_tau=defaults.get("discopop_tau")),
        "beta": defaults["beta"], "precompute_ref_logps": setup.precompute_ref_log_probs,
        "aux_loss_enabled": False, "router_aux_loss_coef": 0.0,
        "_metrics": {"train": defaultdict(list), "eval": defaultdict(list)}, "_total_train_tokens": 0, "_tp_size": 1,
    }
    attrs.update(_LOSS_ATTRS[objective_spec(setup.objective).trainer](setup, defaults, loss_type))
    for name, value in attrs.items():
        object.__setattr__(trainer, name, value)
    return trainer


def _fused_head(model, objective: str) -> None:
    """The trainer's __init__: dropout off (disable_dropout, the config's default) and TRL's fused LM head on the
    causal LM (under peft its base model), computing the per-token fields the trainer's metrics read."""
    from trl.trainer.utils import add_fused_lm_head, disable_dropout_in_model

    disable_dropout_in_model(model)
    add_fused_lm_head(causal_lm(model), outputs=objective_spec(objective).head_outputs)


def autocast_per_call(module: torch.nn.Module, step) -> None:
    """Accelerator.prepare_model under mixed precision: the module's forward runs in its own autocast region (so
    autocast's cache of weight casts is cleared when each forward returns), not the whole step."""
    if step.autocast_dtype is None:
        return
    forward = module.forward

    @functools.wraps(forward)    # as accelerate's wrapper: generate reads the signature (logits_to_keep)
    def autocast_forward(*args, **kwargs):
        with torch.autocast(step.device_type, dtype=step.autocast_dtype):
            out = forward(*args, **kwargs)
        if step.autocast_policy is not None and not torch.is_autocast_enabled(step.device_type):
            step.autocast_policy.cache.clear()    # llmem's CUDA-policy kernels keep their own cache
        return out

    module.forward = autocast_forward


def reference_copy(step) -> torch.nn.Module:
    """The reference model DPOTrainer loads: the policy's class and config, in the policy's dtype (its trained
    parameters' dtype: fp32 under *-mixed) or the compute dtype (--ref-dtype compute), frozen, in eval mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from trl.trainer.utils import add_fused_lm_head, disable_dropout_in_model

    setup = step.setup
    dtype = getattr(torch, setup.compute_dtype) if setup.ref_dtype == "compute" else \
        getattr(torch, {4: "float32", 2: setup.compute_dtype}[setup.param_bytes])
    with unset_fake_temporarily(), quiet():     # built on the meta device, as the policy was
        ref = meta_model_for(setup)
        ref.to(dtype)
        ref.requires_grad_(False)
    materialize(ref, _local_device(step.model))
    if not is_fake_tensor(step.input_ids):      # measure: real random weights, as the policy's
        init_real_weights(ref)
    ref.eval()
    disable_dropout_in_model(ref)
    add_fused_lm_head(ref)
    if step.layout.spec.shards_model_states:
        prepare_fsdp(ref, step)
    return step.prepare_reference(ref)    # DeepSpeed: trl's prepare_deepspeed, an engine of its own



def traced_reference(step) -> torch.nn.Module | None:
    """The separate reference the trainer holds (REF_COPY; None otherwise), its weights counted as weights and
    each forward autocast as the policy's are."""
    if reference_mode(step.setup) != REF_COPY:
        return None
    with step.hooks.category("weights"):
        ref = reference_copy(step)
    autocast_per_call(ref, step)
    return ref

def _local_device(model: torch.nn.Module) -> torch.device:
    """The device of the policy's (local shards of its) parameters."""
    p = next(model.parameters())
    return p.to_local().device if hasattr(p, "to_local") else p.device


def prepare_fsdp(ref: torch.nn.Module, step) -> None:
    """trl.models.utils.prepare_fsdp under FSDP2: one fully_shard on the whole reference (one unit, no per-layer
    wrapping), accelerate's plugin's reshard_after_forward (FULL_SHARD: True; zero2, SHARD_GRAD_OP: False) and
    mixed-precision policy (the policy's: llmem.runtime.distributed.apply_fsdp), on the policy's mesh."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    setup = step.setup
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, setup.compute_dtype), reduce_dtype=torch.float32) \
        if setup.mixed else MixedPrecisionPolicy()
    fully_shard(ref, mesh=next(step.model.parameters()).device_mesh,
                reshard_after_forward=step.layout.spec.reshard_after_forward, mp_policy=mp)


def preference_inputs(step) -> dict[str, torch.Tensor]:
    """The collator's batch on the device. DataCollatorForPreference: input_ids, attention_mask, completion_mask
    [2B, S] int64 (chosen rows then rejected rows), precomputed: ref_chosen_logps, ref_rejected_logps [B] fp32.
    DataCollatorForUnpairedPreference: the same three [B, S] (and, with the KL term, KL_input_ids,
    KL_attention_mask, KL_completion_mask), label [B] bool (the first half desirable), precomputed: ref_logps (and
    ref_KL_logps) [B] fp32."""
    setup = step.setup
    device = step.input_ids.device
    spec = objective_spec(setup.objective)
    rows, seq = spec.sequences_per_sample * setup.batch_size, setup.seq_len
    vocab = vocab_size(causal_lm(step.model))

    def sequences(prefix: str) -> dict[str, torch.Tensor]:
        completion = torch.ones((rows, seq), dtype=torch.int64, device=device)
        completion[:, :setup.prompt_len] = 0
        return {f"{prefix}input_ids": torch.randint(0, vocab, (rows, seq), dtype=torch.int64, device=device),
                f"{prefix}attention_mask": torch.ones((rows, seq), dtype=torch.int64, device=device),
                f"{prefix}completion_mask": completion}

    def logps(names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        return {name: torch.zeros(setup.batch_size, dtype=torch.float32, device=device) for name in names}

    batch = sequences("")
    if spec.paired:
        if setup.precompute_ref_log_probs:
            batch.update(logps(("ref_chosen_logps", "ref_rejected_logps")))
        return batch
    kl = kl_sequences(setup)
    if kl:
        batch.update(sequences("KL_"))
    if setup.precompute_ref_log_probs:
        batch.update(logps(("ref_logps", "ref_KL_logps")[:1 + kl]))
    label = torch.zeros(setup.batch_size, dtype=torch.bool, device=device)
    label[:setup.batch_size // 2] = True
    batch["label"] = label
    return batch


@dataclass
class TrainerRun:
    """What a TRL step keeps across iterations: the trainer, its batch (None: GRPO makes it per step), the
    boolean-mask counts the trace answers."""
    trainer: object
    inputs: dict[str, torch.Tensor] | None
    masks: KnownMasks


def require_trl(objective: str) -> None:
    """The trace of a TRL objective runs TRL's own code: one line when it is not installed."""
    try:
        import trl  # noqa: F401
    except ImportError:
        raise LlmemError(f"the trace of --objective {objective} runs TRL's own trainer code: pip install "
                         "'trl>=1.16,<1.17' (or llmem estimate, which needs none)") from None


def preference_run(step) -> TrainerRun:
    """What the step keeps across iterations, made once before it starts: the fused heads, the reference, the
    batch (as activations), the trainer."""
    run = step.__dict__.get("_preference_run")
    if run is not None:
        return run
    require_trl(step.setup.objective)
    setup = step.setup
    region = step.hooks.category
    check_dropout_free(setup.objective, causal_lm(step.model).config.to_dict())
    _fused_head(step.model, setup.objective)
    autocast_per_call(step.model, step)
    ref = traced_reference(step)
    with region("activations"):
        inputs = preference_inputs(step)
    seq = setup.seq_len
    masks = KnownMasks({(2, seq - 1): completion_tokens(setup), (2, seq): seq - setup.prompt_len,
                        (1, setup.batch_size): setup.batch_size // 2})     # KTO's labels: half desirable
    run = TrainerRun(_trainer_for(step, ref), inputs, masks)
    step.__dict__["_preference_run"] = run
    return run


def trainer_step(step, it: int, loss_of: Callable[[], torch.Tensor], on_fake: tuple = (), always: tuple = ()) -> None:
    """One TRL training step as Trainer.training_step runs it: the trainer's loss (the model's forward inside)
    under the contexts `always` (and, on fake tensors, `on_fake`: what they cannot run, the module docstring),
    backward under them too, then the optimizer step and zero_grad."""
    step._phase("forward", it)
    with contextlib.ExitStack() as stack:
        for ctx in (*(on_fake if is_fake_tensor(step.input_ids) else ()), *always):
            stack.enter_context(ctx)
        loss = loss_of()
        step._phase("backward", it)
        step.backward(loss)     # DeepSpeed: its engine.backward (llmem.runtime.deepspeed)
        del loss
    step.optimizer_step(it)


def trl_fake_contexts(masks) -> tuple:
    """TRL's fused LM head on CUDA's path, full-length pairs and the boolean-mask counts: the trace's contexts."""
    return trl_cuda_head(), full_length_padding_mask(), masks


def checkpointing_paused_in(trainer_cls):
    """The trainer module's disable_gradient_checkpointing, as the policy's checkpointing is paused."""
    import sys

    return patched(sys.modules[trainer_cls.__module__], "disable_gradient_checkpointing", policy_checkpointing_paused)


def preference_iteration(step, it: int) -> None:
    """One preference training step: the trainer's `_compute_loss` (policy forward, reference forward, loss),
    backward, the optimizer step and zero_grad, as Trainer.training_step runs them."""
    run = preference_run(step)
    cls = type(run.trainer)
    trainer_step(step, it, lambda: cls._compute_loss(run.trainer, step.runner, run.inputs, False),
                 on_fake=trl_fake_contexts(run.masks), always=(checkpointing_paused_in(cls),))


def emulation_notes(setup) -> list[str]:
    """What the trace's result says about the preference step it ran: TRL's code, and what it emulates."""
    spec = objective_spec(setup.objective)
    return objective_notes(setup) + [
        f"trace: TRL's {spec.trainer}._compute_loss (its __init__ not run: the attributes from "
        f"{spec.trainer.replace('Trainer', 'Config')}'s defaults); its fused LM head on CUDA's path (only the completion tokens projected, the "
        "Triton kernels in place without allocations, fp32 accumulation without copies); boolean-mask counts from "
        "the set-up, host scalar reads 1; full-length pairs (no padding mask); metric gathers across ranks not traced"]
