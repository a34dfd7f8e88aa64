"""Preference objectives on the estimator floor: DPO's and KTO's events in the step's schedule.

A preference objective's events in the step's schedule (--objective dpo / kto): TRL's DPOTrainer and KTOTrainer as
llmem.runtime.objectives traces them.

StepSchedule calls these at its entry points (`PreferenceEvents`): the reference copy's weights after the policy's
and the batch before the step, KTO's no_grad forward of the KL sequences before the policy's own, TRL's fused LM
head and the reference forward(s) in place of the loss on full logits, and the fused head's backward. DPO's forward
runs 2 x --batch-size sequences (`objective_view`: the set-up at that batch, its activation profile), chosen then
rejected; KTO's runs --batch-size completions.

TRL's fused head (trl/trainer/utils.py add_fused_lm_head, trl/kernels/chunked_logprob.py ChunkedLogProbFunction),
on CUDA: the final norm's output [rows, S, H] lives until the head returns; only the N completion tokens are
projected (`hidden[mask]`, a copy [N, H] saved for backward, as are the targets [N] int64); per tile of
[min(N, 4096), 32768] (one buffer, `mm_buf`, in the compute dtype, whatever the vocabulary) the token chunk cast to
the compute dtype and the weight chunk cast to it (when their dtypes differ); seven fp32 statistics per token;
log_z and entropy saved. Backward: fp32 accumulators for the hidden states' gradient [N, H] and, when the lm_head
trains, the weight's [V, H] (AccumulateGrad takes it as the gradient), the tile buffer again, the casts (the
weight chunk held until the next one replaces it), then the gradient scattered back to [rows, S-1, H]
(index_put on zeros) and to [rows, S, H] (the slice's backward).

A forward under no_grad (the reference's; KTO's KL sequences through the policy and the reference): a decoder
layer's tensors live only until the next block has used them (modelled as two adjacent blocks' tensors live),
autocast casts a frozen fp32 weight for each use (freed after) and caches the casts of the policy's trained fp32
weights until the forward returns (its own autocast region), and the fused head allocates what the policy's does,
all of it freed when it returns.

Per-token and per-pair scalars (masks, the five per-token outputs, the loss's terms) are a few KiB; the ones that
live through the step are laid out, the loss's own are left out.

Under FSDP2 (trl/models/utils.py prepare_fsdp): the reference copy is one fully_shard unit, the root of its own
tree: its shard in the weights; at its forward the bf16 copy-in of the shard (under *-mixed), the whole copy's
all-gather output on its own stream and every parameter unsharded, resharded after the forward (zero2: kept) and
the output freed by its root's post-forward; the policy's no-grad forwards gather its units as its own forward
does; the lm_head the fused head multiplies by is the unsharded one (MixedPrecisionPolicy's param_dtype).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from llmem.errors import LlmemError
from llmem.estimator.events import REDUCE_SCATTER
from llmem.memory.activations.blocks import norm_saved
from llmem.memory.activations.profile import ActivationProfile, activation_profile
from llmem.model.families import family_of
from llmem.model.peft import element_bytes
from llmem.model.resolved import ResolvedSetup
from llmem.model.sharding import MATMUL_KINDS, fsdp_unit_numel, is_lm_head, is_saved_copy
from llmem.setup.objectives import (
    FUSED_TOKEN_CHUNK,
    FUSED_VOCAB_CHUNK,
    REF_ADAPTERS_OFF,
    REF_COPY,
    REF_HEAD_OUTPUTS,
    REF_PRECOMPUTED,
    check_dropout_free,
    completion_tokens,
    kl_sequences,
    objective_spec,
    reference_mode,
)
from llmem.setup.precision import F32, Regime

if TYPE_CHECKING:
    from llmem.estimator.schedule.hooks import StepHooks

INT64, BOOL = 8, 1
# FSDP2's streams are per root (FSDPCommContext): the reference copy, a root of its own, all-gathers on its own
REF_ALL_GATHER = REDUCE_SCATTER + 1
BATCH_FIELDS = 3          # input_ids, attention_mask, completion_mask: [rows, S] int64 each


def objective_view(r: ResolvedSetup, act: ActivationProfile) -> tuple[ResolvedSetup, ActivationProfile]:
    """The forward the objective runs: `sequences_per_sample` x --batch-size sequences (dpo: chosen + rejected)."""
    spec = objective_spec(r.setup.objective)
    check_dropout_free(spec.name, r.anatomy.config)
    if spec.sequences_per_sample == 1:
        return r, act
    doubled = r.with_shape(r.setup.batch_size * spec.sequences_per_sample)
    return doubled, activation_profile(doubled)


def reference_regime(policy: Regime, ref_bytes: int) -> Regime:
    """The reference copy's dtypes: the policy's regime when it is stored like the policy's trained parameters,
    else (a 16-bit copy) a 16-bit residual stream (autocast over 16-bit weights, or pure low precision)."""
    if ref_bytes == F32 or policy.res == ref_bytes:
        return policy
    return Regime(policy.name, ref_bytes, policy.mm)


class FusedHead:
    """TRL's fused LM head over N completion tokens (one call's sizes)."""

    def __init__(self, rows: int, seq: int, tokens: int, hidden: int, vocab: int, out_bytes: int, mm: int,
                 weight_bytes: int, outputs: tuple[str, ...]) -> None:
        self.rows, self.seq, self.n, self.h, self.v = rows, seq, tokens, hidden, vocab
        self.out_bytes, self.mm, self.weight_bytes = out_bytes, mm, weight_bytes
        self.outputs = outputs       # the per-token fields it computes (add_fused_lm_head's `outputs`)

    @property
    def tile_bytes(self) -> int:
        return min(self.n, FUSED_TOKEN_CHUNK) * FUSED_VOCAB_CHUNK * self.mm

    def token_chunks(self) -> list[int]:
        return [min(FUSED_TOKEN_CHUNK, self.n - s) for s in range(0, self.n, FUSED_TOKEN_CHUNK)]

    def vocab_chunks(self) -> list[int]:
        return [min(FUSED_VOCAB_CHUNK, self.v - s) for s in range(0, self.v, FUSED_VOCAB_CHUNK)]

    def hidden_cast(self, n: int) -> int:
        return n * self.h * self.mm if self.out_bytes != self.mm else 0

    def weight_cast(self, c: int) -> int:
        return c * self.h * self.mm if self.weight_bytes != self.mm else 0

    @property
    def saved_bytes(self) -> int:
        """What one policy call leaves for backward: the mask, the completion tokens, the targets, log_z and
        entropy."""
        stats = 2 if "entropy" in self.outputs else 1
        return self.rows * (self.seq - 1) * BOOL + self.n * (self.h * self.out_bytes + INT64 + stats * F32)

    @property
    def forward_peak_bytes(self) -> int:
        """The call's largest moment (the final norm's output included): its saved tensors, the seven statistics,
        the tile buffer and the first chunks' casts."""
        return (self.rows * self.seq * self.h * self.out_bytes + self.saved_bytes + 7 * self.n * F32
                + self.tile_bytes + self.hidden_cast(self.token_chunks()[0]) + self.weight_cast(self.vocab_chunks()[0]))

    def backward_peak_bytes(self, weight_grad_bytes: int | None) -> int:
        """The backward's largest moment: the saved tensors, the fp32 accumulators (the weight's when it trains,
        `weight_grad_bytes` its gradient's bytes per element), the tile buffer, the casts, the returned casts."""
        v = self.v * self.h
        weight = 0 if weight_grad_bytes is None else v * F32 + (v * weight_grad_bytes if weight_grad_bytes != F32
                                                                else 0)
        hidden = self.n * self.h * (F32 + (self.out_bytes if self.out_bytes != F32 else 0))
        return (self.saved_bytes + self.n * F32 + hidden + weight + self.tile_bytes
                + self.hidden_cast(self.token_chunks()[0]) + self.weight_cast(self.vocab_chunks()[0]))


