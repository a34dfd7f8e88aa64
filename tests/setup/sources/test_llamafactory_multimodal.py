"""LLaMA-Factory's vision-language switches (0.9.5: FreezeArguments' freeze_vision_tower / freeze_multi_modal_projector
/ freeze_language_model, ProcessorArguments' image_max_pixels) read from its own example's keys
(examples/train_full/qwen2_5vl_full_sft.yaml): applied with the data's images given on the command line, dropped
without them (a written key then said ignored). Expected values are read off the YAML written here."""

from __future__ import annotations

from llmem.setup.sources import setup_from_file

LF = """model_name_or_path: Qwen/Qwen2.5-VL-7B-Instruct
image_max_pixels: 262144
stage: sft
finetuning_type: full
{freeze}
template: qwen2_vl
cutoff_len: 2048
per_device_train_batch_size: 1
bf16: true
"""
WRITTEN = "freeze_vision_tower: true\nfreeze_multi_modal_projector: false\nfreeze_language_model: false"


def _read(tmp_path, freeze: str = WRITTEN, **overrides):
    path = tmp_path / "lf.yaml"
    path.write_text(LF.format(freeze=freeze))
    return setup_from_file(path, **overrides)


def test_the_switches_apply_to_a_step_with_images(tmp_path):
    got = _read(tmp_path, images_per_sample=1, image_size="1024x768")
    s = got.setup
    assert (s.freeze_vision_tower, s.freeze_projector, s.freeze_language_model, s.max_pixels) == \
        (True, False, False, 262144)
    assert any("cutoff_len caps" in n for n in got.record.notes)


def test_defaults_freeze_the_tower_and_the_projector(tmp_path):
    s = _read(tmp_path, freeze="", images_per_sample=1, image_size="1024x768").setup
    assert (s.freeze_vision_tower, s.freeze_projector, s.freeze_language_model) == (True, True, False)


def test_without_images_the_written_switches_are_ignored(tmp_path):
    got = _read(tmp_path)
    s = got.setup
    assert (s.freeze_vision_tower, s.freeze_projector, s.max_pixels) == (False, False, None)
    ignored = {i.key for i in got.record.ignored}
    assert {"freeze_vision_tower", "freeze_multi_modal_projector", "image_max_pixels"} <= ignored
    assert not {k for k in ignored if k.endswith("(default)")}
