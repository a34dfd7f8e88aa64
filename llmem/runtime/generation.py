"""Generation objectives on the runtime floor: TRL's GRPO / RLOO trainer and transformers' generate run.

The step of a TRL generation objective (--objective grpo, rloo) on the prepared model: TRL's own GRPOTrainer (or
RLOOTrainer) code and transformers' own `generate`, on fake tensors.

Each iteration runs the three phases of a generating GRPOTrainer `training_step` (num_iterations 1;
trl/trainer/grpo_trainer.py, the installed trl 1.16) over the generation batch, --batch-size x steps_per_generation
rows per GPU (TRL's `_prepare_inputs`: generated and scored at once, buffered, one slice trained per step); the two
iterations are the steps that generate (steps 0 and steps_per_generation: the steps between train on the buffer's
other slices, holding what a training phase holds):
- generation: `_generate_single_turn`'s transformers path: the left-padded prompts [B, P] and their attention mask
  on the device, the unwrapped policy (not DDP's wrapper; gradient checkpointing off, as
  `unwrap_model_for_generation` turns it off; under DeepSpeed TRL's own unwrap_model_for_generation on the engine,
  ZeRO-3's GatheredParameters over the whole policy: llmem.runtime.deepspeed) runs
  `generate(**inputs, generation_config=...)` under no_grad with
  GRPOTrainer's GenerationConfig (do_sample, temperature 1.0, top_p 1.0, top_k 0, max_new_tokens =
  max_completion_length, disable_compile): its DynamicCache, the last token's logits per step (`logits_to_keep=1`)
  copied to fp32, the sampling;
- scoring: `_generate_and_score_completions`' tensors (prompt and completion ids and masks re-padded on the
  device, their concatenation) and, when beta > 0, the reference's per-token log-probs through the trainer's own
  `_get_per_token_logps_and_entropies` under no_grad with checkpointing paused (a reference copy, or the policy
  with its adapters disabled: `use_adapter(model, None)`); the advantages [B] fp32; the batch replaces the previous
  one (`_buffered_inputs`). RLOOTrainer (rloo_trainer.py) first runs the policy itself so for old_per_token_logps
  and keeps their masked sums old_logps [B] instead of the reference's per-token log-probs, which, with its KL
  penalty's [B, C] tensors, die as the scoring returns;
- training: the trainer's own `_compute_loss` on the batch, backward, the optimizer step, zero_grad.

With --use-vllm (FSDP2 only) vLLM is not run: the generation phase holds TRL's weight sync to it (`sync_weights`:
VLLMGeneration's own `_iter_named_params`, in server mode through vLLM's packed broadcast, transcribed) and the
prompt and completion ids.

The trainer object is not constructed (its __init__ loads a tokenizer and builds an Accelerator): `_compute_loss`
runs on `GRPOTrainer.__new__` carrying the attributes it reads, from GRPOConfig's defaults and the set-up.

Emulated, because fake tensors cannot run it (`generation_notes`):
- generate's host reads of device scalars (the right-padding check, the stop check): the stop check returns
  "finished" once the sequences reach prompt + max_completion_length (every completion runs to the limit, no EOS
  earlier: the longest step), every other scalar read reads false / 0 (no right padding);
- TRL's move of the completions through the host (`.tolist()` then re-padding): the re-padded tensors are made on the
  device at their shapes (every completion full length);
- rewards: the reward functions run on text on the host; the advantages are a [B] fp32 tensor on the device;
- `_prepare_inputs`' shuffle_sequence_dict (a permuted copy of the batch, a moment's few bytes) is not run: the step
  trains on the first slice of the batch as scored;
- in the training phase, what llmem.runtime.objectives emulates for TRL's fused head (CUDA's path, known mask counts,
  full-length padding mask, metric gathers the identity).
"""

from __future__ import annotations

