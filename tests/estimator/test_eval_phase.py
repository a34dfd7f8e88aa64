"""The job's evaluation phase (llmem.estimator.eval_phase) on tiny-llama, against bytes worked out by hand from its
config (llmem/model/catalog/tiny/tiny-llama.json: hidden 512, intermediate 1376, 4 layers, vocab 32000, untied
embeddings), bf16-mixed full fine-tuning with AdamW: fp32 weights (4 P), two fp32 states (8 P) and cuBLAS's
workspace stay on the GPU through the eval, gradients freed by zero_grad."""

from __future__ import annotations

import json
from math import ceil

import pytest
from eval_bytes import loss_only_eval_bytes

from llmem import estimate
from llmem.cli import main
from llmem.errors import LlmemError
from llmem.setup.gpus import resolve_gpu
from llmem.setup.training import TrainingSetup
from llmem.units import format_bytes

H, FFN, LAYERS, V = 512, 1376, 4, 32000
EMBED = V * H
LAYER = 4 * H * H + 3 * H * FFN + 2 * H
P = 2 * EMBED + LAYERS * LAYER + H                 # 45,421,056
WORKSPACE = resolve_gpu("A100-80GB", None, None).cublas_workspace_bytes   # cuBLAS's, kept from the step's first matmul
RESIDENT = 4 * P + 8 * P + WORKSPACE               # fp32 weights, AdamW's exp_avg and exp_avg_sq, the workspace
SEQ = 256


def kept_step(batch: int, world: int = 1, per_token: int = V * 4) -> int:
    """One eval step's kept tensors on each GPU: fp32 logits (accelerate's convert_outputs_to_fp32) or token ids,
    int64 labels and the loss repeated per sample (fp32), from every rank."""
    t = batch * SEQ
    return world * (t * per_token + t * 8 + batch * 4)


def run(**kw):
    setup = dict(model="tiny-llama", seq_len=SEQ, eval_batch_size=8) | kw
    return estimate(TrainingSetup(**setup))


def phase(result, name="eval") -> dict:
    return next(p.to_dict() for p in result.job_phases if p.name == name)


def test_loss_only_eval_is_the_no_grad_forward_at_its_head():
    """No compute_metrics (HF's default): nothing but the losses kept. The peak is the head of the no-grad forward:
    autocast's cached bf16 casts of every matmul weight (lm_head and the layers' seven), the final norm's fp32
    output, the bf16 logits, their fp32 upcast and fp32 log-softmax; the batch's three int64 tensors beside."""
    result = run()
    t = 8 * SEQ
    casts = 2 * (EMBED + LAYERS * (4 * H * H + 3 * H * FFN))
    head = t * H * 4 + t * V * (2 + 4 + 4)
    got = phase(result)
    assert (got["kind"], got["device_bytes"]) == ("loss", RESIDENT + 3 * t * 8 + casts + head)
    assert got["host_bytes"] == 8 * 4              # one step's 8 fp32 losses (no --eval-samples: one step)
    # HF's default eval batch (8) is 8 times the step's micro-batch (1): its logits alone outweigh the step's
    assert result.peak_allocated_bytes < got["device_bytes"]
    assert result.to_dict()["job_peak"] == {"phase": "eval", "device_bytes": got["device_bytes"]}


def nf4_bytes(n: int) -> int:
    """bitsandbytes' NF4 storage of an n-element weight, double-quantised: the packed 4-bit weight, one uint8
    absmax per block of 64, their fp32 absmax per 256 blocks, the 256-entry fp32 dynamic code, its fp32 offset and
    the 16-entry fp32 NF4 code."""
    blocks = ceil(n / 64)
    return n // 2 + blocks + ceil(blocks / 256) * 4 + 256 * 4 + 4 + 16 * 4


def test_qlora_eval_beside_the_quantised_base():
    """QLoRA r=8 on q_proj, v_proj: the NF4 linears, the kbit-upcast fp32 embedding, lm_head and norms, fp32
    adapters and AdamW's states stay; at the head autocast's cache holds only the adapters' bf16 casts (the frozen
    fp32 lm_head is cast per use: nothing keeps it under no_grad); the residual stream is fp32 (the upcast
    embedding's output)."""
    result = run(quant_base="nf4", lora_rank=8)
    linears = LAYERS * (4 * nf4_bytes(H * H) + 3 * nf4_bytes(H * FFN))
    upcast = 4 * (2 * EMBED + (2 * LAYERS + 1) * H)
    adapters = LAYERS * 2 * (8 * H + H * 8)
    t = 8 * SEQ
    device = linears + upcast + 4 * adapters + 8 * adapters + WORKSPACE + 3 * t * 8 + 2 * adapters + t * H * 4 \
        + t * V * 10
    assert phase(result)["device_bytes"] == device
    assert [p.name for p in result.job_phases] == ["eval"]          # (a quantised base: no load / save phases)
    assert result.job_notes[0].startswith("eval phase is analytic (the frameworks' evaluation code")


