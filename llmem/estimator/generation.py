"""Generation objectives on the estimator floor: generate and the scoring phases as events.

A generation objective's events in the step's schedule (--objective grpo): GRPOTrainer with transformers'
generate, as llmem.runtime.generation traces it. Each iteration is a step that generates (TRL's steps 0 and
steps_per_generation; the steps between train on slices of the buffered batch, holding what a training phase holds)
and has three phases before the optimizer step. B below is the generation batch's rows, --batch-size x
steps_per_generation (GRPOConfig's; `generation_rows`); the scoring's forwards and the training run --batch-size rows:

- generation: the prompts [B, P] int64 (ids and mask) on the device; `generate` of the unwrapped policy under
  no_grad: a prefill forward over the P prompt tokens, then C - 1 decode forwards of one token (C =
  max_completion_length), each in its own autocast region (accelerate's wrapper), so autocast caches the casts of
  the policy's trained fp32 weights until each forward returns; a decoder layer's tensors live only until the next
  block has used them (as llmem.estimator.objectives' no-grad forward); each layer's DynamicCache K and V
  (transformers' cache_utils.DynamicLayer.update: `torch.cat([self.keys, key_states], dim=-2)`, the old tensors
  freed) grow to P + C - 1 tokens of [B, kv_heads, tokens, head_dim] in the compute dtype (`kv_cache_bytes`); the
  head runs on the last token only (`logits_to_keep=1`): [B, 1, V] logits, their fp32 copy [B, V] and the sampling
  probabilities [B, V] fp32 (transformers' _sample; TRL's defaults add no logits processor), which live until the
  next step rebinds them; the growing ids and mask [B, T] int64. All of it dies when generate returns. Under ZeRO-3
  TRL's unwrap_model_for_generation gathers the whole policy around it (llmem.estimator.deepspeed
  gather_for_generation).
- scoring: the re-padded batch (prompt ids and mask [B, P], completion ids and mask [B, C] int64, kept through the
  steps it serves: `_buffered_inputs`, whose --batch-size slices are views), their concatenation [B, S] int64 x 2
  and, when beta > 0, the reference's no-grad forwards through its fused head (the copy's, or the policy's with its
  adapters disabled) in chunks of --batch-size (`_get_per_token_logps_and_entropies`' batch_size: per chunk the
  labels [b, S] int64 and the chunk's per-token log-probs [b, C] fp32, then their torch.cat [B, C], kept); the
  advantages [B] fp32; the previous generation batch dies. RLOO (ObjectiveSpec.scores_policy, sequence_logps) first
  runs the policy itself under no_grad (old_per_token_logps; autocast caches its trained fp32 weights' casts until
  the forward returns), keeps only the per-sequence sums old_logps [B] fp32, and frees the per-token log-probs and
  its KL penalty's [B, C] tensors when the scoring returns; GRPO runs the policy too when its steps are misaligned
  (gradient_accumulation_steps not a multiple of steps_per_generation) and keeps its per-token log-probs. The
  permuted copy `shuffle_sequence_dict` makes of the batch (a moment between scoring and training, the batch's few
  bytes twice) is left out.
- weight_sync (--use-vllm under FSDP2, before the generation): TRL's sync of the policy's full tensors to vLLM
  (GenerationEvents.weight_sync: colocated one at a time, peft's merge / unmerge around the walk; in server mode
  through vLLM's packed broadcast, llmem.memory.vllm), vLLM then generating (the trainer holds the ids only).
- training: `_compute_loss`'s concatenation [B, S] int64 x 2, then the policy's forward and TRL's fused head as
  DPO's (llmem.estimator.objectives), with no reference forward inside; the loss's per-token [B, C] tensors
  (a few KiB) are left out.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import TYPE_CHECKING

from llmem.errors import LlmemError
from llmem.estimator.objectives import (
    INT64,
    REF_ALL_GATHER,
    PreferenceEvents,
    fused_head,
    lm_head_param,
    policy_weight_bytes,
    reference_copy_bytes,
    reference_head,
)
from llmem.estimator.states import fsdp_gathered_tensors
from llmem.memory.activations.profile import activation_profile
from llmem.memory.vllm import (
    PACKED_BUFFER_BYTES,
    PACKED_NUM_BUFFERS,
    PEFT_PREFIX,
    VllmModel,
    VllmPool,
    packed_broadcast_peak,
    packed_groups,
    vllm_pool,
)
from llmem.model.peft import element_bytes
from llmem.model.resolved import ResolvedSetup
from llmem.model.sharding import fsdp_unit_numel
from llmem.setup.generation import (
    completion_length,
    generation_rows,
    plain_setup,
    prompt_length,
    vllm_mode,
    vllm_utilization,
)
from llmem.setup.objectives import REF_ADAPTERS_OFF, REF_COPY, reference_mode, scores_old_policy
from llmem.setup.precision import F32

if TYPE_CHECKING:
    from llmem.estimator.schedule.hooks import StepHooks
    from llmem.model.anatomy import ModelAnatomy

VLLM_SIDE_STREAMS = (REF_ALL_GATHER + 1, REF_ALL_GATHER + 2)    # vLLM's packed broadcast streams, its own
# the hand recipes' block holding the attention core (llmem.memory.activations.recipes): the cache is updated as it
# starts (LlamaAttention.forward: past_key_values.update after RoPE, before attention_interface)
ATTENTION_BLOCK = "attention"
MODELLED_DECODE_STEPS = 64      # longer completions: this many decode steps laid out, the cache growing in strides


def decode_totals(prompt: int, completion: int) -> list[int]:
    """The tokens in the cache after each forward generate runs: the prefill (the prompt), then one per decode step
    up to prompt + completion - 1; beyond MODELLED_DECODE_STEPS decode steps, that many, evenly strided (the last
    one exact): the peak is the last step's, the allocator's growth pattern is approximated."""
    decodes = completion - 1
    if decodes <= MODELLED_DECODE_STEPS:
        return [prompt + k for k in range(decodes + 1)]
    return [prompt] + [prompt + -(-k * decodes // MODELLED_DECODE_STEPS) for k in range(1, MODELLED_DECODE_STEPS + 1)]


def kv_cache_bytes(layers: int, batch: int, kv_heads: int, head_dim: int, tokens: int, dtype_bytes: int) -> int:
    """A DynamicCache's keys and values: per layer [batch, kv_heads, tokens, head_dim] each."""
    return 2 * layers * batch * kv_heads * head_dim * tokens * dtype_bytes


