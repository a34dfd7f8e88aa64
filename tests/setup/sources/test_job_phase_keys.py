"""The loading and saving keys of accelerate's and DeepSpeed's configs read into --load-path / --save-kind
(llmem.setup.job_phases), the expected values written from the files themselves; where the set-up has no such phase
the key is kept as one with no effect on the step, never a refusal."""

from __future__ import annotations

import pytest
from published_configs import CONFIGS as SHARED
from published_configs import SKIP_REASON, present

from llmem.setup.sources import setup_from_file

pytestmark = pytest.mark.skipif(not present(), reason=SKIP_REASON)


def _read(*names: str, **overrides):
    return setup_from_file([SHARED / n for n in names], **overrides)


def test_accelerate_fsdp_cpu_ram_efficient_and_full_state_dict():
    # fsdp_cpu_ram_efficient_loading: true, fsdp_state_dict_type: FULL_STATE_DICT (not FSDP2's sharded default)
    got = _read("trl/examples/accelerate_configs/fsdp2.yaml", model="tiny-llama")
    assert (got.setup.load_path, got.setup.save_kind) == ("cpu-ram-efficient", "full")


def test_accelerate_zero3_init_flag_and_16bit_save():
    # zero3_init_flag: true, zero3_save_16bit_model: true, zero_stage: 3
    got = _read("trl/examples/accelerate_configs/deepspeed_zero3.yaml", model="tiny-llama")
    assert (got.setup.method, got.setup.load_path, got.setup.save_kind) == ("ds-zero3", "zero-init", "gather-16bit")
    assert not any(i.key.endswith(("zero3_init_flag", "zero3_save_16bit_model")) for i in got.record.ignored)


def test_a_flag_overrides_the_files_phase():
    got = _read("trl/examples/accelerate_configs/deepspeed_zero3.yaml", model="tiny-llama", save_kind="sharded")
    assert got.setup.save_kind == "sharded"


def test_qlora_under_fsdp_keeps_the_keys_without_a_phase():
    # axolotl's QLoRA FSDP recipe (load_in_4bit, adapter: qlora) says fsdp_cpu_ram_efficient_loading: true and
    # FULL_STATE_DICT; a quantised base has no loading / saving phase in llmem: the keys are kept, the step answered
    got = _read("axolotl/examples/llama-3/qlora-fsdp-70b.yaml", model="tiny-llama", gpus=2)
    assert (got.setup.load_path, got.setup.save_kind) == ("default", "default")
    kept = {i.key.rsplit(".", 1)[-1]: i for i in got.record.ignored}
    assert {"fsdp_cpu_ram_efficient_loading", "fsdp_state_dict_type"} <= set(kept)
    assert not kept["fsdp_state_dict_type"].approximates
