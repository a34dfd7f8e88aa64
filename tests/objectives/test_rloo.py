"""--objective rloo (TRL's RLOOTrainer with transformers' generate): RLOOConfig's defaults from the installed trl,
the reference by beta and peft, the scoring phase's policy forward, the refusals, `--from` an RLOOConfig YAML, and
--objective ppo refused (trl 1.16 has no PPOTrainer)."""

from __future__ import annotations

import pytest
import yaml

from llmem import TrainingSetup, estimate
from llmem.errors import LlmemError
from llmem.setup.generation import GENERATION_DEFAULTS, completion_length, num_generations
from llmem.setup.objectives import REF_ADAPTERS_OFF, REF_COPY, REF_NONE, objective_spec, reference_mode

# tiny-llama's parameters in fp32 (two 32000 x 512 tables, 4 layers of q, k, v, o 512 x 512, gate, up, down
# 512 x 1376 and two norms, the final norm): the reference copy's weights under bf16-mixed
TINY_LLAMA_FP32_BYTES = (2 * 32000 * 512 + 4 * (4 * 512 * 512 + 3 * 512 * 1376 + 2 * 512) + 512) * 4
# the casts autocast caches in the policy's no-grad forward: its trained fp32 decoder matmul weights, in bf16
TINY_LLAMA_LAYER_CASTS_BYTES = 4 * (4 * 512 * 512 + 3 * 512 * 1376) * 2


def _rloo(**kw) -> TrainingSetup:
    base = dict(objective="rloo", precision="bf16-mixed", optimizer="sgd", batch_size=4, seq_len=32,
                max_completion_length=8)
    return TrainingSetup("tiny-llama", **{**base, **kw})


def _phase(result, name: str):
    return next(p for p in result.phases if p.name == name)


def test_rloo_config_defaults():
    """RLOOConfig's (trl 1.16) defaults that decide memory, read from the installed trl: 2 generations, 512
    completion tokens, beta 0.05, one iteration, and no loss_type field."""
    trl = pytest.importorskip("trl")
    fields = trl.RLOOConfig.__dataclass_fields__
    d = GENERATION_DEFAULTS["rloo"]
    got = {f: fields[f].default for f in ("num_generations", "max_completion_length", "beta", "num_iterations")}
    assert got == {"num_generations": 2, "max_completion_length": 512, "beta": 0.05, "num_iterations": 1}
    assert (d.num_generations, d.max_completion_length, d.beta, d.num_iterations) == (2, 512, 0.05, 1)
    assert "loss_type" not in fields and d.loss_types == ()
    s = TrainingSetup("tiny-llama", objective="rloo", batch_size=2, seq_len=1024)
    assert (num_generations(s), completion_length(s)) == (2, 512)
    assert objective_spec("rloo").trainer == "RLOOTrainer" and objective_spec("rloo").cli_command == "rloo"


def test_reference_by_beta_and_peft():
    """RLOOTrainer.__init__: beta 0.05 (the default) loads a reference copy; under peft the policy's adapters are
    disabled instead; beta 0 keeps none."""
    assert reference_mode(_rloo()) == REF_COPY
    assert reference_mode(_rloo(lora_rank=8)) == REF_ADAPTERS_OFF
    assert reference_mode(_rloo(beta=0.0)) == REF_NONE


def test_the_reference_copy_and_the_policys_scoring_forward():
    """tiny-llama full fine-tune, bf16-mixed: the default beta's reference copy adds the fp32 weights once more in
    every phase; with beta 0 RLOO's scoring phase still runs the policy under no_grad (old_per_token_logps), so it
    holds at least autocast's cached bf16 casts of the decoder's matmul weights more than GRPO's at beta 0 (which
    runs no forward there)."""
    copy, plain = estimate(_rloo()), estimate(_rloo(beta=0.0))
    for r in (copy, plain):
        assert [p.name for p in r.phases] == ["generation", "scoring", "training"]
        assert [p.name for p in r.phases if p.is_peak] == ["training"]
    for name in ("generation", "scoring", "training"):   # whole allocator blocks: within 0.5 %
        extra = _phase(copy, name).allocated_bytes - _phase(plain, name).allocated_bytes
        assert 0 <= extra - TINY_LLAMA_FP32_BYTES < 0.005 * TINY_LLAMA_FP32_BYTES, name
    grpo = estimate(TrainingSetup("tiny-llama", objective="grpo", precision="bf16-mixed", optimizer="sgd",
                                  batch_size=4, seq_len=32, num_generations=2, max_completion_length=8))
    more = _phase(plain, "scoring").allocated_bytes - _phase(grpo, "scoring").allocated_bytes
    assert more >= TINY_LLAMA_LAYER_CASTS_BYTES == 25_296_896


