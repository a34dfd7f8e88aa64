"""--objective trl-sft: TRL's SFTTrainer step (sft's step, the loss through TRL's fused LM head), its head worked by
hand for tiny-llama (hidden 512, vocab 32000) as TRL's ChunkedLogProbFunction allocates it, checked against the
estimator's schedule and the trace of SFTTrainer.compute_loss; the registry row against the installed trl; the
refusals."""

from __future__ import annotations

import inspect
import re

import pytest
from schedules import built_schedule as schedule

from llmem.cli import main
from llmem.errors import LlmemError
from llmem.estimator.objectives import fused_head
from llmem.model.resolved import resolve
from llmem.setup.objectives import OBJECTIVES, SFT_HEAD_OUTPUTS, SFT_LOSS_TYPES
from llmem.setup.training import TrainingSetup

H, V = 512, 32000                 # tiny-llama's hidden size and vocabulary
B, S = 2, 256
N = B * (S - 1)                   # label tokens: every one but each row's first (labels[:, 1:])


def sft(**kw) -> TrainingSetup:
    return TrainingSetup(**{"model": "tiny-llama", "gpu": "H100-80GB", "objective": "trl-sft", "batch_size": B,
                            "seq_len": S, "precision": "bf16-mixed", "optimizer": "sgd", **kw})


def allocations(setup: TrainingSetup, start: str, end: str) -> list[int]:
    """Sizes the schedule allocates from its first mark `start` to the next mark `end`."""
    s = schedule(setup)
    a = next(i for i, w in s.sch.marks if w == start)
    b = next(i for i, w in s.sch.marks if w == end and i > a)
    return [size for sign, _k, size, _st, _c in s.sch.events[a:b] if sign > 0]


def test_fused_head_forward_bytes_by_hand():
    """bf16-mixed, full fine-tuning (fp32 residual stream and lm_head, bf16 autocast). ChunkedLogProbFunction over
    the 510 label tokens: one [min(510, 4096), 32768] bf16 tile buffer (mm_buf: 32768 columns whatever the
    vocabulary), the token chunk cast to bf16 [510, 512], the fp32 lm_head's chunk cast to bf16 [32000, 512] (one
    vocabulary chunk), seven fp32 statistics per token; kept for backward: the [2, 255] bool mask, the tokens'
    fp32 hidden states [510, 512], their int64 targets, fp32 log_z and entropy; the final norm's fp32 output
    [2, 256, 512] live around it."""
    head = fused_head(resolve(sft()), resolve(sft()).regime, 4)
    assert (head.n, head.vocab_chunks(), head.token_chunks()) == (510, [32000], [510])
    norm_out = 2 * 256 * 512 * 4                      # 1,048,576
    saved = 2 * 255 * 1 + 510 * (512 * 4 + 8 + 2 * 4)  # 1,053,150
    stats = 7 * 510 * 4                                # 14,280
    tile = 510 * 32768 * 2                             # 33,423,360
    token_cast, weight_cast = 510 * 512 * 2, 32000 * 512 * 2     # 522,240 and 32,768,000
    assert head.forward_peak_bytes == norm_out + saved + stats + tile + token_cast + weight_cast == 68_829_606
    sizes = allocations(sft(), "lm_head and loss", "loss")
    for n in (510 * 512 * 4, tile, token_cast, weight_cast, 510 * 8, 2 * 255):
        assert n in sizes
    # the outputs SFTTrainer asks for, scattered back to [2, 255]: log_probs and entropy fp32, is_top1 bool
    assert sizes.count(2 * 255 * 4) >= 2 * 2 and 2 * 255 in sizes


def test_no_full_logits_where_sft_has_them():
    """transformers' loss (--objective sft) makes the [2 x 384, 32000] logits in bf16 and their fp32 upcast;
    SFTTrainer's head makes neither."""
    full_bf16, full_fp32 = 2 * 384 * V * 2, 2 * 384 * V * 4
    plain = allocations(sft(objective="sft", seq_len=384), "lm_head and loss", "layer 3")
    assert full_bf16 in plain and full_fp32 in plain
    fused = allocations(sft(seq_len=384), "lm_head and loss", "loss")
    assert full_bf16 not in fused and full_fp32 not in fused and 766 * 32768 * 2 in fused