def fused_head(r: ResolvedSetup, regime: Regime, weight_bytes: int, outputs: tuple[str, ...] | None = None
               ) -> FusedHead:
    """TRL's fused head over the doubled set-up `r`'s completion tokens, its hidden states the final norm's output
    under `regime`, its lm_head weight in `weight_bytes` per element, computing `outputs` (the policy's: DPOTrainer's
    metrics' fields; a reference copy's: the log-probs only)."""
    setup, anatomy = r.setup, r.anatomy
    rows, seq, h = setup.batch_size, setup.seq_len, anatomy.hidden_size
    _, out = norm_saved(family_of(anatomy.model_type).norm, regime, rows * seq, h)
    out_bytes = out // (rows * seq * h)
    mm = regime.mm if regime.autocast else out_bytes   # ChunkedLogProbFunction: autocast's dtype, else the input's
    return FusedHead(rows, seq, rows * completion_tokens(setup), h, anatomy.vocab_size, out_bytes, mm, weight_bytes,
                     objective_spec(setup.objective).head_outputs if outputs is None else outputs)


def lm_head_param(r: ResolvedSetup, adapters: bool = True):
    """The lm_head weight, or the embedding tied to it. A head of another name (BioGPT's output_projection, which
    transformers' get_output_embeddings returns) is the root matrix tied to the input embedding, or, untied, the
    root Linear of [vocab, hidden]. Under peft's modules_to_save the head is two modules (ModulesToSaveWrapper):
    the trained copy the policy's forward runs, and (`adapters` False: peft's disable_adapter(), the reference
    forward of TRL's trainers) the frozen original."""
    a = r.anatomy
    root = [p for p in a.params if p.layer_index is None]
    heads = [p for p in root if is_lm_head(p)]
    if len(heads) > 1:
        heads = [p for p in heads if is_saved_copy(p) == adapters] or heads
    head = (next(iter(heads), None)
            or next((p for p in root if p.tied_to and len(p.shape) == 2), None)
            or next((p for p in root if p.module_kind == "Linear" and p.shape == (a.vocab_size, a.hidden_size)), None))
    if head is None:
        raise LlmemError(f"{a.name}: llmem finds no output layer (lm_head) among its parameters, which this "
                         "objective's fused head reads")
    return head


