"""Configs of frameworks llmem has no reader for are refused by name, never read with another framework's defaults:
LLaMA-Factory's v1 schema (model, template and plugin configs) carries TrainingArguments' keys and would be taken for
a TRL config with its own keys ignored. An ms-swift YAML (BaseArguments.tuner_type / 3.x's train_type,
RLHFArguments.rlhf_type), once refused here alike, has its own reader (llmem.setup.sources.ms_swift): never TRL's."""

from __future__ import annotations

import pytest

from llmem.errors import LlmemError
from llmem.setup.sources import setup_from_file

SWIFT = """model: Qwen/Qwen2.5-7B-Instruct
{mark}: {value}
dataset: AI-ModelScope/alpaca-gpt4-data-en
torch_dtype: bfloat16
per_device_train_batch_size: 1
max_length: 2048
output_dir: output
"""
LF_V1 = """model: Qwen/Qwen3-4B
template: qwen3
train_dataset: data.yaml
micro_batch_size: 1
cutoff_len: 2048
peft_config:
  name: lora
"""


@pytest.mark.parametrize("mark, value", [("tuner_type", "lora"), ("train_type", "full"), ("rlhf_type", "dpo")])
def test_ms_swift_is_read_by_its_own_reader(tmp_path, mark, value):
    path = tmp_path / "sft.yaml"
    path.write_text(SWIFT.format(mark=mark, value=value))
    got = setup_from_file(path, model="Qwen/Qwen2.5-7B")
    assert got.record.files[0][1] == "ms-swift"
    assert got.setup.grad_ckpt is True      # ms-swift's default (TrainArgumentsMixin), not TrainingArguments' False


# LLaMA-Factory's own v1 examples (examples/v1/train_lora/train_lora_sft.yaml) name no template
LF_V1_EXAMPLE = """model: Qwen/Qwen3-4B
model_class: llm
peft_config:
  name: lora
  r: 16
kernel_config:
  name: auto
dist_config:
  name: fsdp2
train_dataset: data/v1_sft_demo.yaml
micro_batch_size: 1
cutoff_len: 2048
"""


@pytest.mark.parametrize("text", [LF_V1, LF_V1_EXAMPLE], ids=["template", "example"])
def test_llamafactory_v1_is_refused_by_name(tmp_path, text):
    """Refused as LLaMA-Factory's, not read as TRL's (its LoRA in peft_config ignored) nor taken for
    Megatron-SWIFT's (micro_batch_size beside a model string)."""
    path = tmp_path / "v1.yaml"
    path.write_text(text)
    with pytest.raises(LlmemError, match="a LLaMA-Factory v1 config"):
        setup_from_file(path, model="Qwen/Qwen2.5-7B")


def test_a_trl_config_with_a_model_key_is_still_read(tmp_path):
    """`model` alone (no template, no plugin configs) does not make a file LLaMA-Factory v1's."""
    path = tmp_path / "sft.yaml"
    path.write_text("model_name_or_path: Qwen/Qwen2.5-7B\nper_device_train_batch_size: 2\nmax_length: 1024\n")
    assert setup_from_file(path).setup.batch_size == 2