def test_kept_logits_over_the_eval_set():
    """compute_metrics, no eval_accumulation_steps: all 64 samples' logits stay on the GPU; the last of the 8 steps'
    torch.cat holds its output (8 steps) beside its inputs (7 steps and this one): 16 steps' worth."""
    result = run(eval_keeps="logits", eval_samples=64)
    steps = 64 // 8
    device = RESIDENT + 3 * 8 * SEQ * 8 + 2 * steps * kept_step(8)
    per_sample = SEQ * V * 4 + SEQ * 8 + 4          # numpified on the host: every sample once
    assert (phase(result)["device_bytes"], phase(result)["host_bytes"]) == (device, 64 * per_sample)
    assert result.peak_allocated_bytes < device
    assert result.to_dict()["job_peak"] == {"phase": "eval", "device_bytes": device}
    assert any(n.startswith("eval (logits) peaks above the step") for n in result.job_notes)


def test_accumulation_steps_bound_the_gpu_and_the_host_gathers_every_rank():
    """DDP on 4 GPUs, eval_accumulation_steps 2 over 40 samples at 2 per GPU: each GPU holds every rank's logits
    (gather_for_metrics), 2 steps of them before they move to the host; DDP's fp32 buckets stay. Each rank's host
    keeps all 40 samples, moved 16 at a time (16, 16, 8): the last concatenation holds 32 + 8 + 40."""
    result = run(method="ddp", gpus=4, eval_batch_size=2, eval_keeps="logits", eval_accumulation_steps=2,
                 eval_samples=40)
    device = RESIDENT + 4 * P + 3 * 2 * SEQ * 8 + 2 * 2 * kept_step(2, world=4)
    per_sample = SEQ * V * 4 + SEQ * 8 + 4
    assert phase(result)["device_bytes"] == device
    assert phase(result)["host_bytes"] == 4 * (2 * 40 - 8) * per_sample


def test_more_samples_grow_the_phase_by_two_kept_steps_each():
    """An independent reading of the cat: one more eval step adds its kept tensors twice (the output and input)."""
    a, b = (phase(run(eval_keeps="logits", eval_samples=n))["device_bytes"] for n in (48, 56))
    assert b - a == 2 * kept_step(8)


def test_token_ids_keep_little():
    """preprocess_logits_for_metrics' argmax: int64 ids and labels per token; the forward's head is the peak."""
    loss_only = phase(run())["device_bytes"]
    ids = phase(run(eval_keeps="token-ids", eval_samples=64))
    held = 7 * kept_step(8, per_token=8) + kept_step(8, per_token=8)   # while the 8th step's forward runs
    assert ids["device_bytes"] == loss_only + held
    assert ids["host_bytes"] == 64 * (SEQ * 16 + 4)


def test_without_the_eval_sets_size_the_phase_is_a_floor_and_says_so():
    result = run(eval_keeps="logits")
    assert phase(result)["device_bytes"] < phase(run(eval_keeps="logits", eval_samples=16))["device_bytes"]
    note = next(n for n in result.job_notes if n.startswith("eval keeps logits on the GPU across the whole"))
    assert f"{format_bytes(kept_step(8))} more on each GPU per eval step" in note


def test_no_eval_no_phase_and_the_json_is_unchanged():
    result = estimate(TrainingSetup(model="tiny-llama", seq_len=SEQ))
    out = result.to_dict()
    assert [p["name"] for p in out["job_phases"]] == ["load", "save"] and "job_peak" not in out
    assert not any(k.startswith("eval") for k in out["setup"])
    assert out["job_notes"][0].startswith("load and save phases are analytic")


@pytest.mark.parametrize("kw, why", [
    ({"objective": "dpo"}, "TRL's DPOTrainer for --objective dpo"),
    ({"method": "tp", "gpus": 2}, "under tensor parallelism"),
    ({"method": "ds-zero3", "gpus": 2}, "ZeRO-3 (its module gathering"),
    ({"fused_ce": True}, "--fused-ce"),
])
def test_an_eval_it_cannot_model_is_a_note_not_a_number(kw, why):
    result = run(**kw)
    assert not any(p.name == "eval" for p in result.job_phases)
    assert any(n.startswith("the eval phase (--eval-batch-size 8) is not modelled") and why in n
               for n in result.job_notes)


@pytest.mark.parametrize("kw, message", [
    ({"eval_keeps": "everything", "eval_batch_size": 8}, "unknown --eval-keeps 'everything'"),
    ({"eval_batch_size": 0}, "--eval-batch-size must be a whole number >= 1"),
    ({"eval_accumulation_steps": 4}, "--eval-accumulation-steps describes an evaluation: add --eval-batch-size"),
])
def test_bad_values_are_refused(kw, message):
    with pytest.raises(LlmemError, match=message):
        TrainingSetup(model="tiny-llama", **kw)