def policy_weight_bytes(r: ResolvedSetup, adapters: bool = True) -> int:
    """Bytes per element of the lm_head weight the head multiplies by: its stored dtype, or under FSDP2 the
    unsharded parameter's, MixedPrecisionPolicy's param_dtype (FSDPParam casts every parameter it gathers);
    `adapters` False: the head peft's disable_adapter() runs (lm_head_param)."""
    p = lm_head_param(r, adapters)
    if r.layout.shards_model_states:
        return r.setup.gather_bytes
    if r.method.zero_stage is not None:       # DeepSpeed's engine casts the whole module (model_bytes)
        return r.setup.compute_bytes
    return element_bytes(p, r.setup) if p.trainable else r.setup.stored_bytes(False)


def reference_bytes(r: ResolvedSetup) -> int:
    """Bytes per element of the reference copy: TRL loads it in the policy's dtype (dtype=self.model.dtype), or
    --ref-dtype compute; under DeepSpeed its prepare_deepspeed engine casts it to the compute dtype (engine.py
    _configure_distributed_model, the config's bf16 / fp16), whichever it was loaded in."""
    if r.setup.ref_dtype == "compute" or r.method.zero_stage is not None:
        return r.setup.compute_bytes
    return r.setup.param_bytes


def reference_gather_bytes(r: ResolvedSetup) -> int:
    """Bytes per element of the reference copy's weights as its forward reads them: its own dtype, or under FSDP2
    the all-gathered one (trl's prepare_fsdp passes accelerate's MixedPrecisionPolicy: param_dtype under *-mixed)."""
    ref = reference_bytes(r)
    return r.setup.compute_bytes if r.layout.shards_model_states and r.setup.mixed else ref


def reference_head(r: ResolvedSetup) -> FusedHead:
    """The reference forward's fused head: the copy's (its own dtype), or the policy's with adapters off."""
    if reference_mode(r.setup) == REF_COPY:
        ref = reference_bytes(r)
        return fused_head(r, reference_regime(r.regime, ref), reference_gather_bytes(r), REF_HEAD_OUTPUTS)
    return fused_head(r, r.regime, policy_weight_bytes(r, adapters=False))


