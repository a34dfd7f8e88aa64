"""GRPO's and RLOO's generation batch read from the frameworks' configs: TRL's gradient_accumulation_steps,
steps_per_generation and generation_batch_size; axolotl's top-level accumulation and trl.generation_batch_size."""

from __future__ import annotations

import pytest
import yaml

from llmem.setup.generation import generation_rows, steps_per_generation
from llmem.setup.objectives import scores_old_policy
from llmem.setup.sources import setup_from_file


def test_trl_config_read(tmp_path):
    """A `trl grpo --config` YAML's accumulation and generation batch are read (the trl grpo parser takes them)."""
    data = {"model_name_or_path": "tiny-llama", "per_device_train_batch_size": 2, "num_generations": 4,
            "max_completion_length": 64, "gradient_accumulation_steps": 8, "use_vllm": False}
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(data))
    s = setup_from_file(path).setup
    assert (s.objective, s.gradient_accumulation_steps, s.steps_per_generation) == ("grpo", 8, None)
    assert generation_rows(s) == 16
    path.write_text(yaml.safe_dump({**data, "generation_batch_size": 4}))
    s = setup_from_file(path).setup
    assert (s.generation_batch_size, steps_per_generation(s)) == (4, 2)
    path.write_text(yaml.safe_dump({**data, "steps_per_generation": 2, "gradient_accumulation_steps": 3}))
    s = setup_from_file(path).setup
    assert (s.steps_per_generation, s.gradient_accumulation_steps, scores_old_policy(s)) == (2, 3, True)


def test_axolotl_config_read(tmp_path):
    """axolotl's GRPOStrategy passes trl.generation_batch_size; its gradient_accumulation_steps is
    TrainingArguments'."""
    data = {"base_model": "tiny-llama", "rl": "grpo", "micro_batch_size": 2, "sequence_len": 256,
            "gradient_accumulation_steps": 4, "trl": {"num_generations": 4, "max_completion_length": 64}}
    path = tmp_path / "grpo.yml"
    path.write_text(yaml.safe_dump(data))
    s = setup_from_file(path).setup
    assert (s.gradient_accumulation_steps, steps_per_generation(s)) == (4, 4)
    data["trl"]["generation_batch_size"] = 4
    path.write_text(yaml.safe_dump(data))
    s = setup_from_file(path).setup
    assert (s.generation_batch_size, steps_per_generation(s)) == (4, 2)


def test_trl_parser_takes_the_keys(tmp_path):
    """The trl grpo parser consumes every key of such a file (none left over for TRL to ignore)."""
    import importlib

    pytest.importorskip("trl")
    data = {"model_name_or_path": "tiny-llama", "per_device_train_batch_size": 2, "num_generations": 4,
            "gradient_accumulation_steps": 8, "generation_batch_size": 4}
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(data))
    parser = importlib.import_module("trl.scripts.grpo").make_parser()
    *out, unused, _ = parser.parse_args_and_config(
        ["--config", str(path), "--dataset_name", "x", "--output_dir", str(tmp_path / "out"), "--use_cpu", "true"],
        return_remaining_strings=True, separate_remaining_strings=True)
    assert not unused and (out[1].generation_batch_size, out[1].steps_per_generation) == (4, 2)


def test_a_flag_replaces_the_files_other_spelling(tmp_path):
    """--steps-per-generation over a file's generation_batch_size (TRL takes one of the two): the flag's wins."""
    data = {"model_name_or_path": "tiny-llama", "per_device_train_batch_size": 2, "num_generations": 4,
            "generation_batch_size": 4}
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(data))
    s = setup_from_file(path, steps_per_generation=4).setup
    assert (s.steps_per_generation, s.generation_batch_size, generation_rows(s)) == (4, None, 8)
