"""Pairwise objectives on the estimator floor: ORPO's, SimPO's and reward's events in the step's schedule.

TRL's pairwise objectives without a reference in the step's schedule: --objective orpo / simpo (the loss on the
model's full logits) and reward (a scalar head), as llmem.runtime.pairwise traces them. StepSchedule runs the
doubled batch (chosen then rejected rows, R = 2B sequences); these events replace the preference events' batch,
head forward and head backward.

ORPO / CPO (trl/experimental/orpo/orpo_trainer.py, cpo/cpo_trainer.py `concatenated_forward`):
- the collator's batch: chosen_ and rejected_ input_ids, attention_mask, labels [B, S] int64 (prompt_ ones [B, P]);
  `concatenated_inputs` cats them into three [R, S] int64 tensors at each forward;
- the lm_head's logits [R, S, V] in the compute dtype, cast to fp32 under mixed precision (accelerate's
  convert_outputs_to_fp32), the low-precision ones dying at once (nothing saves a matmul's output);
- the chosen rows' NLL: `logits[:B, :-1].contiguous()` (a copy [B, S-1, V]), nn.CrossEntropyLoss's log_softmax
  [B (S-1), V] (saved), the copy freed when it returns;
- every row's log-probs: selective_log_softmax's Triton kernel (trl/kernels/logprob_entropy.py) saves the logits
  and makes four fp32 [R, S-1] vectors.
Backward (autograd runs the later node first): the kernel's gradient `empty_like` [R, S-1, V], its saved logits
released (their last reference), SliceBackward's zeros [R, S, V]; the NLL's gradient [B (S-1), V], log_softmax's
[B (S-1), V] (its saved output freed), SliceBackward to [B, S, V], to [R, S, V]; the two gradients of the logits
summed out of place (a new [R, S, V]); under mixed precision ToCopyBackward's cast to the compute dtype; then the
head parameters' gradients as in the causal-LM step.

Reward (trl/trainer/reward_trainer.py, transformers' GenericForSequenceClassification): the score Linear [1, H]
on the final norm's output ([R, S, 1] scores, pooled at the last non-pad token), the pairwise loss on [R] scalars:
the head's tensors are the final norm's and the score's input; no vocabulary-sized tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmem.estimator.objectives import BATCH_FIELDS, INT64, PreferenceEvents
from llmem.model.sharding import MATMUL_KINDS, is_lm_head
from llmem.setup.objectives import REF_NONE, objective_spec
from llmem.setup.precision import F32

if TYPE_CHECKING:
    from llmem.estimator.schedule.hooks import StepHooks

CONCATENATED = 3          # concatenated_inputs: input_ids, attention_mask, labels [R, S] int64
KERNEL_OUTPUTS = 4        # logprob_entropy's forward: logprobs, entropy, log_z, expected_logit (fp32 per token)


def logits_bytes(setup, regime, fsdp: bool) -> int:
    """Bytes per element of the logits the loss sees: fp32 under *-mixed (accelerate's convert_outputs_to_fp32
    wraps the forward under autocast and under FSDP2's MixedPrecisionPolicy alike), else the compute dtype."""
    return F32 if regime.autocast or (fsdp and setup.mixed) else regime.mm


class PairwiseEvents(PreferenceEvents):
    """ORPO / SimPO / reward in the StepSchedule `s` (the doubled batch)."""

    def __init__(self, s: StepHooks, r) -> None:  # PreferenceEvents' facts, less the lm_head (the reward model has none)
        self.s, self.r = s, r
        self.spec = objective_spec(r.setup.objective)
        self.mode, self.kl = REF_NONE, False
        self.rows, self.seq = r.setup.batch_size, r.setup.seq_len
        self.batch_keys: list[int] = []
        self.pairs = self.rows // 2
        self.scalar = objective_spec(r.setup.objective).scalar_head
        self.concat: list[int] = []
        self.head_keys: list[int] = []        # the final norm's (and the score's input) tensors
        self.head_copy: list[int] = []        # autocast's copies of the head's matmul weights
        # ORPO / CPO compute the loss on the model's output logits: FSDP2's root pre-backward hook (on that output)
        # fires once the loss's backward has made their gradient, not at the backward's start
        self.loss_outside_model = not self.scalar

    @property
    def logits_bytes(self) -> int:
        """Bytes per element of the logits the loss sees: fp32 under mixed precision (accelerate casts the
        outputs), else the compute dtype."""
        return logits_bytes(self.r.setup, self.s.facts.regime, self.s.facts.fsdp)

    # ---------------------------------------------------------------------------------------------- setup
    def batch(self) -> None:
        """The collator's batch, live through the step: ORPO / CPO six [B, S] int64 tensors (and the prompt's two
        [B, P]), reward two [R, S] int64 (input ids, attention mask)."""
        alloc, b, seq = self.s.sch.alloc, self.pairs, self.seq
        if self.scalar:
            self.batch_keys = [alloc(self.rows * seq * INT64, "activations") for _ in range(2)]
            return
        prompt = self.setup_prompt
        self.batch_keys = [alloc(b * prompt * INT64, "activations") for _ in range(2)] if prompt else []
        self.batch_keys += [alloc(b * seq * INT64, "activations") for _ in range(2 * BATCH_FIELDS)]

    @property
    def setup_prompt(self) -> int:
        return self.r.setup.prompt_len

    def before_forward(self) -> None:
        """ORPO / CPO's concatenated_inputs: chosen and rejected rows catted into three [R, S] int64 tensors."""
        if not self.scalar:
            self.concat = [self.s.sch.alloc(self.rows * self.seq * INT64, "activations") for _ in range(CONCATENATED)]

    # ---------------------------------------------------------------------------------------------- forward
    def head_start(self) -> None:
        """The final norm's tensors (the recipe's head), autocast's copies of the head's matmul weights."""
        s = self.s
        sch, alloc, act, regime = s.sch, s.sch.alloc, s.facts.act, s.facts.regime
        sch.mark("lm_head and loss")
        # the reward model: the norm's output in the stream's dtype lives until autocast has cast it (and the
        # score's weight) for the score (the causal-LM recipe's head leaves it out: the logits dwarf it)
        norm_out = -1
        if self.scalar and regime.autocast and regime.res != regime.mm:
            self.head_keys = sch.alloc_many(act.head_tensors[:-1], "activations")
            norm_out = alloc(s.facts.t * s.facts.hidden_size * regime.res, "activations")
        else:
            self.head_keys = sch.alloc_many(act.head_tensors, "activations")
        f = s.facts
        self.head_copy = [alloc(f.params.tp_local[p.name] * regime.mm, "gathered_weights") for p in f.root
                          if (p.module_kind in MATMUL_KINDS or is_lm_head(p)) and f.casts(p)] if regime.autocast else []
        if norm_out >= 0:
            self.head_keys.append(alloc(act.head_tensors[-1], "activations"))
            sch.free(norm_out)

    def head_forward(self) -> None:
        self.head_start()
        if self.scalar:
            self.s.sch.mark("loss")
            return
        s = self.s
        sch, alloc, free = s.sch, s.sch.alloc, s.sch.free
        b, seq, v, ld = self.pairs, self.seq, s.facts.vocab_size, self.logits_bytes
        tv = self.rows * seq * v
        logits = alloc(tv * s.facts.regime.mm, "logits_and_loss")
        if ld != s.facts.regime.mm:                                  # convert_outputs_to_fp32
            converted = alloc(tv * ld, "logits_and_loss")
            free(logits)
            logits = converted
        self.logits = logits
        # cross_entropy_loss on the chosen rows: the shifted labels (saved by nll_loss), the contiguous copy of the
        # shifted logits, log_softmax's output (saved)
        self.targets = alloc(b * (seq - 1) * INT64, "logits_and_loss")
        copy = alloc(b * (seq - 1) * v * ld, "logits_and_loss")
        self.log_softmax = alloc(b * (seq - 1) * v * ld, "logits_and_loss")
        free(copy)
        # get_batch_logps: the shifted labels' clone (the kernel's saved index), its mask (saved by the product),
        # the kernel's four fp32 vectors (log_z and expected_logit saved, entropy dropped)
        per_token = self.rows * (seq - 1)
        self.index = alloc(per_token * INT64, "logits_and_loss")
        self.loss_mask = alloc(per_token, "logits_and_loss")
        outs = [alloc(per_token * F32, "logits_and_loss") for _ in range(KERNEL_OUTPUTS)]
        self.kernel_saved = outs[2:]
        sch.mark("loss")
        sch.free_all(outs[:2])                 # the log-probs and entropy die with the loss's locals
        sch.free_all(self.concat[1:])          # the concatenated attention mask and labels
        self.concat = self.concat[:1]

    # ---------------------------------------------------------------------------------------------- backward
    def head_backward(self, it: int) -> None:
        s = self.s
        sch, alloc, free = s.sch, s.sch.alloc, s.sch.free
        b, seq, v = self.pairs, self.seq, s.facts.vocab_size
        if self.scalar:
            grad = -1
        else:
            ld, rows = self.logits_bytes, self.rows
            kernel = alloc(rows * (seq - 1) * v * ld, "logits_and_loss")   # the kernel's grad_logits
            sch.free_all([self.logits, self.index] + self.kernel_saved)     # its saved tensors released
            sliced = alloc(rows * seq * v * ld, "logits_and_loss")         # SliceBackward [:, :-1]
            free(kernel)
            nll = alloc(b * (seq - 1) * v * ld, "logits_and_loss")
            ls = alloc(b * (seq - 1) * v * ld, "logits_and_loss")
            free(nll)
            free(self.log_softmax)
            free(self.targets)
            chosen = alloc(b * seq * v * ld, "logits_and_loss")            # SliceBackward [..., :-1, :]
            free(ls)
            full = alloc(rows * seq * v * ld, "logits_and_loss")           # SliceBackward [:B]
            free(chosen)
            grad = alloc(rows * seq * v * ld, "logits_and_loss")           # the two gradients summed
            free(sliced)
            free(full)
            free(self.loss_mask)
            s.prefetch(s.facts.layers - 1, s.facts.unit(s.facts.layers - 1))    # the root's pre-backward hook
            if ld != s.facts.regime.mm:                                          # ToCopyBackward
                cast = alloc(rows * seq * v * s.facts.regime.mm, "logits_and_loss")
                free(grad)
                grad = cast
        if self.scalar:
            self.score_backward(it)
        else:
            self.head_grads(grad, it)
        sch.free_all(self.concat)
        self.concat = []

    def score_backward(self, it: int) -> None:
        """The score head's backward, then the final RMSNorm's on the fp32 residual stream, as the trace runs them
        (bf16-mixed; LlamaRMSNorm's autograd graph): the score input's gradient [T, H] in the compute dtype, cast to
        the stream's dtype, the norm's temporaries (at most four [T, H] live at once), its output gradient handed
        to the last decoder layer (which the layer's own transients account for, as in the causal-LM step)."""
        s = self.s
        sch, alloc, free = s.sch, s.sch.alloc, s.sch.free
        x = s.facts.t * s.facts.hidden_size * s.facts.regime.res
        head = s.head_backward_params()
        grad_in = alloc(s.facts.t * s.facts.hidden_size * s.facts.regime.mm, "activations")
        for p in reversed(head):            # the score's weight first, then the final norm's
            s.make_grad(p, root_unit=True)
        sch.free_all(self.head_copy)
        sch.free(self.head_keys.pop())         # the score's saved input
        stream = alloc(x, "activations") if s.facts.regime.mm != s.facts.regime.res else grad_in
        if stream != grad_in:
            free(grad_in)
        a, b = alloc(x, "activations"), alloc(x, "activations")
        free(b)
        free(stream)
        sch.free(self.head_keys.pop())         # the norm's saved normalised input (hidden * rsqrt)
        c, d = alloc(x, "activations"), alloc(x, "activations")
        free(c)
        free(a)
        e, f, g, h = (alloc(x, "activations") for _ in range(4))
        sch.free_all([g, f, e])
        sch.free(self.head_keys.pop(0))        # the norm's input: the last layer's output
        out = alloc(x, "activations")
        free(d)
        free(h)
        sch.free_all(self.head_keys)
        s.flush_steps(it)
        free(out)

    def head_grads(self, grad: int, it: int) -> None:
        """The head's matmul backward (as the causal-LM step's): its input's gradient, the head parameters', then
        the final norm's backward (StepHooks.blocks.final_norm_backward)."""
        s = self.s
        sch, alloc = s.sch, s.sch.alloc
        head = s.head_backward_params()
        grad_in = alloc(s.facts.t * s.facts.hidden_size * s.facts.regime.mm, "activations")
        for p in head:
            s.make_grad(p, root_unit=True)
        sch.free(grad)
        sch.free_all(self.head_copy)
        sch.free_all(self.head_keys)
        s.flush_steps(it)
        sch.free_all(s.blocks.final_norm_backward(grad_in))


def pairwise_moments(r, act, ms, sft_moments) -> list:
    """The step's moments (llmem.estimator.moments): `sft_moments` of the doubled batch with the loss's tensors at
    the forward's end and the loss backward as PairwiseEvents lays them out (none for the reward model's scalar)."""
    from dataclasses import replace

    from llmem.estimator.objectives import objective_view
    from llmem.model.resolved import ResolvedSetup

    doubled, act2 = objective_view(r, act)
    plain = replace(doubled.setup, objective="sft", loss_type=None, prompt_len=0, max_length=None)
    moments = sft_moments(ResolvedSetup(plain, doubled.anatomy, doubled.base, doubled.gpu, doubled.layout), act2, ms)
    setup, regime = doubled.setup, doubled.regime
    spec = objective_spec(r.setup.objective)
    seq, v = setup.seq_len, doubled.anatomy.vocab_size
    tv = setup.batch_size * seq * v
    ld = logits_bytes(setup, regime, doubled.layout.shards_model_states)
    half = setup.batch_size // 2 * (seq - 1) * v * ld
    forward = 0 if spec.scalar_head else max(tv * (regime.mm + ld) if ld != regime.mm else 0, tv * ld + 2 * half)
    backward = 0 if spec.scalar_head else max(3 * tv * ld, tv * (ld + regime.mm) if ld != regime.mm else 0)
    out = []
    for i, m in enumerate(moments):
        parts = dict(m.components)
        if i < 2:         # 1. the forward's end, 2. the loss backward
            parts["logits_and_loss"] = forward if i == 0 else backward
        out.append(type(m)(m.phase, parts))
    return out
