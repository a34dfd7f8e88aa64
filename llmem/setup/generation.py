"""Generation objectives on the set-up floor: GRPO's and RLOO's options and their check.

The generation objectives' options and their check (--objective grpo): TRL's GRPOTrainer as the installed trl 1.16
runs it with transformers' `generate` (trl/trainer/grpo_trainer.py, grpo_config.py).

One step, as GRPOTrainer runs it (num_iterations 1): every steps_per_generation training steps (GRPOConfig's
default: gradient_accumulation_steps, 1 unless given) `_prepare_inputs` has `_generate_and_score_completions`
generate the generation batch's completions at once (per GPU --batch-size x steps_per_generation completions, TRL's
per_device_train_batch_size x steps_per_generation; the RepeatSampler repeats each prompt num_generations times),
score them in chunks of --batch-size (the reference's per-token log-probs when beta > 0; the old policy's when the
generation and the optimizer steps are misaligned: gradient_accumulation_steps not a multiple of
steps_per_generation), buffer the batch (`_buffered_inputs`) and serve one --batch-size slice of it per training
step, in which `_compute_loss` runs the policy on prompt + completion and backward. --seq-len is the whole sequence (the
left-padded prompt + --max-completion-length): trl 1.16 has no max_prompt_length (the trainer does not truncate
prompts). Every completion runs to max_completion_length (no EOS before it): the longest step.

With --use-vllm (GRPOConfig's use_vllm) vLLM generates instead of transformers: in `vllm_mode="colocate"` (TRL
1.16's default) an engine in each training process with its own pool of vllm_gpu_memory_utilization x device
memory (llmem.memory.vllm: its weights, KV cache blocks, activations; resident through training unless
vllm_enable_sleep_mode releases it), in "server" mode on other GPUs (nothing of it here). Neither is run: the
training process's generation phase then holds nothing of generate's, and the pool is added from vLLM's accounting.

--objective rloo is TRL's RLOOTrainer (rloo_trainer.py, rloo_config.py) in the same three phases, with RLOOConfig's
defaults (2 generations, beta 0.05: a reference unless peft); its scoring phase also runs the policy under no_grad
for the old-policy log-probs, every step, and the batch keeps their per-sequence sums (the registry row's
scores_policy and sequence_logps, llmem.setup.objectives).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from llmem.errors import LlmemError
from llmem.setup.deepspeed import check_trl_deepspeed
from llmem.setup.methods import method_spec


@dataclass(frozen=True)
class GenerationDefaults:
    """A generation trainer's config defaults that decide memory (GRPOConfig's, trl 1.16)."""
    num_generations: int
    max_completion_length: int
    beta: float
    num_iterations: int
    loss_type: str | None
    gradient_checkpointing: bool     # _BaseConfig's default (llmem's --grad-ckpt stays the user's choice)
    vllm_mode: str = "colocate"
    vllm_gpu_memory_utilization: float = 0.3
    config_class: str = "GRPOConfig"
    loss_types: tuple[str, ...] = ()     # its loss_type's choices, the first its default (RLOOConfig has none)


GRPO_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo")   # GRPOConfig.loss_type (vespo not)
GENERATION_DEFAULTS = {
    "grpo": GenerationDefaults(num_generations=8, max_completion_length=512, beta=0.0, num_iterations=1,
                               loss_type="dapo", gradient_checkpointing=True, loss_types=GRPO_LOSS_TYPES),
    # RLOOConfig (trl 1.16, rloo_config.py): 2 generations, 512 completion tokens, beta 0.05 (a reference unless
    # peft), no loss_type (RLOOTrainer's loss is one per-sequence clipped ratio)
    "rloo": GenerationDefaults(num_generations=2, max_completion_length=512, beta=0.05, num_iterations=1,
                               loss_type=None, gradient_checkpointing=True, config_class="RLOOConfig"),
}
# The layouts TRL's steps are modelled under: one GPU, DDP, and FSDP2 as accelerate's plugin runs it (fsdp:
# FULL_SHARD, zero2: SHARD_GRAD_OP, reshard_after_forward False), the reference copy one fully_shard unit of its own
# (trl/models/utils.py prepare_fsdp)
TRL_METHODS = ("single", "ddp", "fsdp", "zero2")
GENERATION_METHODS = TRL_METHODS
GENERATION_ATTENTIONS = ("sdpa", "eager", "flash")

# TrainingSetup fields of the generation objectives: (field, unset value, flag)
GENERATION_FIELDS = (("num_generations", None, "--num-generations"),
                     ("max_completion_length", None, "--max-completion-length"),
                     ("beta", None, "--beta"), ("use_vllm", False, "--use-vllm"))
VLLM_MODES = ("colocate", "server")
# the vLLM options, which need --use-vllm: (field, unset value, flag)
VLLM_FIELDS = (("vllm_mode", None, "--vllm-mode"), ("vllm_gpu_memory_utilization", None,
                                                    "--vllm-gpu-memory-utilization"),
               ("vllm_enable_sleep_mode", False, "--vllm-enable-sleep-mode"),
               ("vllm_max_model_length", None, "--vllm-max-model-length"))

# The options the generation step does not model yet: (field, its unset value, flag, why)
_NOT_WITH_GENERATION = (
    ("fused_ce", False, "--fused-ce", "GRPOTrainer and RLOOTrainer compute the log-probs with TRL's chunked LM head"),
    ("packing", False, "--packing", "GRPOTrainer and RLOOTrainer pad prompts and completions"),
    ("offload_activations", False, "--offload-activations", "TRL's activation_offloading is not modelled yet"),
    ("optimizer_in_backward", False, "--optimizer-in-backward", "TRL's trainers step the optimizer after backward"),
    ("precompute_ref_log_probs", False, "--precompute-ref-log-probs", "GRPOTrainer and RLOOTrainer score the reference per step"),
    ("ref_dtype", "policy", "--ref-dtype", "GRPOTrainer and RLOOTrainer load the reference in the policy's "
                                           "dtype"),
    ("prompt_len", 0, "--prompt-len", "the prompt is --seq-len less --max-completion-length"),
    ("max_length", None, "--max-length", "their sequences are --seq-len: prompt + --max-completion-length"),
)
# The generation batch's fields (TRL's names): (field, flag)
GENERATION_BATCH_FIELDS = (("gradient_accumulation_steps", "--gradient-accumulation-steps"),
                           ("steps_per_generation", "--steps-per-generation"),
                           ("generation_batch_size", "--generation-batch-size"))


def generation_defaults(objective: str) -> GenerationDefaults | None:
    return GENERATION_DEFAULTS.get(objective)


def num_generations(setup) -> int:
    d = GENERATION_DEFAULTS[setup.objective]
    return d.num_generations if setup.num_generations is None else setup.num_generations


def completion_length(setup) -> int:
    """Completion tokens per sequence: max_completion_length (every completion runs to it)."""
    d = GENERATION_DEFAULTS[setup.objective]
    return d.max_completion_length if setup.max_completion_length is None else setup.max_completion_length


def prompt_length(setup) -> int:
    """The left-padded prompt's tokens: --seq-len less the completion."""
    return setup.seq_len - completion_length(setup)


