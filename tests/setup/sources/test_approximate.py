"""A --from answer that is not the file's run says so: every ignored key that changes memory (torch.compile, an
optimizer or adapter llmem does not model) makes the record inexact, named in `--json` (`exact`,
`approximate_because`) and above the table; keys with no memory effect (checkpoint saving, the other keys) do not."""

from __future__ import annotations

import json

from llmem.cli import main
from llmem.setup.sources import setup_from_file

TRL = """model_name_or_path: meta-llama/Llama-3.1-8B
per_device_train_batch_size: 1
max_length: 512
bf16: true
"""


def _record(tmp_path, extra: str):
    path = tmp_path / "sft.yaml"
    path.write_text(TRL + extra)
    return setup_from_file(path).record


def test_a_file_read_whole_is_exact(tmp_path):
    record = _record(tmp_path, "logging_steps: 10\nsave_steps: 500\n")     # read or no memory effect
    assert record.exact and record.to_dict()["approximate_because"] == []


def test_torch_compile_makes_it_approximate(tmp_path):
    record = _record(tmp_path, "torch_compile: true\n")
    assert not record.exact
    assert [i.key for i in record.approximations] == ["torch_compile"]
    assert record.to_dict()["approximate_because"][0].startswith(
        "torch_compile: the Trainer's torch.compile of the whole model is not modelled")


def test_the_table_says_approximate_first(tmp_path, capsys):
    path = tmp_path / "sft.yaml"
    path.write_text(TRL + "torch_compile: true\n")
    assert main(["estimate", "tiny-llama", "--from", str(path)]) == 0
    first = capsys.readouterr().out.lstrip().splitlines()[0]
    assert first.startswith("approximate:") and "torch_compile" in first
    assert main(["estimate", "tiny-llama", "--from", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["from_file"]["exact"] is False


def test_the_plan_says_approximate_first_too(tmp_path, capsys):
    path = tmp_path / "sft.yaml"
    path.write_text(TRL + "torch_compile: true\n")
    assert main(["plan", "tiny-llama", "--from", str(path), "--gpus", "2", "--seq-len", "64"]) == 0
    first = capsys.readouterr().out.lstrip().splitlines()[0]
    assert first.startswith("approximate:") and "torch_compile" in first


AXOLOTL = """base_model: meta-llama/Llama-3.1-8B
sequence_len: 1024
micro_batch_size: 1
bf16: true
gradient_checkpointing: true
fsdp_version: 2
fsdp_config:
  reshard_after_forward: true
"""


def _axolotl(tmp_path, extra: str):
    path = tmp_path / "axolotl.yaml"
    path.write_text(AXOLOTL + extra)
    return setup_from_file(path, gpus=8)


def test_a_fused_loss_under_tensor_parallelism_is_the_whole_logits_said_so(tmp_path):
    """axolotl's Cut Cross-Entropy plugin with tensor_parallel_size: llmem's fused loss is not modelled over a
    vocab-parallel lm_head (support's FUSED_CE row); the file is read with transformers' loss standing in, an upper
    bound, not refused. The same plugin without TP stays the fused loss."""
    plugin = "plugins:\n  - axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin\n"
    fs = _axolotl(tmp_path, plugin + "tensor_parallel_size: 2\n")
    assert fs.setup.tp == 2 and fs.setup.fused_ce is False
    assert [i.key for i in fs.record.approximations] == ["plugins"]
    assert "the whole logits and transformers' loss stand in" in fs.record.approximations[0].why
    assert _axolotl(tmp_path, plugin).setup.fused_ce is True


def test_an_offloaded_checkpoint_under_fsdp2_is_torchs_checkpoint_said_so(tmp_path):
    """axolotl's `activation_offloading: legacy` (Unsloth's offloaded checkpoint, --ckpt-offload unsloth-classic) under
    FSDP2, where llmem models it on one GPU or DDP only: torch's checkpoint stands in (an upper bound)."""
    fs = _axolotl(tmp_path, "activation_offloading: legacy\n")
    assert fs.setup.method == "fsdp" and fs.setup.ckpt_offload == "none" and fs.setup.grad_ckpt
    assert [i.key for i in fs.record.approximations] == ["activation_offloading"]
    assert "torch's checkpoint" in fs.record.approximations[0].why