def preference_moments(r: ResolvedSetup, act: ActivationProfile, ms, sft_moments) -> list:
    """The step's moments (llmem.estimator.moments) for a preference objective: `sft_moments` (step_moments, passed
    in) of the doubled batch, with the reference copy's weights, and TRL's fused head in place of the loss on full
    logits at the forward's end (the policy's call, or the reference's on top of what the policy's keeps) and at
    the loss backward; the lm_head's autocast copy is the head's own transient there."""
    doubled, act2 = objective_view(r, act)
    plain = replace(doubled.setup, objective="sft", loss_type=None, precompute_ref_log_probs=False,
                    ref_dtype="policy", prompt_len=0, max_length=None)
    sft = ResolvedSetup(plain, doubled.anatomy, doubled.base, doubled.gpu, doubled.layout)
    moments = sft_moments(sft, act2, ms)
    mode = reference_mode(r.setup)
    ref_weights, ref_gathered = reference_copy_bytes(r)
    head = fused_head(doubled, doubled.regime, policy_weight_bytes(doubled))
    p = lm_head_param(doubled)
    copy = head.v * head.h * doubled.regime.mm if doubled.regime.autocast and head.weight_bytes != head.mm else 0
    forward, ref_forward_gathered = head.forward_peak_bytes, 0
    if mode in (REF_COPY, REF_ADAPTERS_OFF):
        ref_forward = head.saved_bytes + reference_head(doubled).forward_peak_bytes
        if ref_forward + 2 * ref_gathered > forward:      # FSDP2: the whole copy gathered, and its all-gather output
            forward, ref_forward_gathered = ref_forward, 2 * ref_gathered
    backward = head.backward_peak_bytes(head.weight_bytes if p.trainable else None)
    out = []
    for i, m in enumerate(moments):
        parts = dict(m.components)
        parts["weights"] = parts.get("weights", 0) + ref_weights
        # FSDP2: the copy gathered at the forward's end (its forward), and kept so under zero2
        gathered = ref_forward_gathered if i == 0 else ref_gathered if not r.method.reshard_after_forward else 0
        if gathered:
            parts["gathered_weights"] = parts.get("gathered_weights", 0) + gathered
        if i < 2:         # 1. the forward's end, 2. the loss backward
            parts["logits_and_loss"] = forward if i == 0 else backward
            parts["gathered_weights"] = max(parts.get("gathered_weights", 0) - copy, 0)
        out.append(type(m)(m.phase, parts))
    return out


def reference_copy_bytes(r: ResolvedSetup) -> tuple[int, int]:
    """The reference copy's weights on this rank (its FSDP2 shard: every parameter padded to the shard degree) and,
    under FSDP2, the whole copy's bytes as gathered for its forward; (0, 0) without a copy."""
    if reference_mode(r.setup) != REF_COPY:
        return 0, 0
    numel = sum(p.numel for p in r.anatomy.params)
    if not r.layout.shards_model_states:
        return numel * reference_bytes(r), 0
    padded = fsdp_unit_numel(list(r.anatomy.params), r.layout)
    return padded // r.layout.shard_degree * reference_bytes(r), padded * reference_gather_bytes(r)


