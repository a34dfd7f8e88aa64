"""A LLaMA-Factory vision-language config through `llmem estimate --from` (one 1024x768 image a sample): the shared
harness of the families' --from tests (tests/model/test_llava_onevision.py, test_qwen3_vlm.py), and a LoRA SFT file
capped at image_max_pixels 768 x 768 read at 1024x1024 (test_internvl.py, test_llama4.py)."""

from __future__ import annotations

import json

from llmem.cli import main
from llmem.setup.sources import setup_from_file


def estimate_from_yaml(tmp_path, capsys, name: str, text: str) -> dict:
    """The JSON answer of `llmem estimate --from` a LLaMA-Factory file `name` holding `text`, which must succeed."""
    path = tmp_path / name
    path.write_text(text)
    code = main(["estimate", "--from", str(path), "--images-per-sample", "1", "--image-size", "1024x768", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def capped_lora_sft(tmp_path, model: str, template: str):
    """The set-up of a LLaMA-Factory LoRA SFT file for `model` (its `template`) with image_max_pixels 589,824
    (768 x 768), one 1024x1024 image a sample."""
    path = tmp_path / f"{template}_lora_sft.yaml"
    path.write_text(f"model_name_or_path: {model}\nstage: sft\ndo_train: true\nfinetuning_type: lora\n"
                    f"lora_rank: 8\nlora_target: all\ntemplate: {template}\ncutoff_len: 2048\n"
                    "image_max_pixels: 589824\nper_device_train_batch_size: 1\nbf16: true\n")
    return setup_from_file(path, images_per_sample=1, image_size="1024x1024").setup