def test_the_cli_flags_and_json(capsys):
    assert main(["estimate", "tiny-llama", "--seq-len", str(SEQ), "--eval-batch-size", "8", "--eval-keeps", "logits",
                 "--eval-samples", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["setup"]["eval_batch_size"] == 8 and out["setup"]["eval_samples"] == 64
    assert [p["name"] for p in out["job_phases"]] == ["load", "eval", "save"]
    assert main(["estimate", "tiny-llama", "--eval-samples", "0", "--eval-batch-size", "8"]) == 2
    assert capsys.readouterr().err.strip() == "llmem: error: --eval-samples must be a whole number >= 1, got 0"


def test_steps_per_rank_round_up():
    from llmem.setup.eval_phase import eval_steps
    assert eval_steps(40, 4, 2) == 5 == ceil(40 / 8) and eval_steps(41, 4, 2) == 6


def test_a_job_whose_eval_does_not_fit_does_not_fit():
    """The answer is the whole job's: a step that fits beside an eval phase whose tensors alone pass what the
    allocator may use does not fit (`fits` False, `step_fits` True, the phase named), and `--check` exits 1. The
    boundary is the hand-worked eval bytes: a device 1 MiB larger than them (with the context) fits."""
    context = 1 << 30                               # --cuda-context 1GiB: the allocator's share is the rest
    eval_bytes = loss_only_eval_bytes(64)           # 64 x 256 tokens x 32,000 vocabulary: ~5.3 GB
    step = run(eval_batch_size=64, gpu="A100-80GB")
    assert step.peak_reserved_bytes < eval_bytes    # the step is far smaller than the eval
    short = run(eval_batch_size=64, gpu="A100-80GB", gpu_memory=f"{context + eval_bytes - (1 << 20)}B",
                cuda_context="1GiB")
    assert (short.step_fits, short.fits) == (True, False)
    assert (short.job_over.name, short.job_over.device_bytes) == ("eval", eval_bytes)
    out = short.to_dict()
    assert (out["fits"], out["step_fits"], out["job_over"]["name"]) == (False, True, "eval")
    roomy = run(eval_batch_size=64, gpu="A100-80GB", gpu_memory=f"{context + eval_bytes + (1 << 20)}B",
                cuda_context="1GiB")
    assert roomy.fits and roomy.job_over is None and "job_over" not in roomy.to_dict()
    args = ["estimate", "tiny-llama", "--seq-len", str(SEQ), "--eval-batch-size", "64", "--gpu", "A100-80GB",
            "--cuda-context", "1GiB", "--check"]
    assert main(args + ["--gpu-memory", f"{context + eval_bytes - (1 << 20)}B"]) == 1
    assert main(args + ["--gpu-memory", f"{context + eval_bytes + (1 << 20)}B"]) == 0


def test_the_traces_fit_weighs_its_traced_eval_alike():
    """`llmem trace` runs the eval (llmem.runtime.evaluation): its answer's fit weighs the traced phase as the
    estimate's does (llmem.result.phase_over), at the same hand-worked boundary."""
    from llmem import trace

    context, eval_bytes = 1 << 30, loss_only_eval_bytes(64)
    base = dict(model="tiny-llama", seq_len=SEQ, eval_batch_size=64, gpu="A100-80GB", cuda_context="1GiB")
    short = trace(TrainingSetup(**base, gpu_memory=f"{context + eval_bytes - (8 << 20)}B"), job_phases=False)
    (traced,) = [p for p in short.job_phases if p.name == "eval"]
    assert abs(traced.device_bytes - eval_bytes) < 4 << 20                # within the trace's rounding of the estimate
    assert (short.step_fits, short.fits, short.job_over.name) == (True, False, "eval")
    roomy = trace(TrainingSetup(**base, gpu_memory=f"{context + eval_bytes + (8 << 20)}B"), job_phases=False)
    assert roomy.fits and roomy.job_over is None


def _eval_device_bytes(**kw) -> int:
    return next(p.device_bytes for p in run(eval_samples=100, **kw).job_phases if p.name == "eval")


def test_zero2_eval_holds_no_ipg_bucket():
    """ZeRO-1/2 release their IPG buckets at the end of backward (deepspeed stage_1_and_2.py
    _release_ipg_buffers), so the eval between steps holds none: its peak does not move with reduce_bucket_size,
    while the step's backward holds the bucket (its bf16 elements: 2 bytes each)."""
    small, large = 100_000_000, 500_000_000
    at = {rb: _eval_device_bytes(method="ds-zero2", gpus=2, reduce_bucket_size=rb) for rb in (small, large)}
    assert at[small] == at[large]
    steps = {rb: run(method="ds-zero2", gpus=2, reduce_bucket_size=rb).peak_allocated_bytes for rb in (small, large)}
    assert steps[large] - steps[small] >= 2 * (large - small) * 9 // 10
