"""GRPO's and RLOO's generation batch (GRPOConfig's steps_per_generation / generation_batch_size, TRL 1.16): TRL's
defaults and refusals, the batch generated over per-device batch x steps rows and scored in chunks of the per-device
batch, the buffered batch by hand, the export, and the estimate against the trace."""

from __future__ import annotations

import pytest

from llmem import TrainingSetup, estimate
from llmem.errors import LlmemError
from llmem.estimator.generation import generation_kv_bytes
from llmem.model.resolved import resolve
from llmem.setup.generation import generation_batch_size, generation_rows, steps_per_generation
from llmem.setup.objectives import scores_old_policy
from llmem.validate.matrices import CI_MATRIX


def _grpo(**kw) -> TrainingSetup:
    base = dict(objective="grpo", precision="bf16-mixed", optimizer="sgd", batch_size=4, seq_len=256,
                num_generations=4, max_completion_length=128, beta=0.04)
    return TrainingSetup("tiny-llama", **{**base, **kw})


def _phase(result, name: str):
    return next(p for p in result.phases if p.name == name)


def test_steps_per_generation_as_grpoconfig_derives_it():
    """GRPOConfig.__post_init__: gradient_accumulation_steps by default, or generation_batch_size / (per-device
    batch x processes); the generation batch is per-device batch x processes x steps."""
    assert steps_per_generation(_grpo()) == 1
    assert steps_per_generation(_grpo(gradient_accumulation_steps=8)) == 8
    assert steps_per_generation(_grpo(gradient_accumulation_steps=8, steps_per_generation=2)) == 2
    two = _grpo(method="ddp", gpus=2, batch_size=2, generation_batch_size=12)
    assert steps_per_generation(two) == 3 and generation_rows(two) == 6 and generation_batch_size(two) == 12


def test_the_same_values_as_the_installed_grpoconfig():
    trl = pytest.importorskip("trl")
    for kw, ours in ((dict(gradient_accumulation_steps=8), dict(gradient_accumulation_steps=8)),
                     (dict(generation_batch_size=12), dict(generation_batch_size=12)),
                     (dict(steps_per_generation=3, gradient_accumulation_steps=2),
                      dict(steps_per_generation=3, gradient_accumulation_steps=2))):
        config = trl.GRPOConfig(output_dir="/tmp/llmem-grpo", per_device_train_batch_size=4, num_generations=4,
                                use_cpu=True, **kw)
        s = _grpo(**ours)
        assert (config.steps_per_generation, config.generation_batch_size) == \
            (steps_per_generation(s), generation_batch_size(s))


def test_old_policy_scored_when_the_steps_are_misaligned():
    """GRPOTrainer scores the old policy when gradient_accumulation_steps % steps_per_generation != 0 (num_iterations
    1); RLOOTrainer always."""
    assert not scores_old_policy(_grpo())
    assert not scores_old_policy(_grpo(gradient_accumulation_steps=4))                  # 4 % 4
    assert not scores_old_policy(_grpo(gradient_accumulation_steps=4, steps_per_generation=2))   # 4 % 2
    assert scores_old_policy(_grpo(steps_per_generation=2))                             # 1 % 2
    assert scores_old_policy(_grpo(gradient_accumulation_steps=3, steps_per_generation=2))       # 3 % 2
    assert scores_old_policy(TrainingSetup("tiny-llama", objective="rloo", batch_size=2, seq_len=32,
                                           max_completion_length=8))


@pytest.mark.parametrize("kw, words", [
    (dict(steps_per_generation=2, generation_batch_size=8),
     "--generation-batch-size and --steps-per-generation both given .* drop one"),
    (dict(generation_batch_size=6), r"--generation-batch-size 6 must be divisible by the global batch \(--gpus 1 x "
     r"--batch-size 4 = 4\), as GRPOConfig requires: give e.g. --generation-batch-size 8"),
    (dict(batch_size=2, num_generations=8, steps_per_generation=2),
     r"--num-generations 8 must divide the generation batch \(--gpus 1 x --batch-size 2 x steps_per_generation 2 "
     r"= 4 completions\), as GRPOConfig requires \(whole prompt groups\): give --steps-per-generation 4"),
    (dict(batch_size=2, num_generations=8, generation_batch_size=12),
     r"= 12 completions\).*give --generation-batch-size 16"),
    (dict(steps_per_generation=0), "--steps-per-generation must be >= 1, got 0"),
    (dict(gradient_accumulation_steps=0), "--gradient-accumulation-steps must be >= 1, got 0"),
])
def test_refusals_name_the_fix(kw, words):
    with pytest.raises(LlmemError, match=words) as err:
        _grpo(**kw)
    assert "\n" not in str(err.value)


def test_trl_refuses_what_llmem_refuses():
    """The installed GRPOConfig raises for the same set-ups (one process on the CPU)."""
    trl = pytest.importorskip("trl")
    for kw in (dict(steps_per_generation=2, generation_batch_size=8), dict(generation_batch_size=6),
               dict(per_device_train_batch_size=2, num_generations=8, steps_per_generation=2)):
        args = {"per_device_train_batch_size": 4, "num_generations": 4, **kw}
        with pytest.raises(ValueError):
            trl.GRPOConfig(output_dir="/tmp/llmem-grpo", use_cpu=True, **args)


def test_accumulation_makes_whole_groups():
    """One completion per GPU on 2 GPUs cannot hold a group of 4 (refused before: steps_per_generation 1), but over
    2 accumulated steps the generation batch is 4: TRL's default accepts it, and so does llmem."""
    kw = dict(method="ddp", gpus=2, batch_size=1, num_generations=4)
    with pytest.raises(LlmemError, match="give --steps-per-generation 2"):
        _grpo(**kw)
    assert generation_batch_size(_grpo(**kw, gradient_accumulation_steps=2)) == 4


