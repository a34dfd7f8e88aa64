"""The ms-swift reader's defaults against ms-swift's own argument dataclasses, parsed with `ast` from its sources
(the 4.6.0 wheel unpacked: `pip download ms-swift==4.6.0 --no-deps`, unzip, LLMEM_MS_SWIFT_SRC=<the folder holding
swift/>; default /tmp/ms-swift/src), and its DeepSpeed / FSDP presets against swift/config/*.json. Slow-marked and
skipped where the sources are not at hand (no network in CI)."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from llmem.setup.sources import setup_from_file

ROOT = Path(os.environ.get("LLMEM_MS_SWIFT_SRC", "/tmp/ms-swift/src")) / "swift"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (ROOT / "arguments" / "tuner_args.py").is_file(),
                                 reason=f"ms-swift's sources are not at {ROOT}")]


def _defaults(relative: str, cls: str) -> dict:
    """The class's annotated fields' defaults (literals, field(default=...), field(default_factory=lambda: ...))."""
    tree = ast.parse((ROOT / relative).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    out = {}
    for stmt in node.body:
        if not isinstance(stmt, ast.AnnAssign) or stmt.value is None:
            continue
        value = stmt.value
        if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
            kw = {k.arg: k.value for k in value.keywords}
            value = kw.get("default") or getattr(kw.get("default_factory"), "body", None)
        try:
            out[stmt.target.id] = ast.literal_eval(value)
        except (ValueError, TypeError):
            continue
    return out


def test_sft_defaults(tmp_path):
    tuner = _defaults("arguments/tuner_args.py", "TunerArguments")
    trainer = _defaults("trainers/arguments.py", "TrainArgumentsMixin")
    assert _defaults("arguments/base_args/base_args.py", "BaseArguments")["tuner_type"] == "lora"
    path = tmp_path / "swift.yaml"
    path.write_text("model: Qwen/Qwen2.5-VL-3B-Instruct\ntuner_type: full\nmax_length: 512\n")
    full = setup_from_file(path, images_per_sample=1, image_size="448x448").setup
    assert (full.freeze_vision_tower, full.freeze_projector, full.freeze_language_model) == \
        (tuner["freeze_vit"], tuner["freeze_aligner"], tuner["freeze_llm"])
    path.write_text("model: Qwen/Qwen3-8B\nmax_length: 512\n")
    s = setup_from_file(path).setup
    assert (s.lora_rank, s.lora_alpha, s.lora_dropout) == (tuner["lora_rank"], tuner["lora_alpha"],
                                                           tuner["lora_dropout"])
    assert tuner["target_modules"] == ["all-linear"] and s.lora_targets == "all-linear"
    assert (s.batch_size, s.grad_ckpt) == (trainer["per_device_train_batch_size"], trainer["gradient_checkpointing"])
    quant = _defaults("arguments/base_args/quant_args.py", "QuantizeArguments")
    path.write_text("model: Qwen/Qwen3-8B\nmax_length: 512\nquant_method: bnb\nquant_bits: 4\n")
    q = setup_from_file(path).setup
    assert (q.quant_base, q.double_quant) == (quant["bnb_4bit_quant_type"], quant["bnb_4bit_use_double_quant"])


def test_grpo_defaults(tmp_path):
    rlhf = _defaults("arguments/rlhf_args.py", "RLHFArguments")
    grpo = _defaults("arguments/rlhf_args.py", "GRPOArguments")
    vllm = _defaults("rlhf_trainers/args_mixin.py", "VllmArguments")
    path = tmp_path / "swift.yaml"
    path.write_text("rlhf_type: grpo\nmodel: Qwen/Qwen3-8B\nmax_length: 512\nuse_vllm: true\nvllm_mode: colocate\n"
                    "per_device_train_batch_size: 8\n")
    s = setup_from_file(path).setup
    assert (s.num_generations, s.max_completion_length) == (grpo["num_generations"], rlhf["max_completion_length"])
    assert s.vllm_gpu_memory_utilization == vllm["vllm_gpu_memory_utilization"]
    assert rlhf["rlhf_type"] == "dpo"


def test_presets_are_the_shipped_json():
    presets = json.loads((Path(__file__).parents[3] / "llmem/setup/sources/ms_swift_presets.json").read_text())
    for name, config in presets["deepspeed"].items():
        assert json.loads((ROOT / "config" / f"{name}.json").read_text()) == config
    shipped = json.loads((ROOT / "config" / "fsdp2.json").read_text())
    assert presets["fsdp"]["fsdp2"] == {k: v for k, v in shipped.items() if not k.startswith("_")}