def gradient_accumulation(setup) -> int:
    """TrainingArguments' gradient_accumulation_steps (its default 1)."""
    return 1 if setup.gradient_accumulation_steps is None else setup.gradient_accumulation_steps


def steps_per_generation(setup) -> int:
    """The training steps one generation batch serves, as GRPOConfig's / RLOOConfig's __post_init__ derives it:
    steps_per_generation as given, or generation_batch_size / (per_device_train_batch_size x processes), or
    gradient_accumulation_steps."""
    if setup.steps_per_generation is not None:
        return setup.steps_per_generation
    if setup.generation_batch_size is not None:
        return setup.generation_batch_size // (setup.batch_size * setup.gpus)
    return gradient_accumulation(setup)


def generation_rows(setup) -> int:
    """The completions one GPU generates and scores at once: per_device_train_batch_size x steps_per_generation
    (the sampler's local generation batch)."""
    return setup.batch_size * steps_per_generation(setup)


def generation_batch_size(setup) -> int:
    """GRPOConfig's generation_batch_size: the completions of one generation on all processes."""
    return generation_rows(setup) * setup.gpus


def with_fixed_steps(setup):
    """The set-up with a given generation_batch_size as the steps_per_generation it makes at the set-up's own
    micro-batch and GPUs (a plan varies both: the steps stay, the generation batch follows), and what was done
    (None when there was no generation_batch_size)."""
    if setup.generation_batch_size is None:
        return setup, None
    k = steps_per_generation(setup)
    note = (f"generation_batch_size {setup.generation_batch_size} planned as steps_per_generation {k} (its value at "
            f"--batch-size {setup.batch_size} on {setup.gpus} GPU(s)): the plan varies the micro-batch and the "
            "layout, so the generation batch follows them")
    return replace(setup, generation_batch_size=None, steps_per_generation=k), note