class PreferenceEvents:
    """The DPO step's own events, written into a StepSchedule `s` (which runs the doubled batch), through its
    hooks (llmem.estimator.schedule.hooks)."""

    def __init__(self, s: StepHooks, r: ResolvedSetup) -> None:
        self.s, self.r = s, r
        setup = r.setup
        self.spec = objective_spec(setup.objective)
        self.mode = reference_mode(setup)
        self.kl = kl_sequences(setup)
        self.rows, self.seq = setup.batch_size, setup.seq_len          # dpo: the doubled batch
        self.samples = self.rows // self.spec.sequences_per_sample
        self.n = self.rows * completion_tokens(setup)
        self.head_param = lm_head_param(r)
        self.ref_bytes = reference_bytes(r)
        self.ref_regime = reference_regime(s.facts.regime, self.ref_bytes) if self.mode == REF_COPY else s.facts.regime
        self.batch_keys: list[int] = []
        self.head_keys: list[int] = []        # the final norm's tensors the fused head's backward frees
        self.ref_gathered: list[int] = []     # FSDP2: the reference's unsharded parameters while gathered
        self.ref_ag_out = -1
        self.ref_laid_out = False             # the copy's weights are laid out (DeepSpeed: at its setup)

    def policy_head(self) -> FusedHead:
        return fused_head(self.r, self.s.facts.regime, policy_weight_bytes(self.r))

    # ---------------------------------------------------------------------------------------------- setup
    def reference_weights(self) -> None:
        """The reference copy's parameters (every one, frozen, in ref_bytes), after the policy's."""
        if self.mode != REF_COPY or self.ref_laid_out:
            return
        self.ref_laid_out = True
        alloc = self.s.sch.alloc
        for n in self.s.reference_numels():     # DeepSpeed's engine partitions it its own way
            alloc(n * self.ref_bytes, "weights")

    def batch(self) -> None:
        """The collator's batch on the device, live through the step: three [rows, S] int64 tensors (input ids,
        attention and completion masks; KTO's KL sequences three more) and, precomputed, the reference's log-probs
        (fp32 per sample: chosen and rejected, or KTO's completions and KL sequences); KTO's labels [B] bool."""
        alloc = self.s.sch.alloc
        fields = BATCH_FIELDS * (2 if self.kl else 1)
        self.batch_keys = [alloc(self.rows * self.seq * INT64, "activations") for _ in range(fields)]
        if self.mode == REF_PRECOMPUTED:
            logps = 2 if self.spec.paired or self.kl else 1
            self.batch_keys += [alloc(self.samples * F32, "activations") for _ in range(logps)]
        if not self.spec.paired:
            self.batch_keys.append(alloc(self.samples * BOOL, "activations"))

    def before_forward(self) -> None:
        """KTO's KL term: the policy runs the KL sequences under no_grad before its own forward."""
        if self.kl:
            self.s.sch.mark("policy KL forward")
            self.no_grad_forward(self.s.facts.regime, "cached", self.policy_head(), workspace=True)

    # ---------------------------------------------------------------------------------------------- forward
    def head_forward(self) -> None:
        """_compute_loss up to the loss: the policy's fused head (its saved tensors kept), the reference forward
        and its head (transient), the per-token outputs."""
        sch = self.s.sch
        outputs = self.policy_head_forward(labels=True)
        self.forwards_after_policy()
        sch.mark("loss")
        sch.free_all(outputs)                    # _compute_loss returns: its outputs and labels die
        sch.free(self.labels)

    def policy_head_forward(self, labels: bool) -> list[int]:
        """The policy's fused head after the backbone (its saved tensors kept in self.saved); `labels`: the
        trainer's masked labels (input_ids.masked_fill(...)) made first, kept in self.labels. Returns the keys of
        the head's per-token outputs."""
        s = self.s
        sch, alloc, act = s.sch, s.sch.alloc, s.facts.act
        sch.mark("lm_head and loss")
        head = self.policy_head()
        # the recipe's final norm tensors; its last one, the lm_head's input (kept for a trained lm_head's weight
        # gradient), is not kept: the fused head copies the label tokens instead
        kept = act.head_tensors[:-1] if act.lm_head_kept else act.head_tensors
        self.head_keys = sch.alloc_many(kept, "activations")
        if labels:
            self.labels = alloc(self.rows * self.seq * INT64, "logits_and_loss")
        norm_out = alloc(self.rows * self.seq * s.facts.hidden_size * head.out_bytes, "activations")
        self.saved, outputs = self.fused_forward(head, keep=True)
        sch.free(norm_out)                       # the backbone's output dies when the fused forward returns
        return outputs

    def fused_forward(self, head: FusedHead, keep: bool) -> tuple[list[int], list[int]]:
        """One `model(..., fused_lm_head=True)` after the backbone: the mask, the completion tokens and targets,
        ChunkedLogProbFunction's forward, the per-token outputs scattered back to [rows, S-1]. Returns the keys
        of what the backward keeps (the mask, the completion tokens, targets, log_z, entropy) and of the outputs
        (keep; else all of it is freed: no graph)."""
        sch, alloc, free = self.s.sch, self.s.sch.alloc, self.s.sch.free
        per_token = self.rows * (self.seq - 1)
        n = head.n
        mask = alloc(per_token * BOOL, "logits_and_loss")
        nz = alloc(n * 2 * INT64, "logits_and_loss")                       # nonzero of the [rows, S-1] mask
        hidden = alloc(n * head.h * head.out_bytes, "logits_and_loss")    # hidden_states[mask]
        free(nz)
        nz = alloc(n * 2 * INT64, "logits_and_loss")
        targets = alloc(n * INT64, "logits_and_loss")                      # labels[mask]
        free(nz)
        stats = [alloc(n * F32, "logits_and_loss") for _ in range(7)]
        tile = alloc(head.tile_bytes, "logits_and_loss")
        chunk = -1
        for c in head.token_chunks():
            new = alloc(head.hidden_cast(c), "logits_and_loss")
            free(chunk)
            chunk = new
            for v in head.vocab_chunks():
                free(alloc(head.weight_cast(v), "gathered_weights"))
        tmp = alloc(n * F32, "logits_and_loss")
        log_z = alloc(n * F32, "logits_and_loss")
        free(tmp)
        outs = [alloc(n * F32, "logits_and_loss")]                         # log-probs
        entropy = -1
        if "entropy" in head.outputs:
            tmp = alloc(n * F32, "logits_and_loss")
            entropy = alloc(n * F32, "logits_and_loss")
            free(tmp)
        if "mean_logits" in head.outputs:
            outs.append(alloc(n * F32, "logits_and_loss"))
        if "is_top1" in head.outputs:
            tops = [alloc(n * BOOL, "logits_and_loss") for _ in range(3)]  # two comparisons and their &
            sch.free_all(tops[:2])
            outs.append(tops[2])
        sch.free_all(stats)
        free(chunk)
        free(tile)
        scattered = []
        for name in head.outputs:                                          # new_zeros(...).masked_scatter(...)
            size = BOOL if name == "is_top1" else F32
            zeros = alloc(per_token * size, "logits_and_loss")
            scattered.append(alloc(per_token * size, "logits_and_loss"))
            free(zeros)
        sch.free_all(outs)
        if keep:
            return [mask, hidden, targets, log_z, entropy], scattered
        sch.free_all([mask, hidden, targets, log_z, entropy] + scattered)
        return [], []

    def forwards_after_policy(self) -> None:
        """The reference forward(s) inside _compute_loss (GRPO scores its reference before: none here)."""
        if self.mode in (REF_COPY, REF_ADAPTERS_OFF):
            for _ in range(1 + self.kl):                   # KTO: the KL sequences first, then the completions
                self.reference_forward()

    def reference_forward(self) -> None:
        """The reference's forward under no_grad: the copy (its frozen fp32 weights cast per use under autocast),
        or the policy with its adapters disabled (its frozen base needs no casts)."""
        self.s.sch.mark("reference forward")
        copy = self.mode == REF_COPY
        casts = "per_use" if copy and self.ref_bytes == F32 else "none"
        if copy:
            self.reference_unshard()
        self.no_grad_forward(self.ref_regime, casts, reference_head(self.r), policy=not copy, adapters=False)
        if copy:
            self.reference_post_forward()

    # trl's prepare_fsdp: fully_shard(ref_model) once, the whole copy one FSDP2 unit (the root of its own tree)
    def reference_unshard(self) -> None:
        """FSDP2's all-gather of the whole reference at its root pre-forward: the copy-in of the shards
        MixedPrecisionPolicy casts, the gathered output, then every parameter copied out unsharded (already so
        under zero2 after the first forward: reshard_after_forward False keeps them)."""
        s = self.s
        if not s.facts.fsdp or self.ref_gathered:
            return
        alloc = s.sch.alloc
        per = reference_gather_bytes(self.r)
        numel = sum(s.facts.params.unsharded[p.name] for p in s.facts.params.kept)
        cast = alloc(numel // s.facts.shards * per, "communication_buffers", REF_ALL_GATHER) if per != self.ref_bytes \
            else -1
        self.ref_ag_out = alloc(numel * per, "communication_buffers", REF_ALL_GATHER)
        s.sch.free(cast)
        self.ref_gathered = [alloc(s.facts.params.unsharded[p.name] * per, "gathered_weights")
                             for p in s.facts.params.kept]

    def reference_post_forward(self) -> None:
        """The reference root's post-forward: reshard (reshard_after_forward True, FULL_SHARD; zero2 keeps the
        parameters gathered), then the root frees its all-gather state (FSDPState._post_forward)."""
        s = self.s
        if not s.facts.fsdp:
            return
        if s.facts.reshard:
            s.sch.free_all(self.ref_gathered)
        s.sch.free(self.ref_ag_out)
        self.ref_ag_out = -1

    def no_grad_forward(self, regime: Regime, casts: str, head: FusedHead, workspace: bool = False,
                        policy: bool = True, adapters: bool = True) -> None:
        """A forward under no_grad: embedding, decoder layers (two adjacent blocks' tensors live), the final norm,
        the fused head; nothing survives but the per-sequence log-probs (a few bytes). Autocast's casts of the
        weights: "per_use" (frozen fp32 weights: made and freed at each matmul), "cached" (the policy's trained
        fp32 weights: autocast's cache holds them until the forward returns) or "none". The `policy`'s FSDP2 units
        are gathered as in its own forward (the root kept gathered, each layer resharded after it), its quantised
        linears dequantised (`adapters` False: under peft's disable_adapter())."""
        s = self.s
        sch, alloc, free = s.sch, s.sch.alloc, s.sch.free
        t, h = self.rows * self.seq, s.facts.hidden_size
        rows = t if policy else -1          # the tokens the policy's quantised linears run on (-1: the copy's)
        # the reference's own ZeRO-3 engine gathers its modules (DeepSpeed: llmem.estimator.deepspeed)
        ref_fetch = s.reference_fetch if not policy else (lambda where: None)
        if policy:
            s.unshard_forward(None, s.facts.root)
        ref_fetch("start")
        # the embedding's output: HF's model forward holds it (`inputs_embeds`) until it returns
        stream = embeds = alloc(t * h * regime.res, "activations")
        if workspace:                                 # cuBLAS's, at the step's first matmul
            s.ensure_workspace()
        cached: list[int] = []
        for i in range(s.facts.layers):
            sch.enter_layer(i, "no_grad layer")
            if policy:
                s.unshard_forward(i, s.facts.unit(i))
            ref_fetch(i)
            previous, pending = self.no_grad_blocks(i, s.facts.act.blocks_of(i), regime, casts, cached, rows, adapters)
            self.dequantise(pending, rows, adapters)
            out = alloc(t * h * regime.res, "activations")      # the layer's output, the next one's input
            sch.free_all(previous)
            if stream != embeds:
                free(stream)
            stream = out
            if policy and s.facts.reshard:
                s.reshard_unit(i)
            ref_fetch(("done", i))
        sch.own(None)
        if policy:
            s.release_forward_gathers()
        ref_fetch("head")
        norm_out = alloc(t * h * head.out_bytes, "activations")
        sch.free_all([stream] if stream == embeds else [stream, embeds])
        self.fused_forward(head, keep=False)
        ref_fetch("end")
        free(norm_out)
        sch.free_all(cached)                                    # autocast's exit clears its cache

    def no_grad_blocks(self, i: int, blocks, regime: Regime, casts: str, cached: list[int], tokens: int,
                       adapters: bool, before=None) -> tuple[list[int], tuple | None]:
        """Layer `i`'s blocks under no_grad: autocast's casts of their weights (`casts`, "cached" ones appended to
        `cached`), each block's tensors (two adjacent blocks' live), and a quantised base's dequantisation of a
        block's linears while the next block's tensors are made, as in the training forward
        (llmem.estimator.schedule.layers.forward_blocks); `before(block)` runs before a block's tensors are made.
        Returns the last block's tensors and its linears, still to run (`dequantise`)."""
        sch, alloc = self.s.sch, self.s.sch.alloc
        previous: list[int] = []
        pending = None
        for b, params in zip(blocks, self.s.facts.params.layer_blocks[i], strict=True):
            if before is not None:
                before(b)
            for p in self.cast_weights(regime, casts, params):
                key = alloc(self.s.facts.params.tp_local[p.name] * regime.mm, "gathered_weights")
                if casts == "cached":
                    cached.append(key)
                else:
                    sch.free(key)
            current = sch.alloc_many(b.tensors, "activations")
            self.dequantise(pending, tokens, adapters)
            sch.free_all(previous)
            previous, pending = current, (params, b)
        return previous, pending

    def dequantise(self, pending: tuple | None, tokens: int, adapters: bool) -> None:
        """A quantised base's linears of one block (`pending`: its params and block) under no_grad over `tokens` rows
        x tokens (bitsandbytes' MatMul4Bit path: generate's rows >= 2; -1: not the policy's linears, nothing);
        `adapters` False: peft's disable_adapter() (TRL's reference of a LoRA policy), the base layer alone."""
        if pending is not None and tokens > 0:
            self.s.blocks.dequantise(pending[0], False, pending[1], tokens, adapters)

    def cast_weights(self, regime: Regime, casts: str, params) -> list:
        """The weights a no-grad forward's matmuls cast to the compute dtype."""
        if casts == "none" or not regime.autocast:
            return []
        matmul = [p for p in params if p.module_kind in MATMUL_KINDS and not p.name.endswith("bias")]
        if casts == "per_use":
            return matmul
        pb = self.s.facts.params.element_bytes
        return [p for p in matmul if p.trainable and pb[p.name] == F32]      # autocast caches these

    # ---------------------------------------------------------------------------------------------- backward
    def head_backward(self, it: int) -> None:
        """The fused head's backward, the scatter of its gradient back to [rows, S, H], then the head parameters'
        gradients (the lm_head's is the fp32 accumulator, or its cast to a 16-bit weight)."""
        s = self.s
        sch, alloc, free = s.sch, s.sch.alloc, s.sch.free
        head = self.policy_head()
        p = self.head_param
        mask, hidden, targets, log_z, entropy = self.saved
        grad_logps = alloc(self.n * F32, "logits_and_loss")                  # masked_select of the grad
        grad_hidden = alloc(self.n * head.h * F32, "logits_and_loss")
        grad_weight = alloc(head.v * head.h * F32, "gradients") if p.trainable else -1
        tile = alloc(head.tile_bytes, "logits_and_loss")
        chunk = w = -1
        for c in head.token_chunks():
            new = alloc(head.hidden_cast(c), "logits_and_loss")
            free(chunk)
            chunk = new
            for v in head.vocab_chunks():
                new_w = alloc(head.weight_cast(v), "gathered_weights")
                free(w)
                w = new_w
        # the return casts the accumulators to the inputs' dtypes while the function's locals still live; they are
        # released in order: the accumulators (when cast), the token chunk, the weight chunk, the tile buffer
        hidden_out = grad_hidden
        if head.out_bytes != F32:             # grad_hidden.to(hidden.dtype)
            hidden_out = alloc(self.n * head.h * head.out_bytes, "logits_and_loss")
        weight_out = grad_weight
        if grad_weight >= 0 and head.weight_bytes != F32:     # grad_weight.to(weight.dtype)
            weight_out = alloc(head.v * head.h * head.weight_bytes, "gradients")
        for old, new in ((grad_hidden, hidden_out), (grad_weight, weight_out)):
            if new != old:
                free(old)
        sch.free_all([chunk, w, tile])
        grad_hidden, grad_weight = hidden_out, weight_out
        sch.free_all([hidden, targets, log_z, entropy, grad_logps])
        # IndexBackward: index_put(zeros, [mask], grad) out of place; SliceBackward: [rows, S, H]
        zeros = alloc(self.rows * (self.seq - 1) * head.h * head.out_bytes, "activations")
        nz = alloc(self.n * 2 * INT64, "activations")
        put = alloc(self.rows * (self.seq - 1) * head.h * head.out_bytes, "activations")
        free(nz)
        free(zeros)
        free(grad_hidden)
        stream_grad = alloc(self.rows * self.seq * head.h * head.out_bytes, "activations")
        free(put)
        free(mask)
        # as StepSchedule.head_backward's fused branch: AccumulateGrad takes the accumulator as the lm_head's gradient
        for q in s.head_backward_params():
            if grad_weight >= 0 and (is_lm_head(q) or q is p):   # p: a head of another name (BioGPT's)
                s.hand_over_grad(q, grad_weight)     # DeepSpeed's reduce hook takes it at once
                grad_weight = -1
            else:
                s.make_grad(q, root_unit=True)
        left = s.blocks.final_norm_backward(stream_grad)
        sch.free_all(self.head_keys)
        s.flush_steps(it)
        sch.free_all(left)