def attention_dims(anatomy: ModelAnatomy) -> tuple[int, int]:
    """(kv_heads, head_dim) as the model's attention runs them: the anatomy's, read from the config under each
    family's own spellings (GPT-2's n_head, BLOOM's n_head, GPTBigCode's multi_query; head_dim: hidden_size / heads
    unless given)."""
    return anatomy.num_kv_heads, anatomy.head_dim


def generation_kv_bytes(r: ResolvedSetup) -> int:
    """The DynamicCache at generate's last forward over the generation batch's rows: P + C - 1 tokens (the last
    sampled token is never fed)."""
    setup = r.setup
    kv, d = attention_dims(r.anatomy)
    return kv_cache_bytes(r.anatomy.num_layers, generation_rows(setup), kv, d, setup.seq_len - 1, kv_dtype_bytes(r))


def kv_dtype_bytes(r: ResolvedSetup) -> int:
    """The DynamicCache's dtype: k_proj's and v_proj's output. Under autocast (or pure low precision) the compute
    dtype; bitsandbytes' Linear4bit / Linear8bitLt return their input's dtype (`out.to(inp_dtype)`,
    bitsandbytes/nn/modules.py), the input_layernorm's output, the residual stream's (fp32 behind
    prepare_model_for_kbit_training's fp32 norms), and peft's LoRA sum keeps it (llmem.memory.activations.quantised
    quant_input_bytes: a norm-fed block)."""
    return r.regime.res if r.setup.quant_spec.bitsandbytes else r.regime.mm