def steps_misaligned(setup) -> bool:
    """GRPOTrainer scores the old policy when generation does not fall on an optimizer step's start:
    gradient_accumulation_steps % (steps_per_generation x num_iterations) != 0 (num_iterations 1)."""
    return gradient_accumulation(setup) % steps_per_generation(setup) != 0


def beta(setup) -> float:
    d = GENERATION_DEFAULTS[setup.objective]
    return d.beta if setup.beta is None else setup.beta


def plain_setup(setup):
    """The set-up as one model's step (sft): the same model, precision and adapters, no objective options."""
    return replace(setup, objective="sft", loss_type=None, num_generations=None, max_completion_length=None,
                   beta=None, use_vllm=False, vllm_mode=None, vllm_gpu_memory_utilization=None,
                   vllm_enable_sleep_mode=False, vllm_max_model_length=None, gradient_accumulation_steps=None,
                   steps_per_generation=None, generation_batch_size=None)


def check_generation(setup) -> None:
    """A generation objective's options (one line naming the fix; the CLI exits 2)."""
    name = setup.objective
    _check_vllm(setup)
    refuse_unmodelled(setup, _NOT_WITH_GENERATION)
    d = GENERATION_DEFAULTS[name]
    if setup.loss_type is not None and not d.loss_types:
        raise LlmemError(f"--loss-type with --objective {name}: TRL's {d.config_class} has no loss_type; drop it")
    if setup.loss_type is not None and setup.loss_type not in d.loss_types:
        raise LlmemError(f"unknown --loss-type {setup.loss_type!r} for --objective {name}: choose one of "
                         f"{', '.join(d.loss_types)}")
    g = num_generations(setup)
    if g < 2:
        raise LlmemError(f"--num-generations must be >= 2 (the advantages compare a prompt's completions), got {g}")
    check_generation_batch(setup, d.config_class, g)
    c = completion_length(setup)
    if c < 1:
        raise LlmemError(f"--max-completion-length must be >= 1, got {c}")
    if prompt_length(setup) < 1:
        raise LlmemError(f"--seq-len {setup.seq_len} is the prompt plus --max-completion-length {c}: give a "
                         f"--seq-len above {c} (e.g. {c + 512})")
    b = beta(setup)
    if b < 0:
        raise LlmemError(f"--beta must be >= 0 (0 drops the reference model), got {b}")
    check_trainer_layout(setup, GENERATION_METHODS, GENERATION_ATTENTIONS)


def check_generating_quantised(setup) -> None:
    """A bitsandbytes base under GRPO / RLOO (TRL casts the adapters to bf16; generate runs the 4-bit model as
    training does): what is not modelled of it, one line each."""
    quant = setup.quant_spec
    if not quant.quantised:
        return
    if setup.use_vllm:
        raise LlmemError(f"{quant.flag} with --use-vllm under --objective {setup.objective} is not modelled (vLLM's "
                         "engine holds the base in its own dtype, and the weight sync merges the adapters into the "
                         "quantised linears): drop --use-vllm to generate with transformers")
    if quant.loaded_in_4bit and generation_rows(setup) == 1:
        # bitsandbytes' matmul_4bit: a single row under no_grad (A.numel() == A.shape[-1]) takes gemv_4bit
        raise LlmemError(f"{quant.flag} with one completion per GPU under --objective {setup.objective}: "
                         "bitsandbytes' gemv_4bit decode kernel (one row, no dequantised weight) is not modelled; "
                         "give --batch-size x --steps-per-generation >= 2")