import contextlib
import types
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmem.errors import LlmemError
from llmem.memory.vllm import PACKED_BUFFER_BYTES, PACKED_NUM_BUFFERS, PEFT_PREFIX
from llmem.runtime.build import causal_lm, vocab_size
from llmem.runtime.cuda import is_fake_tensor
from llmem.runtime.objectives import (
    KnownMasks,
    OneProcessAccelerator,
    TrainerRun,
    autocast_per_call,
    checkpointing_paused_in,
    config_defaults,
    full_length_padding_mask,
    policy_checkpointing_paused,
    require_trl,
    traced_reference,
    trainer_class,
    trainer_step,
    trl_cuda_head,
    trl_fake_contexts,
)
from llmem.runtime.patches import collectives_waited_in_place, patched
from llmem.setup.generation import (
    beta,
    completion_length,
    generation_rows,
    gradient_accumulation,
    prompt_length,
    steps_per_generation,
    vllm_mode,
)
from llmem.setup.objectives import (
    REF_ADAPTERS_OFF,
    REF_COPY,
    loss_type_of,
    objective_notes,
    objective_spec,
    reference_mode,
    scores_old_policy,
)

_aten = torch.ops.aten
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2      # token ids of the fake tokenizer (sizes do not depend on them)


class GenerateScalars(TorchDispatchMode):
    """generate's host reads of device scalars on fake tensors: false / 0 (no right padding; the stop check is
    answered by `stop_at_length`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default and is_fake_tensor(args[0]):
            t = args[0]
            return False if t.dtype == torch.bool else 0.0 if t.is_floating_point() else 0
        return func(*args, **kwargs)


@contextlib.contextmanager
def stop_at_length(total_tokens: int) -> Iterator[None]:
    """transformers' StopCheck (generation/utils.py): the device's `unfinished_sequences.max() == 0` still computed,
    its answer "finished" once the sequences hold `total_tokens` (the max_length criterion's)."""
    from transformers.generation import utils as gen_utils

    def check(self, unfinished_sequences, tokens, length):
        unfinished_sequences.max() == 0   # noqa: B015 - the device op the real check runs
        return length >= total_tokens

    with patched(gen_utils.StopCheck, "__call__", check):
        yield


@contextlib.contextmanager
def peers_finish_together() -> Iterator[None]:
    """transformers' `_has_unfinished_sequences` under synced_gpus (generate sets it for an FSDP-managed model on
    several ranks): its flag tensor still made and all-reduced, its host read answered by this rank's own state
    (every rank's completions run to max_completion_length, so all peers finish at the same step)."""
    import torch.distributed as dist
    from transformers.generation.utils import GenerationMixin

    def unfinished(self, this_peer_finished: bool, synced_gpus: bool, device) -> bool:
        if synced_gpus:
            flag = torch.tensor(0.0 if this_peer_finished else 1.0, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        return not this_peer_finished

    with patched(GenerationMixin, "_has_unfinished_sequences", unfinished):
        yield


def generation_config(setup):
    """GRPOTrainer's GenerationConfig for transformers' generate (its __init__, no vLLM), from GRPOConfig's
    defaults."""
    from transformers import GenerationConfig

    d = config_defaults(setup.objective)
    return GenerationConfig(max_new_tokens=completion_length(setup), do_sample=True, pad_token_id=PAD_ID,
                            bos_token_id=BOS_ID, eos_token_id=[EOS_ID], temperature=d["temperature"],
                            top_p=d["top_p"], top_k=d["top_k"], min_p=d["min_p"],
                            repetition_penalty=d["repetition_penalty"],
                            cache_implementation=d["cache_implementation"], disable_compile=True,
                            use_cache=True)   # the hub config's use_cache (llmem's build turns it off to train)


def _trainer_for(step, ref_model):
    """A GRPOTrainer (or RLOOTrainer) carrying what `_compute_loss` and `_get_per_token_logps_and_entropies` read
    (RLOOConfig lacks GRPO's loss options: None)."""
    setup = step.setup
    d = config_defaults(setup.objective)
    cls = trainer_class(setup.objective)
    trainer = cls.__new__(cls)
    eps = d["epsilon"]
    attrs = {
        "model": step.model, "ref_model": ref_model,
        "accelerator": OneProcessAccelerator(next(step.model.parameters()).device, step.model, step.layout.world_size),
        "args": types.SimpleNamespace(use_bias_correction_kl=d.get("use_bias_correction_kl"), delta=d.get("delta"),
                                      steps_per_generation=steps_per_generation(setup),
                                      gradient_checkpointing_kwargs=None),
        "beta": beta(setup), "loss_type": loss_type_of(setup), "epsilon_low": eps,
        "epsilon_high": d["epsilon_high"] if d["epsilon_high"] is not None else eps,
        "importance_sampling_level": d.get("importance_sampling_level"),
        "top_entropy_quantile": d.get("top_entropy_quantile"),
        "off_policy_mask_threshold": d.get("off_policy_mask_threshold"), "use_vllm": False,
        "vllm_importance_sampling_correction": False, "aux_loss_enabled": False, "router_aux_loss_coef": 0.0,
        "_entropy_bonus_enabled": False, "use_adaptive_entropy": False, "entropy_coef": 0.0,
        "max_completion_length": completion_length(setup), "current_gradient_accumulation_steps": gradient_accumulation(setup),
        "_metrics": {"train": defaultdict(list), "eval": defaultdict(list)},
    }
    for name, value in attrs.items():
        object.__setattr__(trainer, name, value)
    return trainer


def generation_run(step) -> TrainerRun:
    """What the step keeps across iterations, made once before it starts: the fused heads, the reference, the
    trainer."""
    run = step.__dict__.get("_generation_run")
    if run is not None:
        return run
    if step.setup.use_vllm and not step.layout.shards_model_states:
        raise LlmemError("--use-vllm: the trace runs TRL's weight sync to vLLM under FSDP2 only (vLLM itself is not "
                         "run: not installed, no GPU); llmem estimate models its pool; drop --use-vllm to trace the "
                         "step with transformers' generate")
    require_trl(step.setup.objective)
    if step.setup.use_vllm and any(PEFT_PREFIX in n and q.dtype in (torch.bfloat16, torch.float16)
                                   for n, q in step.model.named_parameters()):
        raise LlmemError("trace: peft's get_delta_weight casts half-precision adapters to fp32 on a CPU device (its "
                         "merge before the weight sync to vLLM), which CUDA does not: use fp32 adapters "
                         "(--adapter-dtype fp32) to trace it, or llmem estimate")
    from trl.trainer.utils import add_fused_lm_head

    setup = step.setup
    d = config_defaults(setup.objective)
    if d["disable_dropout"]:
        raise LlmemError("the installed trl's GRPOConfig disables dropout by default, which llmem does not model")
    # GRPOTrainer's __init__: the fused head on the causal LM (under peft its base model): log-probs and entropy
    add_fused_lm_head(causal_lm(step.model), temperature=d["temperature"], cast_lm_head_to_fp32=False,
                      outputs=("log_probs", "entropy"))
    autocast_per_call(step.model, step)
    ref = traced_reference(step)
    seq, c = setup.seq_len, completion_length(setup)
    masks = KnownMasks({(2, seq - 1): c, (2, seq): seq, (2, c): c})
    run = TrainerRun(_trainer_for(step, ref), None, masks)
    step.__dict__["_generation_run"] = run
    return run


def _ids(rows: int, cols: int, vocab: int, device) -> torch.Tensor:
    return torch.randint(3, vocab, (rows, cols), dtype=torch.int64, device=device)


def generate_completions(step, run: TrainerRun) -> None:
    """The generation phase: the generation batch's prompts on the device (--batch-size x steps_per_generation
    rows), the unwrapped policy's generate under no_grad."""
    setup = step.setup
    device = step.input_ids.device
    b, p = generation_rows(setup), prompt_length(setup)
    vocab = vocab_size(causal_lm(step.model))
    fake = is_fake_tensor(step.input_ids)
    prompt_ids = _ids(b, p, vocab, device)
    prompt_mask = torch.ones((b, p), dtype=torch.int64, device=device)
    with contextlib.ExitStack() as stack:
        if fake:
            stack.enter_context(stop_at_length(setup.seq_len))
            stack.enter_context(peers_finish_together())
            stack.enter_context(GenerateScalars())
            stack.enter_context(full_length_padding_mask())    # the prompts all full length: no padding mask
        stack.enter_context(policy_checkpointing_paused(step.model))
        with step.hooks.category("gathered_weights"):   # DeepSpeed: TRL's unwrap_model_for_generation, ZeRO-3's
            model = stack.enter_context(step.unwrap_for_generation())                # gather (llmem.runtime.deepspeed)
        stack.enter_context(torch.no_grad())
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                             generation_config=generation_config(setup))
    if tuple(out.shape) != (b, setup.seq_len) and fake:
        raise LlmemError(f"trace: generate returned {tuple(out.shape)}, expected ({b}, {setup.seq_len})")
    del out, prompt_ids, prompt_mask


def vllm_completions(step) -> None:
    """vLLM generates (not run): the trainer holds the prompts (ids, mask) and the returned completion ids only."""
    setup = step.setup
    device = step.input_ids.device
    b, p, c = generation_rows(setup), prompt_length(setup), completion_length(setup)
    vocab = vocab_size(causal_lm(step.model))
    prompt_ids, prompt_mask = _ids(b, p, vocab, device), torch.ones((b, p), dtype=torch.int64, device=device)
    completion_ids = _ids(b, c, vocab, device)
    del prompt_ids, prompt_mask, completion_ids


def sync_weights(step, it: int) -> None:
    """TRL's VLLMGeneration.sync_weights under FSDP2 (trl/generation/vllm_generation.py) on the main process: its own
    `_iter_named_params` (each parameter's full_tensor()); colocated, the loop that hands each to vLLM's load_weights
    (not run); in server mode the metadata walk at the first sync, then VLLMClient.update_named_params' packed
    broadcast (`packed_broadcast_producer`)."""
    from trl.generation.vllm_generation import VLLMGeneration

    sync = VLLMGeneration.__new__(VLLMGeneration)
    device = next(step.model.parameters()).device
    for name, value in {"model": step.model, "accelerator": types.SimpleNamespace(device=device),
                        "_dist": types.SimpleNamespace(is_fsdp=True, fsdp_version=2, is_zero3=False,
                                                       gather_params=lambda params: contextlib.nullcontext())
                        }.items():
        object.__setattr__(sync, name, value)
    server = vllm_mode(step.setup) == "server"
    fake = is_fake_tensor(step.input_ids)    # full_tensor's all-gather waited in place, as CUDA's (no fake copy)
    with collectives_waited_in_place() if fake else contextlib.nullcontext(), step.hooks.category("gathered_weights"):
        if not server:                # sync_weights' load_weights loop (its variable holds the previous one)
            for _name, _param in sync._iter_named_params():
                pass
            return
        if it == 0:                   # the first sync's _weight_metadata: a list comprehension over the walk
            [(name, str(param.dtype), list(param.shape)) for name, param in sync._iter_named_params()]
        packed_broadcast_producer(step, sync._iter_named_params(), lambda item: item[1])


def packed_broadcast_producer(step, iterator, post_iter_func, buffer_size_bytes: int = PACKED_BUFFER_BYTES,
                              num_buffers: int = PACKED_NUM_BUFFERS) -> None:
    """vLLM 0.33's packed_nccl_broadcast_producer and pack_tensors (vllm/distributed/weight_transfer/
    packed_tensor.py; vLLM is not installed: its tensor code, transcribed), the broadcast not run: on stream
    `buffer_idx` the chunk two back is dropped, tensors are consumed until their bytes exceed the buffer size and
    torch.cat'ed into one uint8 buffer, kept in flight until the slot comes round again. The streams are made once
    per step (vLLM caches them per device)."""
    dev = getattr(torch, step.device_type)
    streams = step.__dict__.setdefault("_vllm_streams", tuple(dev.Stream() for _ in range(num_buffers)))
    in_flight: list = [None] * num_buffers
    buffer_idx = 0
    while True:
        if hasattr(streams[buffer_idx], "synchronize"):
            streams[buffer_idx].synchronize()
        in_flight[buffer_idx] = None
        with dev.stream(streams[buffer_idx]):
            chunk = _pack_tensors(step, iterator, post_iter_func, buffer_size_bytes)
            if chunk is None:
                break
            in_flight[buffer_idx] = chunk          # group.broadcast(chunk, src=0): not run
            buffer_idx = (buffer_idx + 1) % num_buffers
    del in_flight


def _pack_tensors(step, iterator, post_iter_func, buffer_size_bytes: int):
    """pack_tensors: the packed uint8 buffer (None once the iterator is exhausted)."""
    tensor_list = []
    total_bytes = 0
    while True:
        try:
            item = next(iterator)
        except StopIteration:
            break
        tensor = post_iter_func(item).contiguous().view(-1).view(torch.uint8)
        tensor_list.append(tensor)
        total_bytes += tensor.numel()
        if total_bytes > buffer_size_bytes:
            break
    if not tensor_list:
        return None
    with step.hooks.category("communication_buffers"):
        packed = torch.cat(tensor_list, dim=0)
    del tensor_list
    return packed


def score_completions(step, run: TrainerRun) -> None:
    """The scoring phase over the generation batch (--batch-size x steps_per_generation rows): the batch re-padded on
    the device, the old policy's per-token log-probs (RLOO every generation, GRPO when its steps are misaligned:
    the policy under no_grad; RLOO then their per-sequence sums), the reference's (beta > 0), the advantages; the
    new batch replaces the buffered one, the step trains on its first --batch-size slice (trl's split_tensor_dict:
    views, so the whole batch stays). GRPO keeps the per-token log-probs; RLOO (sequence_logps) its old_logps only."""
    setup = step.setup
    spec = objective_spec(setup.objective)
    device = step.input_ids.device
    b, p, c = generation_rows(setup), prompt_length(setup), completion_length(setup)
    vocab = vocab_size(causal_lm(step.model))
    batch = {"prompt_ids": _ids(b, p, vocab, device),
             "prompt_mask": torch.ones((b, p), dtype=torch.int64, device=device),
             "completion_ids": _ids(b, c, vocab, device),
             "completion_mask": torch.ones((b, c), dtype=torch.int64, device=device)}
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    mode = reference_mode(setup)
    old = ref = None
    if scores_old_policy(setup):          # old_per_token_logps (RLOO: then old_logps, the masked sums)
        old = _no_grad_logps(step, run, step.model, ids, mask)
    if spec.sequence_logps:
        batch["old_logps"] = (old * batch["completion_mask"]).sum(1)
    if mode in (REF_COPY, REF_ADAPTERS_OFF):
        model = run.trainer.ref_model if mode == REF_COPY else step.model
        ref = _no_grad_logps(step, run, model, ids, mask, adapters_off=mode == REF_ADAPTERS_OFF)
    del ids, mask
    if spec.sequence_logps and ref is not None:      # RLOO's KL penalty on the rewards: first-order log ratio
        per_token_kl = old - ref
        kl = (per_token_kl * batch["completion_mask"]).sum(-1)  # noqa: F841 - its device tensor lives to the end
    if not spec.sequence_logps:
        if old is not None:
            batch["old_per_token_logps"] = old
        if ref is not None:
            batch["ref_per_token_logps"] = ref
    batch["advantages"] = torch.zeros(b, dtype=torch.float32, device=device)
    if not spec.sequence_logps:
        batch["num_items_in_batch"] = torch.tensor(float(b * c), device=device)
    run.inputs = _first_slice(batch, steps_per_generation(setup))   # _buffered_inputs: the previous batch dies


def _first_slice(batch: dict, steps: int) -> dict:
    """trl's split_tensor_dict(batch, steps_per_generation)[0]: the first step's rows, views of the buffered batch
    (one step: the batch itself)."""
    if steps == 1:
        return batch
    from trl.trainer.utils import split_tensor_dict

    return split_tensor_dict(batch, steps)[0]


def _no_grad_logps(step, run: TrainerRun, model, ids, mask, adapters_off: bool = False) -> torch.Tensor:
    """The trainer's own `_get_per_token_logps_and_entropies` under no_grad with checkpointing paused, in one chunk
    of per_device_train_batch_size (the policy, a reference copy, or the policy with its adapters disabled:
    `use_adapter(model, None)`)."""
    setup = step.setup
    trainer = run.trainer
    with contextlib.ExitStack() as stack:
        if is_fake_tensor(step.input_ids):
            stack.enter_context(trl_cuda_head())
            stack.enter_context(full_length_padding_mask())
            stack.enter_context(run.masks)
        stack.enter_context(torch.no_grad())
        stack.enter_context(policy_checkpointing_paused(step.model))
        if adapters_off:
            from trl.trainer.utils import use_adapter

            stack.enter_context(use_adapter(step.model, None))
        logps, _, _ = type(trainer)._get_per_token_logps_and_entropies(
            trainer, model, ids, mask, completion_length(setup), batch_size=setup.batch_size)
    return logps


def generation_iteration(step, it: int) -> None:
    """One GRPO training step: generation, scoring, then `_compute_loss`, backward, the optimizer step and zero_grad,
    as GRPOTrainer.training_step runs them. With vLLM (FSDP2) the generation phase holds the weight sync to it."""
    run = generation_run(step)
    cls = type(run.trainer)
    step._phase("generation", it)
    if step.setup.use_vllm:
        sync_weights(step, it)
        vllm_completions(step)
    else:
        generate_completions(step, run)
    step._phase("scoring", it)
    score_completions(step, run)
    trainer_step(step, it, lambda: cls._compute_loss(run.trainer, step.runner, run.inputs),
                 on_fake=trl_fake_contexts(run.masks), always=(checkpointing_paused_in(cls),))


def generation_emulation_notes(setup) -> list[str]:
    """What the trace's result says about the generation step it ran."""
    trainer = objective_spec(setup.objective).trainer
    return objective_notes(setup) + [
        "trace: transformers' generate on fake tensors (the stop check answers at prompt + max_completion_length, "
        "under FSDP2 synced_gpus' all-reduced flag by this rank's own state, other host scalar reads false); "
        f"TRL's {trainer}._compute_loss and _get_per_token_logps_and_entropies (its "
        f"__init__ not run: the attributes from {trainer.replace('Trainer', 'Config')}'s defaults); the completions' "
        "trip through the host and "
        "the reward functions not traced (the re-padded batch and the advantages made on the device); its fused LM "
        "head on CUDA's path"] + (vllm_emulation_notes(setup) if setup.use_vllm else [])


def vllm_emulation_notes(setup) -> list[str]:
    """What the trace runs of a vLLM step (FSDP2 only) and what it leaves out."""
    server = vllm_mode(setup) == "server"
    return [f"trace: vLLM not run (vllm_mode {vllm_mode(setup)}); its generation phase holds TRL's weight sync: "
            "VLLMGeneration._iter_named_params itself (each FSDP2 full_tensor(), its all-gather waited in place"
            + (", peft's merge_adapter / unmerge_adapter on the DTensors" if setup.lora_rank else "") + "), "
            + ("streamed through vLLM 0.33's packed_nccl_broadcast_producer (transcribed: vLLM is not installed; "
               "the broadcast itself not run) on two side streams" if server else
               "each handed to load_weights (not run)")
            + "; the completions made on the device at their shapes"]


def traced_phases(series: dict) -> list:
    """Each phase's peak of the replayed ledger (llmem.runtime.replay's series): allocated (the allocator's, whole
    blocks) and reserved at their highest in the phase, the tensor bytes per component at the phase's peak."""
    from llmem.result import grouped_phases
    from llmem.runtime.ledger import PHASE_NAMES

    peaks: dict[int, list[int]] = {}
    for allocated, reserved, code in zip(series["allocated"], series["reserved"], series["phase"], strict=True):
        row = peaks.setdefault(code, [0, 0])
        row[0], row[1] = max(row[0], allocated), max(row[1], reserved)
    comps = series["phase_peaks"]
    return grouped_phases([(PHASE_NAMES[c], a, r, comps.get(PHASE_NAMES[c], {}).get("components", {}))
                           for c, (a, r) in sorted(peaks.items())])