class GenerationEvents(PreferenceEvents):
    """GRPO's events in a StepSchedule `s`: generation and scoring before its forward, the training phase as DPO's
    fused head without the reference forward."""

    def __init__(self, s: StepHooks, r: ResolvedSetup) -> None:
        super().__init__(s, r)
        setup = r.setup
        self.b, self.p, self.c = setup.batch_size, prompt_length(setup), completion_length(setup)
        self.gen_rows = generation_rows(setup)    # the generation batch: --batch-size x steps_per_generation
        self.chunks = self.gen_rows // self.b   # its scoring chunks of --batch-size (steps_per_generation)
        self.scores_old = scores_old_policy(setup)
        kv, d = attention_dims(r.anatomy)
        self.kv_token_bytes = self.gen_rows * kv * d * kv_dtype_bytes(r)   # one layer's K (or V), one token
        self.iteration = 0
        self.step_batch: list[int] = []
        self.loss_inputs: list[int] = []

    @functools.cache  # noqa: B019 - one schedule's few shapes
    def profile(self, tokens: int):
        """The decoder layer's tensors over `tokens` new tokens, checkpointing paused (unwrap_model_for_generation
        turns it off)."""
        r = self.r
        plain = replace(plain_setup(r.setup), batch_size=self.gen_rows, seq_len=tokens, grad_ckpt=False, ckpt_every=1)
        return activation_profile(ResolvedSetup(plain, r.anatomy, r.base, r.gpu, r.layout))

    # ---------------------------------------------------------------------------------------------- phases
    def batch(self) -> None:
        """GRPO's batch is made in its scoring phase."""

    def before_forward(self) -> None:
        s = self.s
        it = self.iteration
        self.iteration += 1
        if vllm_mode(self.r.setup) is not None and s.facts.fsdp:    # FSDP2: the weights pushed to vLLM first
            s.sch.phase = f"it{it}:weight_sync"
            self.weight_sync()
        s.sch.phase = f"it{it}:generation"
        self.generation()
        s.sch.phase = f"it{it}:scoring"
        self.scoring()
        s.sch.phase = f"it{it}:forward"
        alloc = s.sch.alloc                  # _compute_loss: torch.cat of the prompt and completion ids and masks
        self.loss_inputs = [alloc(self.b * self.seq * INT64, "activations") for _ in range(2)]

    def forwards_after_policy(self) -> None:
        """The reference was scored in the scoring phase."""

    def head_forward(self) -> None:
        super().head_forward()
        self.s.sch.free_all(self.loss_inputs)     # _compute_loss returns

    # ---------------------------------------------------------------------------------------------- generation
    def weight_sync(self) -> None:
        """VLLMGeneration.sync_weights under FSDP2 (trl/generation/vllm_generation.py _iter_fsdp2_params): the
        policy's parameters in module order (tied ones once), each DTensor's full_tensor() an all-gather of its
        padded shards in the stored dtype (torch's Shard._to_replicate_tensor; unpadding is a view). Colocated,
        each is copied into vLLM's own weights (load_weights). In server mode the first sync walks them once for
        their metadata (`_weight_metadata`), then every sync streams them through vLLM's packed broadcast (the main
        process's, rank 0: the others only walk them)."""
        f = self.s.facts
        full = [f.params.unsharded[p.name] * element_bytes(p, f.setup) for p in f.params.kept
                if PEFT_PREFIX not in p.name]
        server = vllm_mode(self.r.setup) == "server"
        if not server or self.iteration == 1:
            self.one_at_a_time(full)
        if server:
            self.packed_broadcast(full)

    def one_at_a_time(self, full: list[int]) -> None:
        """A loop over the full tensors whose variable holds the previous one until the next is gathered: two live
        at once (sync_weights' load_weights loop, the metadata list comprehension); under peft the walk merges the
        adapters first and unmerges them after its last tensor (still held by the loop's variable)."""
        sch = self.s.sch
        self.merge_adapters(unmerge=False)
        previous = -1
        for n in full:
            key = sch.alloc(n, "gathered_weights")
            sch.free(previous)
            previous = key
        self.merge_adapters(unmerge=True)
        sch.free(previous)

    def merge_adapters(self, unmerge: bool) -> None:
        """peft's merge_adapter / unmerge_adapter on FSDP2's sharded DTensors (peft/tuners/lora/layer.py Linear.merge,
        unmerge, get_delta_weight), each LoRA module in module order: DTensor's mm of lora_B (Shard(0)) and lora_A
        (Shard(0)) all-gathers lora_A, the product [out / shards, in] and its scaled copy in the adapters' dtype, the
        base shard updated in place (unmerge: the delta cast to the base's dtype first); cuBLAS's workspace at the
        step's first matmul."""
        s, f = self.s, self.s.facts
        alloc, free = s.sch.alloc, s.sch.free
        for a, b, base in self.lora_modules:
            s.ensure_workspace()
            delta = f.params.unsharded[b.name] // f.shards * a.shape[1] // a.shape[0] * element_bytes(b, f.setup)
            gathered = alloc(f.params.unsharded[a.name] * element_bytes(a, f.setup), "gathered_weights")
            product = alloc(delta, "gathered_weights")                          # weight_B @ weight_A
            free(gathered)
            scaled = alloc(delta, "gathered_weights")                           # ... * scaling
            free(product)
            if unmerge and element_bytes(b, f.setup) != element_bytes(base, f.setup):   # delta.to(orig_dtype)
                free(alloc(delta // element_bytes(b, f.setup) * element_bytes(base, f.setup), "gathered_weights"))
            free(scaled)

    @functools.cached_property
    def lora_modules(self) -> list:
        """(lora_A, lora_B, base weight) of each LoRA module, in module order (none without peft)."""
        by_name = {p.name: p for p in self.s.facts.params.kept}
        return [(p, by_name[p.name.replace(".lora_A.", ".lora_B.")], by_name[p.name.split(".lora_A.")[0] + ".weight"])
                for p in self.s.facts.params.kept if ".lora_A." in p.name]

    def packed_broadcast(self, full: list[int]) -> None:
        """vLLM's packed_nccl_broadcast_producer (llmem.memory.vllm): on side stream `slot` its previous chunk is
        freed, pack_tensors gathers the full tensors (the generator still holds the last one yielded until it
        resumes) and torch.cat's them into the packed buffer, kept in flight until the slot comes round again."""
        sch = self.s.sch
        in_flight = [-1] * PACKED_NUM_BUFFERS
        slot = 0
        held = -1
        for group in packed_groups(full):
            sch.free(in_flight[slot])
            in_flight[slot] = -1
            stream = VLLM_SIDE_STREAMS[slot]
            chunk: list[int] = []
            for i in group:
                sch.free(held)                      # the generator rebinds `param`
                held = -1
                chunk.append(sch.alloc(full[i], "gathered_weights", stream))
            total = sum(full[i] for i in group)
            in_flight[slot] = sch.alloc(total, "communication_buffers", stream)     # torch.cat(tensor_list)
            sch.free_all(chunk[-2::-1])             # del tensor_list: a list frees its items last to first
            held = chunk[-1]                        # pack_tensors' locals, then (not exhausted) the generator's
            if total <= PACKED_BUFFER_BYTES:
                sch.free(held)                      # exhausted: it dies as pack_tensors returns
                held = -1
            slot = (slot + 1) % PACKED_NUM_BUFFERS
        sch.free(in_flight[slot])                   # the generator's StopIteration: the next slot's wait first,
        in_flight[slot] = -1                        # then what it held
        sch.free(held)
        sch.free_all(in_flight)

    def generation(self) -> None:
        sch, alloc, free = self.s.sch, self.s.sch.alloc, self.s.sch.free
        b, p = self.gen_rows, self.p
        if vllm_mode(self.r.setup) is not None:   # vLLM generates (its pool: colocated_pool): the prompts and the
            prompt = [alloc(b * p * INT64, "activations") for _ in range(2)]   # returned completion ids only
            sch.free_all(prompt + [alloc(b * self.c * INT64, "activations")])
            return
        prompt = [alloc(b * p * INT64, "activations") for _ in range(2)]     # ids, attention mask
        gathered = self.s.gather_for_generation()    # DeepSpeed: TRL's unwrap_model_for_generation
        ids = mask = -1
        cache = [[-1, -1] for _ in range(self.s.facts.layers)]
        sampled: list[int] = []
        for step, total in enumerate(decode_totals(p, self.c)):
            tokens = p if step == 0 else 1
            logits = self.model_forward(tokens, total, cache)
            copy = alloc(b * self.s.facts.vocab_size * F32, "logits_and_loss")        # logits[:, -1].to(float32)
            sch.free_all(sampled[:1])
            probs = alloc(b * self.s.facts.vocab_size * F32, "logits_and_loss")       # softmax for multinomial
            sch.free_all(sampled[1:])
            sampled = [copy, probs]
            free(logits)                                                        # del outputs
            new_ids = alloc(b * (total + 1) * INT64, "activations")             # torch.cat([input_ids, next])
            free(ids)
            ids = new_ids
            new_mask = alloc(b * (total + 1) * INT64, "activations")            # the attention mask's update
            free(mask)
            mask = new_mask
        sch.free_all([k for pair in cache for k in pair])                       # generate returns
        sch.free_all(sampled + [ids, mask])
        self.s.release_after_generation(gathered)
        sch.free_all(prompt)

    def model_forward(self, tokens: int, total: int, cache: list[list[int]]) -> int:
        """One forward of generate over `tokens` new tokens with `total` in the cache after it; returns the key of
        the [B, 1, V] logits."""
        s = self.s
        sch, alloc, free = s.sch, s.sch.alloc, s.sch.free
        regime, h = s.facts.regime, s.facts.hidden_size
        act = self.profile(tokens)
        s.unshard_forward(None, s.facts.root)        # FSDP2: the root gathered at the first forward, kept so
        stream = alloc(self.gen_rows * tokens * h * regime.res, "activations")        # the embedding's output
        s.ensure_workspace()                                                    # cuBLAS's, at the first matmul
        cached: list[int] = []
        for i in range(s.facts.layers):
            s.unshard_forward(i, s.facts.unit(i))     # FSDP2: every forward gathers each layer (zero2: once)
            updated: list[bool] = []

            def update(b, i=i, updated=updated) -> None:     # DynamicLayer.update: the keys, then the values
                if b is not None and b.name != ATTENTION_BLOCK or updated:
                    return
                updated.append(True)
                for kv in (0, 1):
                    new = alloc(self.kv_token_bytes * total, "activations")
                    free(cache[i][kv])
                    cache[i][kv] = new
            previous, pending = self.no_grad_blocks(i, act.blocks_of(i), regime, "cached", cached,
                                                    self.gen_rows * tokens, adapters=True, before=update)
            update(None)       # a learned layer without the recipes' attention block: the update at its end
            self.dequantise(pending, self.gen_rows * tokens, adapters=True)    # the layer's last linears (the MLP's)
            out = alloc(self.gen_rows * tokens * h * regime.res, "activations")
            sch.free_all(previous)
            free(stream)
            stream = out
            if s.facts.reshard:                           # ... and reshards it after (reshard_after_forward)
                s.reshard_unit(i)
        s.release_forward_gathers()                # the root's post-forward frees the last all-gather output
        norm = alloc(self.gen_rows * tokens * h * regime.res, "activations")
        free(stream)
        head = self.head_param
        # the lm_head's cached cast
        if regime.autocast and head.trainable and s.facts.params.element_bytes.get(head.name) == F32:
            cached.append(alloc(s.facts.params.tp_local[head.name] * regime.mm, "gathered_weights"))
        logits = alloc(self.gen_rows * s.facts.vocab_size * (regime.mm if regime.autocast else regime.res),
                       "logits_and_loss")
        free(norm)
        sch.free_all(cached)                       # the forward's autocast region ends: its cache is cleared
        return logits

    # ---------------------------------------------------------------------------------------------- scoring
    def scoring(self) -> None:
        """`_generate_and_score_completions` after generate, over the generation batch's rows: the re-padded batch
        and its concatenation, the old policy's per-token log-probs (RLOO; GRPO's misaligned steps), the
        reference's (beta > 0), the advantages; the new batch replaces the buffered one (`_buffered_inputs`)."""
        sch, alloc, free = self.s.sch, self.s.sch.alloc, self.s.sch.free
        rows, p, c = self.gen_rows, self.p, self.c
        new_batch = [alloc(rows * n * INT64, "activations") for n in (p, p, c, c)]
        joined = [alloc(rows * self.seq * INT64, "activations") for _ in range(2)]
        per_token: list[int] = []                # the [rows, C] fp32 log-probs of each no-grad forward
        if self.scores_old:                      # the policy's old log-probs (RLOO: then their per-sequence sums)
            per_token.append(self.logps_forward(lambda: self.no_grad_forward(self.s.facts.regime, "cached",
                                                                             self.policy_head())))
        if self.spec.sequence_logps:
            product = alloc(rows * c * F32, "activations")               # old_per_token_logps * completion_mask
            new_batch.append(alloc(rows * F32, "activations"))          # .sum(1): old_logps
            free(product)
        reference = self.mode in (REF_COPY, REF_ADAPTERS_OFF)
        if reference:
            per_token.append(self.logps_forward(self.reference_forward))
        sch.free_all(joined)
        if self.spec.sequence_logps and reference:   # RLOO's KL penalty: per_token_kl, (per_token_kl * mask).sum(-1)
            per_token.append(alloc(rows * c * F32, "activations"))
            product = alloc(rows * c * F32, "activations")
            per_token.append(alloc(rows * F32, "activations"))
            free(product)
        new_batch.append(alloc(rows * F32, "activations"))               # advantages
        if not self.spec.sequence_logps:         # GRPO keeps the per-token log-probs, and num_items_in_batch
            new_batch += per_token + [alloc(F32, "activations")]
        sch.free_all(self.step_batch)            # _buffered_inputs: the previous generation batch
        self.step_batch = new_batch
        if self.spec.sequence_logps:             # RLOO: the per-token tensors die as the scoring returns
            sch.free_all(per_token)

    def logps_forward(self, forward) -> int:
        """`_get_per_token_logps_and_entropies` over the generation batch in chunks of --batch-size: per chunk the
        labels, the model's no-grad forward through its fused head, the chunk's per-token log-probs [B, C] fp32;
        then their torch.cat [rows, C] (one chunk: the chunk's own; returned)."""
        chunks = []
        for _ in range(self.chunks):
            labels = self.s.sch.alloc(self.b * self.seq * INT64, "logits_and_loss")    # input_ids.masked_fill(...)
            forward()
            chunks.append(self.s.sch.alloc(self.b * self.c * F32, "activations"))
            self.s.sch.free(labels)
        if len(chunks) == 1:
            return chunks[0]
        logps = self.s.sch.alloc(self.gen_rows * self.c * F32, "activations")           # torch.cat(all_logps)
        self.s.sch.free_all(chunks)
        return logps


def policy_gathered_bytes(r: ResolvedSetup) -> tuple[int, int, int]:
    """Under FSDP2, the policy's root unit, its largest decoder layer's and all its layers' bytes as gathered
    (MixedPrecisionPolicy's param_dtype under *-mixed); zeros without FSDP2."""
    if not r.layout.shards_model_states:
        return 0, 0, 0
    setup, layout = r.setup, r.layout
    units: dict[int | None, int] = {}
    for q in r.anatomy.params:
        units[q.layer_index] = units.get(q.layer_index, 0) + sum(fsdp_gathered_tensors(q, setup, layout))
    layers = [n for k, n in units.items() if k is not None]
    return units.get(None, 0), max(layers, default=0), sum(layers)


def full_tensor_bytes(r: ResolvedSetup) -> list[int]:
    """Under FSDP2, each policy parameter's full_tensor() in module order (its padded all-gather, stored dtype): what
    the weight sync to vLLM gathers one at a time (GenerationEvents.weight_sync); empty without FSDP2."""
    if not r.layout.shards_model_states:
        return []
    return [fsdp_unit_numel([p], r.layout) * element_bytes(p, r.setup) for p in r.anatomy.params
            if PEFT_PREFIX not in p.name]


def weight_sync_bytes(r: ResolvedSetup) -> int:
    """The weight sync's peak of gathered tensors: the largest two consecutive full tensors (the loop variable holds
    the previous one while the next is gathered)."""
    full = full_tensor_bytes(r)
    return max((a + b for a, b in zip(full, full[1:], strict=False)), default=sum(full))


def generation_moments(r: ResolvedSetup, act, ms, sft_moments) -> list:
    """The step's moments for GRPO: the training phase's (sft's with TRL's fused head, as preference_moments), then
    the generation phase's last forward (weights, the autocast casts of the trained fp32 weights, the KV cache, the
    [B, V] logits) and the scoring phase's reference forward."""
    setup = r.setup
    moments = sft_moments(ResolvedSetup(plain_setup(setup), r.anatomy, r.base, r.gpu, r.layout), act, ms)
    mode = reference_mode(setup)
    ref_weights, ref_gathered = reference_copy_bytes(r)
    head = fused_head(r, r.regime, policy_weight_bytes(r))
    p = lm_head_param(r)
    copy = head.v * head.h * r.regime.mm if r.regime.autocast and head.weight_bytes != head.mm else 0
    backward = head.backward_peak_bytes(head.weight_bytes if p.trainable else None)
    root, layer, layers = policy_gathered_bytes(r)
    kept_ref = ref_gathered if not r.method.reshard_after_forward else 0    # zero2: the copy stays gathered
    out = []
    for i, m in enumerate(moments):
        parts = dict(m.components)
        parts["weights"] = parts.get("weights", 0) + ref_weights
        if kept_ref:
            parts["gathered_weights"] = parts.get("gathered_weights", 0) + kept_ref
        if i < 2:
            parts["logits_and_loss"] = head.forward_peak_bytes if i == 0 else backward
            parts["gathered_weights"] = max(parts.get("gathered_weights", 0) - copy, 0)
        out.append(type(m)(m.phase, parts))
    static = {k: v for k, v in out[-1].components.items() if k in ("weights", "optimizer_states",
                                                                     "communication_buffers", "cuda_workspaces")}
    casts = sum(q.numel for q in r.anatomy.params if q.trainable and element_bytes(q, setup) == F32
                and q.module_kind in ("Linear", "Conv1D")) * r.regime.mm if r.regime.autocast else 0
    logits = 3 * generation_rows(setup) * r.anatomy.vocab_size * F32
    # FSDP2: the policy's root kept gathered, and a layer with its all-gather output (zero2: every layer)
    policy_units = root + (layers if not r.method.reshard_after_forward else 2 * layer)
    if vllm_mode(setup) == "server" and r.layout.shards_model_states:    # the packed broadcast's peak
        full, packed = packed_broadcast_peak(full_tensor_bytes(r))
        out.append(type(out[0])("weight_sync", {**static, "gathered_weights": full + kept_ref,
                                                "communication_buffers": static.get("communication_buffers", 0)
                                                + packed}))
    elif vllm_mode(setup) is not None:     # vLLM generates: nothing of generate's; FSDP2's weight sync before it
        out.append(type(out[0])("weight_sync", {**static, "gathered_weights": weight_sync_bytes(r) + kept_ref}))
    else:
        out.append(type(out[0])("generation", {**static, "gathered_weights": casts + policy_units + kept_ref,
                                               "activations": generation_kv_bytes(r), "logits_and_loss": logits}))
    scoring = {**static, "logits_and_loss": 0}
    gathered = root + kept_ref
    if mode in (REF_COPY, REF_ADAPTERS_OFF):
        scoring["logits_and_loss"] = reference_head(r).forward_peak_bytes
        gathered += 2 * ref_gathered if mode == REF_COPY and not kept_ref else \
            policy_units - root if mode == REF_ADAPTERS_OFF else 0
    if gathered:
        scoring["gathered_weights"] = gathered
    if scores_old_policy(setup) and head.forward_peak_bytes >= scoring["logits_and_loss"]:
        scoring.update(logits_and_loss=head.forward_peak_bytes,                  # RLOO's old log-probs
                       gathered_weights=casts + policy_units + kept_ref)
    if scoring["logits_and_loss"]:
        out.append(type(out[0])("scoring", scoring))
    return out


# ------------------------------------------------------------------------------------------------------ vLLM
def colocated_pool(r: ResolvedSetup) -> VllmPool | None:
    """The colocated vLLM engine's pool on this GPU (--use-vllm, vllm_mode colocate; None otherwise), as TRL 1.16
    builds it: the base model's weights in its checkpoint dtype, max_model_len vllm_max_model_length or the model's
    max_position_embeddings (vLLM's default), max_num_seqs = per_device_train_batch_size x steps_per_generation
    (vllm_tensor_parallel_size 1)."""
    setup = r.setup
    if vllm_mode(setup) != "colocate":
        return None
    cfg = r.base.config
    kv, d = attention_dims(r.base)
    dtype = 4 if str(cfg.get("torch_dtype") or cfg.get("dtype") or "") in ("float32", "torch.float32") else 2
    m = VllmModel(params=r.base.total_params, num_layers=r.base.num_layers, num_kv_heads=kv, head_dim=d,
                  hidden_size=r.base.hidden_size, intermediate_size=cfg.get("intermediate_size") or 4 * r.base.hidden_size,
                  vocab_size=r.base.vocab_size, dtype_bytes=dtype)
    max_len = setup.vllm_max_model_length or cfg.get("max_position_embeddings") or setup.seq_len
    return vllm_pool(m, r.gpu.memory_bytes, vllm_utilization(setup), max_len, max_num_seqs=generation_rows(setup),
                     sleep=setup.vllm_enable_sleep_mode)


def check_vllm_starts(r: ResolvedSetup, pool: VllmPool, weights_bytes: int, context_bytes: int) -> None:
    """vLLM's start-up check (v1 gpu_worker.init_device: free memory >= requested): the training process's CUDA
    context and the policy's (and reference's) weights are on the device when TRL builds the engine; under FSDP2
    they are not yet (transformers' Trainer leaves the model on the host, place_model_on_device False, until
    accelerate's prepare shards it in train(); trl's prepare_fsdp of the reference comes after the engine)."""
    if r.layout.shards_model_states:
        weights_bytes = 0
    free = r.gpu.memory_bytes - context_bytes - weights_bytes
    if free < pool.pool_bytes:
        most = max(0.0, free / r.gpu.memory_bytes)
        raise LlmemError(f"vLLM would not start: vllm_gpu_memory_utilization {vllm_utilization(r.setup):g} asks "
                         f"{pool.pool_bytes / 1024**3:.1f} GiB, but {free / 1024**3:.1f} GiB are free once the "
                         f"training weights are loaded: lower --vllm-gpu-memory-utilization to at most "
                         f"{int(most * 100) / 100:g}")


def vllm_note(r: ResolvedSetup, pool: VllmPool) -> str:
    seqs = pool.concurrent_sequences(r.setup.seq_len)
    gib = 1024**3
    held = ("released between generations (sleep mode: TRL's sleep(level=2)), resident only while generating"
            if pool.sleeps else "resident through training (no sleep mode): the trainer has the rest of the device")
    return (f"vLLM colocated (not run; its pool from vLLM's accounting, llmem.memory.vllm): "
            f"{pool.pool_bytes / gib:.2f} GiB = vllm_gpu_memory_utilization {vllm_utilization(r.setup):g} x the "
            f"device: weights {pool.weights_bytes / gib:.2f} GiB, the profile run's activations "
            f"{pool.activation_peak_bytes / gib:.2f} GiB and CUDA graphs + NCCL/cuBLAS "
            f"{(pool.cuda_graph_bytes + pool.non_torch_bytes) / gib:.2f} GiB (both assumptions), KV cache "
            f"{pool.kv_cache_bytes / gib:.2f} GiB = {pool.num_blocks} blocks of {pool.block_size} tokens "
            f"({seqs} of the {generation_rows(r.setup)} sequences of {r.setup.seq_len} tokens at once; vLLM queues the "
            f"rest); {held}" + (weight_sync_note(r) if r.layout.shards_model_states else ""))


def weight_sync_note(r: ResolvedSetup) -> str:
    """FSDP2: what the weight_sync phase holds and assumes."""
    gib = 1024**3
    return (f"; weight_sync phase (FSDP2, before each generation): TRL's sync_weights gathers each policy "
            f"parameter's full_tensor() in the stored dtype one at a time, two live at once (the largest pair "
            f"{weight_sync_bytes(r) / gib:.2f} GiB) beside the sharded states and the pool"
            + (" (vLLM's weights woken first; its KV cache after, the full tensors' blocks still cached)"
               if r.setup.vllm_enable_sleep_mode else "")
            + ("; peft's merge_adapter before the walk and unmerge_adapter after it, on the sharded DTensors "
               "(lora_A all-gathered, lora_B @ lora_A and its scaled copy on this rank's rows, one module at a time)"
               if r.setup.lora_rank else "")
            + "; vLLM's load_weights copies them into its own weights (no trainer-side temporaries assumed); "
            "the policy is not run while vLLM generates (no FSDP2 unit gathered); vLLM starts before accelerate "
            "shards the model onto the device, so its free-memory check sees only the CUDA context")