def test_large_vocabulary_tiles_and_a_prompt():
    """Qwen2.5-0.5B (vocabulary 151936): five vocabulary chunks of 32768 columns, the last 20864; --prompt-len 64
    (completion_only_loss: labels -100 on the prompt) leaves 2 x 192 label tokens; 4096 + 100 tokens are two token
    chunks."""
    r = resolve(sft(model="Qwen/Qwen2.5-0.5B", prompt_len=64))
    head = fused_head(r, r.regime, 4)
    assert head.vocab_chunks() == [32768] * 4 + [151936 - 4 * 32768] and head.n == 2 * 192
    r = resolve(sft(batch_size=2, seq_len=2051))
    assert fused_head(r, r.regime, 4).token_chunks() == [4096, 4]


def test_the_batch_is_the_collators():
    """DataCollatorForLanguageModeling: labels and the attention mask beside the input ids, [2, 256] int64 each;
    padding_free (--packing): the labels alone (the position ids are the packed step's own)."""
    def setup_bytes(setup):
        s = schedule(setup)
        end = next(i for i, p in s.sch.phase_starts if p == "it0:forward")
        return sum(sign * n for sign, _k, n, _st, _c in s.sch.events[:end])

    assert setup_bytes(sft()) - setup_bytes(sft(objective="sft")) == 2 * B * S * 8
    assert setup_bytes(sft(packing=True)) - setup_bytes(sft(objective="sft", packing=True)) == B * S * 8


def test_trace_runs_sft_trainers_head():
    """The trace of SFTTrainer.compute_loss allocates the head's tile and casts (sizes as worked above) and never
    the [tokens, vocab] logits; the estimate is within 1 % of it on both counters."""
    pytest.importorskip("trl")
    from llmem import estimate
    from llmem.runtime.trace import trace_with_details

    setup = sft(seq_len=384)          # 2 x 383 = 766 label tokens (2 x 384 x 32000 x 2 is no weight cast's size)
    truth, details = trace_with_details(setup)
    sizes = {size for is_alloc, _k, size, *_ in details.ledger.events if is_alloc}
    assert {766 * 32768 * 2, 766 * 512 * 2, 32000 * 512 * 2} <= sizes
    assert not {2 * 384 * V * 2, 2 * 384 * V * 4, 766 * V * 4} & sizes
    got = estimate(setup)
    assert abs(got.peak_allocated_bytes / truth.peak_allocated_bytes - 1) < 0.01
    assert abs(got.peak_reserved_bytes / truth.peak_reserved_bytes - 1) < 0.02


def test_registry_row_is_the_installed_trls():
    """SFTConfig's loss_type choices and default; the outputs SFTTrainer's __init__ asks its fused head for."""
    pytest.importorskip("trl")
    from dataclasses import fields

    from trl import SFTTrainer
    from trl.trainer.sft_config import SFTConfig

    loss_type = next(f for f in fields(SFTConfig) if f.name == "loss_type")
    spec = OBJECTIVES["trl-sft"]
    assert loss_type.default == spec.default_loss_type == "nll"
    assert tuple(re.findall(r"`'(\w+)'`", loss_type.metadata["help"])) == SFT_LOSS_TYPES
    source = inspect.getsource(SFTTrainer.__init__)
    outputs = re.search(r"add_fused_lm_head\(.*?outputs=\(([^)]*)\)", source, re.S).group(1)
    assert tuple(re.findall(r'"(\w+)"', outputs)) == SFT_HEAD_OUTPUTS == spec.head_outputs
    assert spec.trainer == SFTTrainer.__name__ and spec.step_kind == "fused-sft"