@pytest.mark.parametrize("kw, words", [
    (dict(loss_type="dapo"), "TRL's RLOOConfig has no loss_type"),
    (dict(num_generations=1), "--num-generations must be >= 2"),
    (dict(batch_size=3), "as RLOOConfig requires"),
    (dict(max_completion_length=32), "--seq-len 32 is the prompt plus"),
    (dict(precompute_ref_log_probs=True), "--precompute-ref-log-probs with --objective rloo"),
])
def test_refusals(kw, words):
    with pytest.raises(LlmemError, match=words):
        _rloo(**kw)


def test_rloo_config_refuses_the_same_batch():
    """RLOOConfig's own check: the generation batch (per-device batch x processes) must hold whole groups."""
    trl = pytest.importorskip("trl")
    with pytest.raises(ValueError, match="divisible by num_generations"):
        trl.RLOOConfig(output_dir="/tmp/llmem-rloo", per_device_train_batch_size=3, num_generations=2, use_cpu=True)
    with pytest.raises(LlmemError, match="--num-generations 2 must divide the generation batch"):
        _rloo(batch_size=3)


def test_ppo_is_refused_naming_what_to_use():
    """The installed trl has no PPOTrainer (trl.trainer nor trl.experimental): one line naming rloo / grpo."""
    trl = pytest.importorskip("trl")
    from pathlib import Path

    root = Path(trl.__file__).parent
    assert not hasattr(trl, "PPOTrainer") and not (root / "experimental" / "ppo").exists()
    assert not (root / "trainer" / "ppo_trainer.py").exists()
    with pytest.raises(LlmemError, match="no PPOTrainer.*use --objective rloo or grpo") as err:
        TrainingSetup("tiny-llama", objective="ppo")
    assert "\n" not in str(err.value)


def test_from_an_rloo_config(tmp_path):
    """A `trl rloo --config` YAML: the keys only RLOOConfig has tell the trainer (the trl rloo parser consumes
    every key), its generation keys read; the prompt is 512 tokens assumed, as for GRPO."""
    pytest.importorskip("trl")
    import importlib

    from llmem.setup.sources import setup_from_file

    data = {"model_name_or_path": "tiny-llama", "per_device_train_batch_size": 4, "num_generations": 4,
            "max_completion_length": 64, "beta": 0.0, "normalize_advantages": True}
    path = tmp_path / "rloo.yaml"
    path.write_text(yaml.safe_dump(data))
    parser = importlib.import_module("trl.scripts.rloo").make_parser()
    *_, unused, _ = parser.parse_args_and_config(
        ["--config", str(path), "--dataset_name", "x", "--output_dir", str(tmp_path / "out"), "--use_cpu", "true"],
        return_remaining_strings=True, separate_remaining_strings=True)
    assert not unused
    s = setup_from_file(path).setup
    assert (s.objective, s.batch_size, s.num_generations, s.max_completion_length, s.beta, s.seq_len) == \
        ("rloo", 4, 4, 64, 0.0, 512 + 64)
    assert reference_mode(s) == REF_NONE


def test_export_trl_writes_rloo_config_fields():
    """--export trl's generation fields for rloo are RLOOConfig's own (no loss_type: it has none)."""
    trl = pytest.importorskip("trl")
    from llmem.planner.export_trl import generation_config

    cfg = generation_config(_rloo(beta=0.0))
    assert set(cfg) <= set(trl.RLOOConfig.__dataclass_fields__) and "loss_type" not in cfg
    assert (cfg["num_generations"], cfg["max_completion_length"], cfg["beta"]) == (2, 8, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(), dict(lora_rank=16, optimizer="adamw"), dict(beta=0.0, batch_size=2)])
def test_each_phase_matches_the_trace(kw):
    """Each phase's allocated peak, the estimate against TRL's RLOOTrainer code traced (the CI row is the first)."""
    from llmem.runtime.trace import trace

    s = _rloo(**kw)
    est, got = estimate(s), trace(s)
    for name in ("generation", "scoring", "training"):
        a, b = _phase(est, name).allocated_bytes, _phase(got, name).allocated_bytes
        assert abs(a - b) <= 0.005 * b, (name, a, b)
    assert abs(est.peak_reserved_bytes - got.peak_reserved_bytes) <= 0.02 * got.peak_reserved_bytes