def check_generation_batch(setup, config_class: str, g: int) -> None:
    """TRL 1.16's GRPOConfig / RLOOConfig __post_init__ on the generation batch, its ValueErrors as one-line fixes."""
    for field_name, flag in GENERATION_BATCH_FIELDS:
        value = getattr(setup, field_name)
        if value is not None and value < 1:
            raise LlmemError(f"{flag} must be >= 1, got {value}")
    world, b = setup.gpus, setup.batch_size
    if setup.steps_per_generation is not None and setup.generation_batch_size is not None:
        raise LlmemError(f"--generation-batch-size and --steps-per-generation both given ({config_class}: they "
                         "can not be both configured at the same time): drop one")
    if setup.generation_batch_size is not None and setup.generation_batch_size % (b * world):
        k = -(-setup.generation_batch_size // (b * world))
        raise LlmemError(f"--generation-batch-size {setup.generation_batch_size} must be divisible by the global "
                         f"batch (--gpus {world} x --batch-size {b} = {b * world}), as {config_class} requires: "
                         f"give e.g. --generation-batch-size {k * b * world}")
    total = generation_batch_size(setup)
    if total % g:
        unit = math.lcm(g, b * world)
        fix = (f"--generation-batch-size {-(-total // unit) * unit}" if setup.generation_batch_size is not None
               else f"--steps-per-generation {unit // (b * world)}")
        raise LlmemError(f"--num-generations {g} must divide the generation batch (--gpus {world} x --batch-size "
                         f"{b} x steps_per_generation {steps_per_generation(setup)} = {total} completions), as "
                         f"{config_class} requires (whole prompt groups): give {fix}, or a --batch-size or --gpus "
                         f"that makes it a multiple of {g}, or another --num-generations")


def refuse_unmodelled(setup, table: tuple) -> None:
    """A TRL objective's options its step does not model, rows of (field, unset value, flag, why): one line."""
    for field_name, unset, flag, why in table:
        if getattr(setup, field_name) != unset:
            raise LlmemError(f"{flag} with --objective {setup.objective}: {why}")


# What a TRL step under FSDP2 does not model yet: (field, its unset value, flag, why)
_NOT_UNDER_FSDP = (
    ("cp", 1, "--cp", "context parallelism"),
    ("pp", 1, "--pp", "pipeline parallelism"),
    ("offload_param", False, "--offload-param", "FSDP2's CPUOffloadPolicy"),
)
# (what it applies to, flag, why). Modelled: vLLM colocated and in server mode, their weight sync (each FSDP2
# parameter's full_tensor, trl/generation/vllm_generation.py _iter_fsdp2_params; in server mode vLLM's packed
# broadcast, trl/generation/vllm_client.py update_named_params; colocated, peft's merge_adapter / unmerge_adapter
# around it) llmem.estimator.generation's weight_sync phase
_NOT_GENERATING_UNDER_FSDP = (
    (lambda s: s.lora_rank and vllm_mode(s) == "server", "--lora-rank and --vllm-mode server",
     "peft's merge_adapter inside vLLM's packed broadcast (its matmuls on the broadcast's side stream, with a "
     "cuBLAS workspace of their own) is not modelled yet"),
    # accelerate 1.15's fsdp2_prepare_model carves the embedding and [lm_head] into units of their own, but its
    # _find_final_norm looks among the PeftModel's base model's children (the *ForCausalLM's), so the final norm
    # stays in the root unit; peft's generate calls the base model's forward, past the root's pre-forward hook:
    # its sharded weight meets a plain tensor (tests/objectives/test_grpo_fsdp_peft.py runs accelerate's own prepare)
    (lambda s: s.lora_rank and not s.use_vllm, "--lora-rank",
     "the real step fails: accelerate's FSDP2 prepare leaves a peft model's final norm in the root unit, which "
     "peft's generate bypasses (aten.mul got mixed torch.Tensor and DTensor); --use-vllm colocated is modelled"),
)


def check_trainer_layout(setup, methods: tuple[str, ...], attentions: tuple[str, ...]) -> None:
    """The methods and attention kernels a TRL objective's step is modelled under."""
    spec = method_spec(setup.method)
    if spec.zero_stage is not None:
        check_trl_deepspeed(setup, setup.objective in GENERATION_DEFAULTS)
        methods = (setup.method,)
    if setup.method not in methods:
        raise LlmemError(f"--objective {setup.objective} is modelled under --method {' or '.join(methods)} "
                         f"(got {setup.method})")
    if setup.attn not in attentions:
        raise LlmemError(f"--objective {setup.objective} with --attn {setup.attn} is not modelled: use --attn "
                         f"{' or '.join(attentions)}")
    if spec.shards_model_states:
        _check_fsdp(setup)


def _check_fsdp(setup) -> None:
    """What a TRL step under FSDP2 does not model yet (_NOT_UNDER_FSDP, and generation's own)."""
    for field_name, unset, flag, what in _NOT_UNDER_FSDP:
        if getattr(setup, field_name) != unset:
            raise LlmemError(f"{flag} with --objective {setup.objective}: {what} under TRL's trainers is not "
                             f"modelled yet (drop {flag})")
    if setup.objective in GENERATION_DEFAULTS:
        for applies, flag, why in _NOT_GENERATING_UNDER_FSDP:
            if applies(setup):
                raise LlmemError(f"--objective {setup.objective} with {flag} under --method {setup.method}: {why}; "
                                 "use --method ddp or single")


def vllm_mode(setup) -> str | None:
    """How vLLM generates (None: transformers' generate)."""
    if not setup.use_vllm:
        return None
    return setup.vllm_mode or GENERATION_DEFAULTS[setup.objective].vllm_mode


def vllm_utilization(setup) -> float:
    u = setup.vllm_gpu_memory_utilization
    return GENERATION_DEFAULTS[setup.objective].vllm_gpu_memory_utilization if u is None else u


def _check_vllm(setup) -> None:
    if not setup.use_vllm:
        for field_name, unset, flag in VLLM_FIELDS:
            if getattr(setup, field_name) != unset:
                raise LlmemError(f"{flag} belongs to vLLM generation: add --use-vllm (or drop {flag})")
        return
    mode = vllm_mode(setup)
    if mode not in VLLM_MODES:
        raise LlmemError(f"unknown --vllm-mode {mode!r}: choose {' or '.join(VLLM_MODES)}")
    u = vllm_utilization(setup)
    if not 0.0 < u < 1.0:
        raise LlmemError(f"--vllm-gpu-memory-utilization must lie in (0, 1), got {u}: vLLM shares the device with "
                         "training")
    if mode == "server":
        for field_name, unset, flag in VLLM_FIELDS[1:]:
            if getattr(setup, field_name) != unset:
                raise LlmemError(f"{flag} sets the colocated engine: under --vllm-mode server it is the server's "
                                 "own option (drop it)")
    if setup.vllm_max_model_length is not None and setup.vllm_max_model_length < setup.seq_len:
        raise LlmemError(f"--vllm-max-model-length {setup.vllm_max_model_length} is shorter than a sequence "
                         f"(--seq-len {setup.seq_len}, prompt + completion): give at least {setup.seq_len}")


def check_no_generation_options(setup) -> None:
    """Objectives without a generation phase take none of its options."""
    batch = tuple((field_name, None, flag) for field_name, flag in GENERATION_BATCH_FIELDS)
    for field_name, unset, flag in GENERATION_FIELDS + VLLM_FIELDS + batch:
        if getattr(setup, field_name) != unset:
            raise LlmemError(f"{flag} belongs to --objective {' or '.join(GENERATION_DEFAULTS)} (or drop {flag})")


def generation_notes(setup, reference: str, scores_policy: bool = False) -> list[str]:
    """What the estimate and the trace say about a generation objective's step (`scores_policy`: the scoring phase
    also runs the policy for the old-policy log-probs, RLOOTrainer's every step)."""
    d = GENERATION_DEFAULTS[setup.objective]
    trainer = d.config_class.replace("Config", "Trainer")
    g, c, p = num_generations(setup), completion_length(setup), prompt_length(setup)
    ref = {"none": f"none (beta 0: {trainer} keeps no reference)",
           "copy": "a frozen copy in the policy's dtype (create_model_from_path(dtype=model.dtype)), scored under "
                   "no_grad in the scoring phase",
           "adapters-off": "the policy with its adapters disabled (peft; no copy), scored under no_grad"}[reference]
    misaligned = steps_misaligned(setup) and not scores_policy     # GRPO scoring the old policy
    old = "old-policy log-probs scored: the steps misaligned" if misaligned else "no old-policy log-probs"
    loss = (f"loss_type {setup.loss_type or d.loss_type}, num_iterations 1 ({old})"
            if not scores_policy else "num_iterations 1; the loss on per-sequence log-prob sums (the clipped ratio "
            "to the old policy's, leave-one-out advantages; the KL to the reference is a reward penalty)")
    scoring = ("the policy's own per-token log-probs under no_grad every step, for old_logps, then the reference's"
               if scores_policy else "the policy's own per-token log-probs under no_grad, for old_per_token_logps, "
               "then the reference's" if misaligned else "the reference's per-token log-probs")
    mode = vllm_mode(setup)
    how = "transformers' generate" if mode is None else f"vLLM (vllm_mode {mode})"
    generation = ("generation (the unwrapped policy's generate under no_grad, its DynamicCache growing to prompt + "
                  "completion, the last token's logits per step in fp32)" if mode is None else
                  "generation (vLLM generates: the trainer holds the prompt and completion ids only)")
    if mode is None and method_spec(setup.method).zero_stage == 3:   # trl/models/utils.py unwrap_model_for_generation
        generation += ("; under ZeRO-3 TRL's unwrap_model_for_generation gathers the whole policy in the engine's "
                       "dtype for it (GatheredParameters over all its parameters, ds3_gather_for_generation True: "
                       f"{d.config_class}'s default; llmem has no flag for False), the coordinator's hooks removed and "
                       "re-added after (add_hooks invalidates its trace each step: GRPO's training step fetches as "
                       "a first step does, no prefetch)")
    if mode == "server" and method_spec(setup.method).shards_model_states:   # llmem.estimator.generation
        generation = ("weight_sync (rank 0 streams each FSDP2 full_tensor() to the server through vLLM's "
                      "packed_nccl_broadcast_producer: chunks of just over 1 GiB torch.cat'ed into one buffer on a "
                      "side stream, two in flight; the first sync also walks them once for their metadata), "
                      + generation)
    k = steps_per_generation(setup)
    per = f" per step, {generation_rows(setup)} per generation" if k > 1 else ""
    return [f"--objective {setup.objective}: TRL's {trainer} with {how}; {setup.batch_size} "
            f"completions per GPU{per} ({generation_batch_size(setup) // g} prompt(s) x {g} generations across "
            f"{setup.gpus} GPU(s)), each {p} prompt tokens (left-padded) + {c} completion tokens, every completion "
            f"running to max_completion_length (no EOS before it); beta {beta(setup)}, {loss}",
            f"phases: {generation}, scoring ({scoring}), "
            "training (the policy on prompt + completion through TRL's fused LM head, backward, optimizer step)",
            f"reference: {ref}"] + generation_batch_notes(setup, scores_policy)


def generation_batch_notes(setup, scores_policy: bool = False) -> list[str]:
    """The generation batch when it serves several training steps or GRPO scores the old policy for it (none when
    each step generates its own)."""
    k, misaligned = steps_per_generation(setup), steps_misaligned(setup) and not scores_policy
    if k == 1 and not misaligned:
        return []
    rows, b = generation_rows(setup), setup.batch_size
    old = (f"; gradient_accumulation_steps {gradient_accumulation(setup)} is not a multiple of it, so the scoring "
           "also runs the policy for old_per_token_logps, kept in the batch" if misaligned else "")
    return [f"generation batch: steps_per_generation {k} ({generation_batch_size(setup)} completions on "
            f"{setup.gpus} GPU(s)): each GPU generates {rows} completions at once (its KV cache and sampling over "
            f"{rows} rows), scores them in chunks of --batch-size {b} (_get_per_token_logps_and_entropies' "
            f"batch_size) and keeps the whole batch (ids, masks, advantages, log-probs) through the next {k} "
            f"training steps, each on one {b}-row slice; the estimate and the trace run the generating steps (the "
            f"steps between hold what a training phase holds){old}"]