@pytest.mark.parametrize(("fields", "message"), [
    ({"loss_type": "sigmoid"}, "unknown --loss-type 'sigmoid' for --objective trl-sft"),
    ({"fused_ce": True}, "--fused-ce with --objective trl-sft"),
    ({"offload_activations": True}, "activation_offloading"),
    ({"optimizer_in_backward": True}, "--optimizer-in-backward"),
    ({"precompute_ref_log_probs": True}, "no reference model"),
    ({"ref_dtype": "compute"}, "no reference model"),
    ({"prompt_len": 256}, "--prompt-len"),
    ({"max_length": 128}, "max_length 128"),
    ({"method": "tp", "gpus": 2}, "modelled under --method"),
    ({"logits_dtype": "model"}, "--logits-dtype model"),
])
def test_refusals(fields, message):
    with pytest.raises(LlmemError, match=re.escape(message)):
        resolve(sft(**fields))


def test_refusal_is_one_line_exit_2(capsys):
    assert main(["estimate", "tiny-llama", "--objective", "trl-sft", "--fused-ce"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "SFTTrainer" in err


def test_from_reads_a_trl_sft_config_as_trl_sft(tmp_path):
    """`trl sft --config`: SFTConfig's keys select SFTTrainer's head (and say so); loss_type dft is read, not
    ignored; use_liger_kernel keeps Liger's layer kernels without its fused cross-entropy; completion_only_loss
    leaves the answer approximate until --prompt-len. The file's estimate is the flags' own."""
    from llmem import estimate
    from llmem.setup.sources import setup_from_file

    path = tmp_path / "sft.yaml"
    path.write_text("model_name_or_path: tiny-llama\nper_device_train_batch_size: 2\nmax_length: 256\n"
                    "loss_type: dft\ncompletion_only_loss: true\nuse_liger_kernel: true\ngradient_checkpointing: false\n"
                    "output_dir: out\n")
    fs = setup_from_file(path)
    s = fs.setup
    assert (s.objective, s.loss_type, s.seq_len, s.batch_size, s.liger, s.fused_ce) == \
        ("trl-sft", "dft", 256, 2, "auto", False)
    (trainer,) = [u for u in fs.record.used if u.key == "(trainer)"]
    assert "only SFTConfig has these keys (trl sft)" in trainer.note and "fused LM head" in trainer.note
    (completion,) = [i for i in fs.record.ignored if i.key == "completion_only_loss"]
    assert completion.settled_by == "prompt_len" and completion.approximates
    flags = TrainingSetup(model="tiny-llama", objective="trl-sft", loss_type="dft", batch_size=2, seq_len=256,
                          precision="bf16-mixed", liger="auto", optimizer="adamw-fused")
    a, b = estimate(s), estimate(flags)
    assert (a.peak_allocated_bytes, a.peak_reserved_bytes) == (b.peak_allocated_bytes, b.peak_reserved_bytes)
    # a TrainingArguments mapping without TRL's keys is transformers' Trainer: --objective sft, its full logits
    (tmp_path / "args.yaml").write_text("per_device_train_batch_size: 2\noutput_dir: out\n")
    assert setup_from_file(tmp_path / "args.yaml", model="tiny-llama").setup.objective == "sft"


def test_trl_casts_a_bitsandbytes_models_adapters_note():
    """TRL 1.16's SFTTrainer casts a bitsandbytes-quantised model's trainable parameters to bf16
    (sft_trainer.py: `if _is_quantized_model: param.data = param.data.to(torch.bfloat16)`); the answer says that
    the estimate and the trace hold them in bf16, and says nothing where no bitsandbytes base is quantised."""
    from llmem.setup.objectives import objective_notes

    base = dict(model="tiny-llama", objective="trl-sft", precision="bf16-mixed", lora_rank=16, batch_size=2,
                seq_len=256)

    def said(**kw) -> bool:
        return any("casts a bitsandbytes-quantised model's trained parameters to bf16" in n
                   for n in objective_notes(TrainingSetup(**base | kw)))

    assert said(quant_base="nf4") and said(quant_base="int8", precision="fp32")
    assert said(quant_base="nf4", objective="dpo", seq_len=128) and said(quant_base="int8", objective="kto")
    assert not said() and not said(quant_base="torchao-nf4", precision="bf16", adapter_dtype="base")
