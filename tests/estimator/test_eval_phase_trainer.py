"""An independent reading of the eval phase's kept tensors: a real transformers Trainer.evaluate on CPU, a tiny
random Llama with compute_metrics (so evaluation_loop keeps the logits and labels), every tensor the eval makes
counted while its storage lives (a dispatch mode: each op's outputs, freed when the last tensor on the storage
dies). On CPU the Trainer runs fp32 without accelerate's AMP: the logits are fp32 as on the GPU under it.

The measurement and llmem.estimator.eval_phase's arithmetic must agree within what its docstring names as left out
(and `llmem estimate` of the same model's config.json, end to end, within 1 %):
the labels and losses are counted as concatenated with the predictions, 2 k steps of them at the predictions' cat
(the real loop holds k - 1 steps of them then: theirs comes after), at most k + 1 steps' too many."""

from __future__ import annotations

import weakref

import pytest

from llmem import estimate
from llmem.estimator.eval_phase import EvalBytes, kept_across_steps
from llmem.setup.gpus import resolve_gpu
from llmem.setup.training import TrainingSetup

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
np = pytest.importorskip("numpy")

V, S, B, HIDDEN = 1024, 16, 2, 32


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """The bytes of the storages the ops make, while a tensor on them lives; the peak."""

    def __init__(self, ignore: set[int]):
        super().__init__()
        self.ignore, self.live, self.now, self.peak = ignore, {}, 0, 0

    def _drop(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            if key == 0 or key in self.ignore:     # the model's own parameters and buffers (and their views)
                continue
            if key not in self.live:
                self.live[key] = [t.untyped_storage().nbytes(), 0]
                self.now += self.live[key][0]
                self.peak = max(self.peak, self.now)
            self.live[key][1] += 1
            weakref.finalize(t, self._drop, key)
        return out


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        ids = torch.arange(S) % V
        return {"input_ids": ids, "attention_mask": torch.ones(S, dtype=torch.long), "labels": ids.clone()}


CONFIG = {"vocab_size": V, "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Llama (random weights) and the folder of its config.json, which llmem estimates from."""
    folder = tmp_path_factory.mktemp("tiny-llama-eval")
    cfg = transformers.LlamaConfig(**CONFIG)
    cfg.save_pretrained(folder)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg), folder


def measured_peak(model, samples: int, folder, metrics: bool = True) -> int:
    """The most tensor bytes Trainer.evaluate holds at once besides the model's own (per_device_eval_batch_size B,
    `samples` rows of S tokens; compute_metrics given or not)."""
    args = transformers.TrainingArguments(output_dir=str(folder), per_device_eval_batch_size=B, report_to=[],
                                          use_cpu=True, disable_tqdm=True)
    compute = (lambda p: {"rows": float(np.asarray(p.predictions).shape[0])}) if metrics else None
    trainer = transformers.Trainer(model=model, args=args, eval_dataset=Rows(samples), compute_metrics=compute)
    ignore = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    mode = LiveBytes(ignore)
    with mode:
        got = trainer.evaluate()
    if metrics:
        assert got["eval_rows"] == samples       # the logits of every sample reached compute_metrics
    return mode.peak


def modelled(steps: int) -> EvalBytes:
    """The phase's bytes for this Trainer, by hand: fp32 logits [B, S, V] (no AMP, no upcast), int64 labels and
    the loss per sample kept each step; the layer and head moments are below the cat's (set small)."""
    t = B * S
    return EvalBytes(ranks_per_node=1, resident_bytes=0, batch_bytes=3 * t * 8, layer_gathered_bytes=0,
                     head_gathered_bytes=0, kept_gathered_bytes=0, casts_bytes=0, dequant_bytes=0, layer_bytes=t * HIDDEN * 16,
                     head_bytes=2 * t * V * 4, output_bytes=t * V * 4, local_kept_bytes=t * V * 4 + t * 8 + B * 4,
                     step_kept_bytes=t * V * 4 + t * 8 + B * 4, kept_steps=steps, gathers=False, host_bytes=0)


def test_trainer_evaluate_keeps_logits_as_modelled(tiny, tmp_path):
    model, _ = tiny
    short, long = (measured_peak(model, n, tmp_path) for n in (4 * B, 8 * B))     # 4 and 8 eval steps
    labels_and_loss = B * S * 8 + B * 4            # one step's labels and losses: the documented overcount's unit
    for steps, got in ((4, short), (8, long)):
        want = kept_across_steps(modelled(steps))
        assert 0 <= want - got <= (steps + 1) * labels_and_loss, (steps, want, got)
    # four more steps: the cat's output and its input each four steps longer (8 x 128 KiB of logits)
    logits = B * S * V * 4
    assert 8 * logits <= long - short <= 8 * (logits + labels_and_loss)


@pytest.mark.parametrize("keeps, samples", [("loss", 2 * B), ("logits", 4 * B), ("logits", 8 * B)])
def test_the_estimate_of_the_same_model_agrees(tiny, tmp_path, keeps, samples):
    """llmem estimate on the tiny model's config.json (fp32: what the CPU Trainer runs) against the measured eval,
    less the weights and AdamW's states the estimate keeps beside it (12 bytes a parameter) and cuBLAS's workspace
    (the measurement counts none of them): within 1 % (the loss's per-token scalars and the labels' overcount)."""
    model, folder = tiny
    params = sum(p.numel() for p in model.parameters())
    result = estimate(TrainingSetup(model=str(folder / "config.json"), seq_len=S, precision="fp32",
                                    eval_batch_size=B, eval_keeps=keeps, eval_samples=samples))
    assert result.setup.total_params == params
    phase = next(p for p in result.job_phases if p.name == "eval")
    got = measured_peak(model, samples, tmp_path, metrics=keeps != "loss")
    beside = 12 * params + resolve_gpu(result.setup.gpu, None, None).cublas_workspace_bytes   # (no cuBLAS on CPU)
    assert abs(phase.device_bytes - beside - got) <= 0.01 * got, (phase.device_bytes - beside, got)
