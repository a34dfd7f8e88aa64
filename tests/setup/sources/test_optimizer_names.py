"""The frameworks' names for torchao's low-bit AdamW and bitsandbytes' paged 32-bit AdamW read as those optimizers.

Names from transformers 5.25's OptimizerNames (training_args.py: adamw_torch_8bit, adamw_torch_4bit,
paged_adamw_32bit; trainer_optimizer._get_torchao_optimizer builds both torchao classes with block_size=256),
axolotl 0.19's CustomSupportedOptimizers (ao_adamw_8bit / ao_adamw_4bit / ao_adamw_fp8: torchao's classes with
their defaults) and torchtune's `_component_` class paths (torchao.optim.*, bitsandbytes.optim.PagedAdamW)."""

from __future__ import annotations

import pytest
from published_configs import CONFIGS, SKIP_REASON, present

from llmem.setup.sources import setup_from_file

TORCHTUNE = ("model:\n  _component_: torchtune.models.llama3_2.llama3_2_1b\noptimizer:\n  _component_: {name}\n"
             "  lr: 1e-5\n{extra}batch_size: 1\n")


def _read(tmp_path, text: str) -> str:
    f = tmp_path / "run.yaml"
    f.write_text(text)
    return setup_from_file(f).setup.optimizer


@pytest.mark.parametrize("optim, row", [
    ("adamw_torch_8bit", "torchao-adamw-8bit"),
    ("adamw_torch_4bit", "torchao-adamw-4bit-b256"),       # transformers passes block_size=256
    ("paged_adamw_32bit", "paged-adamw-32bit"),
])
def test_trainingarguments_optim(tmp_path, optim, row):
    assert _read(tmp_path, f"model_name_or_path: tiny-llama\noptim: {optim}\nmax_length: 256\n") == row


@pytest.mark.parametrize("optimizer, row", [
    ("ao_adamw_8bit", "torchao-adamw-8bit"),
    ("ao_adamw_4bit", "torchao-adamw-4bit"),                # torchao's default block of 128
    ("ao_adamw_fp8", "torchao-adamw-fp8"),
    ("adamw_torch_8bit", "torchao-adamw-8bit"),
    ("paged_adamw_32bit", "paged-adamw-32bit"),
])
def test_axolotl_optimizer(tmp_path, optimizer, row):
    text = f"base_model: tiny-llama\noptimizer: {optimizer}\nsequence_len: 256\nmicro_batch_size: 1\n"
    assert _read(tmp_path, text) == row


@pytest.mark.parametrize("component, row", [
    ("torchao.optim.AdamW8bit", "torchao-adamw-8bit"),
    ("torchao.optim.AdamW4bit", "torchao-adamw-4bit"),
    ("torchao.optim.AdamWFp8", "torchao-adamw-fp8"),
    ("torchao.prototype.low_bit_optim.AdamW8bit", "torchao-adamw-8bit"),
    ("bitsandbytes.optim.PagedAdamW", "paged-adamw-32bit"),
    ("bitsandbytes.optim.PagedAdamW32bit", "paged-adamw-32bit"),
])
def test_torchtune_component(tmp_path, component, row):
    assert _read(tmp_path, TORCHTUNE.format(name=component, extra="")) == row


@pytest.mark.skipif(not present(), reason=SKIP_REASON)
def test_published_axolotl_qlora_keeps_its_paged_32bit_adamw():
    """axolotl's examples/llama-3/qlora.yml says `optimizer: paged_adamw_32bit`."""
    assert setup_from_file(CONFIGS / "axolotl/examples/llama-3/qlora.yml").setup.optimizer == "paged-adamw-32bit"


@pytest.mark.parametrize("block, row", [(256, "torchao-adamw-4bit-b256"), (128, "torchao-adamw-4bit")])
def test_torchtune_torchao_block_size(tmp_path, block, row):
    text = TORCHTUNE.format(name="torchao.optim.AdamW4bit", extra=f"  block_size: {block}\n")
    assert _read(tmp_path, text) == row


def test_torchtune_torchao_block_size_without_a_row_is_named(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text(TORCHTUNE.format(name="torchao.optim.AdamW8bit", extra="  block_size: 64\n"))
    fs = setup_from_file(f)
    assert fs.setup.optimizer == "torchao-adamw-8bit"
    assert any(i.key == "optimizer.block_size" for i in fs.record.ignored)
