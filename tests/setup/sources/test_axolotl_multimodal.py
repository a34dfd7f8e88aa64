"""axolotl's multimodal `image_size` (processing_strategies.py: every image resized to it, an int a square) as llmem's
--image-size, with the data's images given on the command line; dropped without them. Expected values are read off
the YAML written here (axolotl's examples/qwen2-vl/lora-7b.yaml keys)."""

from __future__ import annotations

import pytest

from llmem.errors import LlmemError
from llmem.setup.sources import setup_from_file

AXOLOTL = """base_model: Qwen/Qwen2.5-VL-7B-Instruct
processor_type: AutoProcessor
skip_prepare_dataset: true
remove_unused_columns: false
sample_packing: false
chat_template: qwen2_vl
datasets:
  - path: HuggingFaceH4/llava-instruct-mix-vsft
    type: chat_template
sequence_len: 8192
adapter: lora
lora_r: 32
lora_alpha: 16
lora_target_modules: 'model.language_model.layers.[\\d]+.(mlp|cross_attn|self_attn).(up|down|gate|q|k|v|o)_proj'
micro_batch_size: 1
bf16: true
gradient_checkpointing: true
{extra}"""


def _read(tmp_path, extra: str, **overrides):
    path = tmp_path / "axolotl.yaml"
    path.write_text(AXOLOTL.format(extra=extra))
    return setup_from_file(path, **overrides)


@pytest.mark.parametrize(("extra", "size"), [("image_size: 512", "512x512"), ("image_size: [448, 672]", "448x672")])
def test_image_size_is_the_resize(tmp_path, extra, size):
    assert _read(tmp_path, extra, images_per_sample=2).setup.image_size == size


def test_without_images_it_is_dropped(tmp_path):
    got = _read(tmp_path, "image_size: 512")
    assert got.setup.image_size is None
    assert "image_size" in {i.key for i in got.record.ignored}


def test_a_bad_size_is_one_line(tmp_path):
    with pytest.raises(LlmemError, match=r"image_size = 'large' is not an image size"):
        _read(tmp_path, "image_size: large", images_per_sample=1)