def test_generation_options_belong_to_the_generation_objectives():
    for kw in (dict(steps_per_generation=2), dict(generation_batch_size=8), dict(gradient_accumulation_steps=2)):
        with pytest.raises(LlmemError, match="belongs to --objective grpo or rloo"):
            TrainingSetup("tiny-llama", objective="dpo", seq_len=256, **kw)


def test_the_kv_cache_covers_the_generation_batch():
    """tiny-llama (4 layers, 8 KV heads of 64, bf16 under bf16-mixed), 4 completions per GPU over 2 steps: generate
    runs 8 rows, the cache at 256 - 1 tokens: 2 x 4 x 8 x 8 x 64 x 255 x 2 B."""
    assert generation_kv_bytes(resolve(_grpo(gradient_accumulation_steps=2))) == 16_711_680
    assert generation_kv_bytes(resolve(_grpo())) == 16_711_680 // 2


def test_the_buffered_batch_by_hand():
    """With 2 steps per generation (aligned: no old log-probs) the training phase holds the whole buffered batch:
    4 more rows than at 1 step, each prompt ids and mask [128] int64 (2 x 1024 B), completion ids and mask [128]
    int64 (2 x 1024 B) and the reference's log-probs [128] fp32 (512 B): 4 x 4608 = 18,432 B (every tensor a whole
    number of the allocator's 512-byte blocks; the advantages [rows] fp32 stay one block); the training forward
    itself runs the same 4 rows."""
    one, two = estimate(_grpo()), estimate(_grpo(gradient_accumulation_steps=2))
    assert _phase(two, "training").allocated_bytes - _phase(one, "training").allocated_bytes == 18_432


def test_scoring_runs_in_chunks_of_the_per_device_batch():
    """_get_per_token_logps_and_entropies(batch_size=per_device_train_batch_size): 4 steps' 16 rows are scored in
    chunks of 4, so the scoring's fused head holds what one chunk's does, not 4 times it; the generation's
    sampling holds the [rows, V] fp32 copies of 16 rows."""
    one, four = estimate(_grpo()), estimate(_grpo(steps_per_generation=4, gradient_accumulation_steps=4))
    assert _phase(four, "scoring").components["logits_and_loss"] == \
        _phase(one, "scoring").components["logits_and_loss"]
    assert _phase(four, "generation").components["logits_and_loss"] > \
        3 * _phase(one, "generation").components["logits_and_loss"]


def test_notes_say_the_generation_batch():
    notes = " ".join(estimate(_grpo(steps_per_generation=2)).notes)
    assert "steps_per_generation 2" in notes and "8 completions at once" in notes
    assert "old_per_token_logps" in notes and "(old-policy log-probs scored: the steps misaligned)" in notes
    assert "4 completions per GPU per step, 8 per generation (2 prompt(s) x 4 generations across 1 GPU(s))" in notes
    assert "generation batch" not in " ".join(estimate(_grpo()).notes)


def test_export_writes_the_planned_generation_batch():
    trl = pytest.importorskip("trl")
    from llmem.planner.export_trl import generation_config

    assert generation_config(_grpo())["steps_per_generation"] == 1
    assert generation_config(_grpo(gradient_accumulation_steps=4))["steps_per_generation"] == 4
    cfg = generation_config(_grpo(generation_batch_size=8))
    assert cfg["generation_batch_size"] == 8 and "steps_per_generation" not in cfg
    assert set(cfg) <= set(trl.GRPOConfig.__dataclass_fields__)


BATCHED_ROWS = [s for s in CI_MATRIX if s.objective in ("grpo", "rloo") and
                (s.steps_per_generation or s.generation_batch_size or s.gradient_accumulation_steps)]


def test_the_ci_matrix_has_generation_batch_rows():
    assert {s.objective for s in BATCHED_ROWS} == {"grpo", "rloo"}
    assert any(steps_per_generation(s) > 1 and s.lora_rank for s in BATCHED_ROWS)
    assert any(s.generation_batch_size for s in BATCHED_ROWS) and any(scores_old_policy(s) and s.objective == "grpo"
                                                                      for s in BATCHED_ROWS)


@pytest.mark.slow
@pytest.mark.parametrize("setup", BATCHED_ROWS, ids=lambda s: f"{s.objective}-{s.method}-spg{steps_per_generation(s)}")
def test_each_phase_matches_the_trace(setup):
    """Each phase's allocated peak within 0.5 %, the reserved peak within 2 %: the estimate against TRL's code
    traced over the same generation batch."""
    from llmem.runtime.trace import trace

    est, got = estimate(setup), trace(setup)
    for name in ("generation", "scoring", "training"):
        a, b = _phase(est, name).allocated_bytes, _phase(got, name).allocated_bytes
        assert abs(a - b) <= 0.005 * b, (name, a, b)
    assert abs(est.peak_reserved_bytes - got.peak_reserved_bytes) <= 0.02 * got.peak_reserved_bytes


def test_the_planner_keeps_a_given_generation_batch_as_its_steps():
    """plan varies the micro-batch: generation_batch_size 8 at --batch-size 2 on 2 GPUs is 2 steps per generation,
    kept for every batch it tries (no refusal for a batch that does not divide 8), and said in a note."""
    from llmem.planner.plan import plan

    p = plan(_grpo(method="fsdp", gpus=2, batch_size=2, seq_len=12, max_completion_length=4, generation_batch_size=8))
    assert p.setup.steps_per_generation == 2 and p.setup.generation_batch_size is None
    assert any("generation_batch_size 8 planned as steps_per_generation 2" in n for n in p.notes)
