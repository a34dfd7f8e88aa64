"""TrainingSetup as sections (llmem.setup.sections): built from flat names or sections alike, each field in one
section, read by its flat name, and its JSON keys those llmem printed before the split."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path

import pytest

from llmem import estimate
from llmem.errors import LlmemError
from llmem.setup.sections import SECTIONS, ActivationsConfig, ParallelismConfig, StepConfig
from llmem.setup.training import FLAT_ORDER, SHOWN_WHEN_SET, TrainingSetup, option_fields

DATA = Path(__file__).resolve().parents[1] / "data"


def test_at_most_twelve_top_level_fields_each_section_a_frozen_dataclass():
    top = [f.name for f in fields(TrainingSetup)]
    assert len(top) <= 12
    assert top[:2] == ["model", "trust_remote_code"] and top[2:] == list(SECTIONS)
    for section in SECTIONS.values():
        assert section.__dataclass_params__.frozen


def test_every_field_lives_in_one_place_and_carries_its_option():
    names = [f.name for section in SECTIONS.values() for f in fields(section)] + ["model", "trust_remote_code"]
    assert len(names) == len(set(names)) == 89
    assert sorted(names) == sorted(FLAT_ORDER)
    assert all("option" in f.metadata for f in option_fields())
    # no flat name hides a section or one of TrainingSetup's own properties
    assert not set(names) & set(SECTIONS)
    assert not set(names) & {"peft", "mixed", "microbatches", "shape_free", "precision_spec", "optimizer_spec"}


def test_flat_names_and_sections_build_the_same_setup():
    flat = TrainingSetup(model="gpt2", method="fsdp", gpus=8, batch_size=4, seq_len=512, grad_ckpt=True)
    nested = TrainingSetup(model="gpt2", parallelism=ParallelismConfig(method="fsdp", gpus=8),
                           step=StepConfig(batch_size=4, seq_len=512), activations=ActivationsConfig(grad_ckpt=True))
    assert flat == nested and hash(flat) == hash(nested)
    assert flat.parallelism.gpus == flat.gpus == 8 and flat.step.seq_len == flat.seq_len == 512


def test_values_by_position_follow_the_flat_order():
    """As the flat dataclass took them: model, method, gpus, gpus_per_node, tp, batch_size, ..."""
    s = TrainingSetup("gpt2", "ddp", 2, None, None, 4)
    assert (s.method, s.gpus, s.batch_size) == ("ddp", 2, 4)
    with pytest.raises(TypeError, match="multiple values for argument 'gpus'"):
        TrainingSetup("gpt2", "ddp", 2, gpus=4)


def test_a_flat_override_changes_its_section_only():
    base = TrainingSetup(model="gpt2", method="fsdp", gpus=8, lora_rank=16)
    wider = replace(base, batch_size=6)
    assert wider.step == StepConfig(batch_size=6, seq_len=2048)
    assert wider.parallelism is base.parallelism and wider.adapters is base.adapters
    mixed = TrainingSetup(model="gpt2", parallelism=ParallelismConfig(gpus=4, method="ddp"), gpus=2)
    assert (mixed.gpus, mixed.method) == (2, "ddp")


def test_validation_normalises_inside_the_section():
    # --ac-policy op implies --grad-ckpt; DeepSpeed's counts are parsed as its configs write them
    selective = TrainingSetup(model="gpt2", ac_policy="op")
    assert selective.activations.grad_ckpt is True
    zero = TrainingSetup(model="gpt2", method="ds-zero3", gpus=2, reduce_bucket_size="5e8",
                         prefetch_bucket_size="auto")
    assert zero.deepspeed.reduce_bucket_size == 500_000_000
    assert zero.deepspeed.prefetch_bucket_size == "auto"


def test_unknown_names_and_bad_values_are_refused():
    with pytest.raises(TypeError, match="unexpected keyword argument 'batch'"):
        TrainingSetup(model="gpt2", batch=2)
    with pytest.raises(LlmemError, match="--batch-size must lie in"):
        TrainingSetup(model="gpt2", batch_size=0)


def test_repr_and_dict_keep_the_flat_form():
    s = TrainingSetup(model="gpt2", gpus=2, method="ddp")
    assert repr(s).startswith("TrainingSetup(model='gpt2', method='ddp', gpus=2, gpus_per_node=None, tp=None, "
                              "batch_size=1, seq_len=2048, precision='bf16-mixed', optimizer='adamw', ")
    # every field in FLAT_ORDER, but the eval's only where the set-up evaluates (an earlier answer's JSON stays)
    assert list(s.to_dict()) == [n for n in FLAT_ORDER if n not in SHOWN_WHEN_SET]
    evaluating = replace(s, eval_batch_size=4)
    assert list(evaluating.to_dict()) == [n for n in FLAT_ORDER if n not in SHOWN_WHEN_SET or n == "eval_batch_size"]
    assert list(replace(s, grad_ckpt=True, ckpt_reentrant=True).to_dict())[-1] == "ckpt_reentrant"
    assert list(replace(evaluating, eval_samples=9).to_dict())[-1] == "eval_samples"
    assert s.shape_free == replace(s, batch_size=3, seq_len=64).shape_free
    # a field added later prints only off its default, so an earlier set-up's repr (a digest's input) stays
    assert repr(s).endswith("reshard_after_forward=None)")
    assert repr(replace(s, liger="rope")).endswith("reshard_after_forward=None, liger='rope')")


def test_the_json_keeps_the_keys_it_had_before_the_sections():
    """The `setup` object of `--json`, as llmem printed it before the split (tests/data/setup_json_keys.json, from
    the earlier code's own output), is the same keys in the same order."""
    before = json.loads((DATA / "setup_json_keys.json").read_text())["keys"]
    now = list(estimate("tiny-llama", seq_len=64).to_dict()["setup"])
    assert now[:len(before)] == before
