"""trl-sft on the estimator floor: sft's step with the loss through TRL's fused LM head, as SFTTrainer runs it.

The step is sft's (its layers, its options); only the head and the batch are SFTTrainer's (trl/trainer/sft_trainer.py,
the installed trl 1.16):
- the batch DataCollatorForLanguageModeling returns, on the device through the step: input_ids, labels (a tensor of
  its own: the dataset's labels, -100 on the prompt under completion_only_loss) and attention_mask, [B, S] int64
  each; padding_free (--packing) has position_ids in place of the attention mask (the packed step's own);
- compute_loss: `model(**inputs, fused_lm_head=True)` (its __init__'s `add_fused_lm_head(model, outputs=("log_probs",
  "entropy", "is_top1"))`): the backbone, then TRL's fused head over the N label tokens (labels[:, 1:] != -100),
  as llmem.estimator.objectives lays it out for DPO's policy (the mask, the tokens' hidden states and targets
  kept, ChunkedLogProbFunction's tiles, the three outputs scattered back to [B, S-1]); the loss
  `-log_probs.sum() / num_tokens` (dft: times `log_probs.exp().detach()`); the outputs die when compute_loss
  returns;
- backward: the fused head's (PreferenceEvents.head_backward), the lm_head's gradient handed to AccumulateGrad.

Known Limitations: as the preference step's, the loss's per-token [B, S-1] fp32 tensors (-log_probs, dft's
probability, their gradients: a few KiB) are left out.
"""

from __future__ import annotations

from llmem.estimator.objectives import INT64, PreferenceEvents


class FusedSftEvents(PreferenceEvents):
    """trl-sft's own events in a StepSchedule: SFTTrainer's batch and its fused head (no reference: the preference
    events' reference steps do nothing)."""

    def batch(self) -> None:
        """The collator's labels and attention mask (padding_free: the position ids, already the packed step's),
        [B, S] int64, live through the step (the input ids are the step's own)."""
        alloc = self.s.sch.alloc
        fields = 1 if self.s.facts.setup.packing else 2
        self.batch_keys = [alloc(self.rows * self.seq * INT64, "activations") for _ in range(fields)]

    def head_forward(self) -> None:
        """compute_loss: the fused head after the backbone (its saved tensors kept), the loss from its outputs, which
        die when compute_loss returns."""
        sch = self.s.sch
        outputs = self.policy_head_forward(labels=False)     # (the collator's labels: the batch's own)
        sch.mark("loss")
        sch.free_all(outputs)                    # compute_loss returns: the head's outputs die
