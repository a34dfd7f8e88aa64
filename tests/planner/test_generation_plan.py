"""`llmem plan --objective grpo`: suggestions that respect the objective, the colocated vLLM utilization the plan
chooses (checked against vLLM's pool arithmetic worked by hand), and `--export trl` of a GRPOConfig read back by
`--from`."""

from __future__ import annotations

import importlib
import math

import pytest
import yaml
from micro_model import write_config

from llmem.model.anatomy import setup_anatomy
from llmem.planner.engines import memory_engine
from llmem.planner.export import write_export
from llmem.planner.generation_plan import UTILIZATIONS
from llmem.planner.options import PlanOptions
from llmem.planner.plan import plan
from llmem.planner.search import PlanContext, limit_bytes
from llmem.planner.suggestions import full_finetune_savers, generations_suggestion, supports
from llmem.setup.generation import GENERATION_METHODS
from llmem.setup.gpus import resolve_gpu
from llmem.setup.layout import Layout
from llmem.setup.methods import METHODS
from llmem.setup.sources import setup_from_file
from llmem.setup.training import TrainingSetup

GIB, MIB = 1024**3, 1024**2
MAX_MODEL_LEN = 1024 * 1024      # vLLM's max_model_len: its KV cache must hold one such sequence to start


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> str:
    return write_config(tmp_path_factory)


def _grpo(micro: str, **kw) -> TrainingSetup:
    fields = {"model": micro, "seq_len": 64, "objective": "grpo", "num_generations": 2, "max_completion_length": 32,
              "batch_size": 2, **kw}
    return TrainingSetup(**fields)


def test_suggestions_leave_out_what_grpo_refuses(micro):
    setup = _grpo(micro, gpus=2, method="ddp")
    kinds = {sv.kind for sv in full_finetune_savers(setup, [METHODS["ddp"], METHODS["fsdp"]])}
    # GRPOTrainer: log-probs from TRL's chunked head (no --fused-ce), the optimizer after backward, no TRL
    # activation offloading modelled (llmem.setup.generation's refusals)
    assert not kinds & {"fused_ce", "optimizer_in_backward", "offload_activations"}
    assert "grad_ckpt" in kinds
    # the layouts: those the objective's step is modelled under (llmem.setup.generation's row), no other
    assert {m for m in ("ddp", "fsdp", "zero2", "tp") if supports(setup, METHODS[m])} == \
        {"ddp", "fsdp", "zero2", "tp"} & set(GENERATION_METHODS)


def test_the_chosen_utilization_is_the_lowest_vllm_starts_at(micro, tmp_path):
    """With the training batch capped (the same at every utilization) and the KV cache holding the whole batch at
    once, a larger pool buys no speed: the answer is the lowest utilization of the grid at which vLLM starts, i.e.
    whose pool, less the weights, the profile run's activations and the stated CUDA-graph / non-torch constants,
    holds one max_model_len sequence in 16-token blocks (vLLM's check), worked out here by hand."""
    device = 2 * GIB
    setup = _grpo(micro, use_vllm=True, vllm_max_model_length=MAX_MODEL_LEN, gpu="H100-80GB", gpu_memory="2GiB")
    p = plan(setup, PlanOptions(batch_cap=2, methods=("single",)))
    per_layer = 64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64   # q, o; k, v (2 kv heads x 16); MLP; 2 norms
    weights = 2 * (2 * 256 * 64 + 2 * per_layer + 64)                 # bf16: embed, lm_head, layers, final norm
    activations = 4096 * (64 + 3 * 128) * 2           # TRL's 4096 batched tokens x (hidden + gate/up + act), bf16
    block = 2 * 16 * 2 * 16 * 2 * 2                   # K and V x 16 tokens x 2 kv heads x 16 dims x bf16 x 2 layers
    need = math.ceil(MAX_MODEL_LEN / 16) * block      # 256 MiB
    fixed = 512 * MIB + 256 * MIB                     # CUDA graphs + NCCL/cuBLAS (llmem.memory.vllm's assumptions)
    lowest = min(u for u in UTILIZATIONS if int(u * device) - weights - activations - fixed >= need)
    assert lowest == 0.55                             # (256 MiB + 768 MiB + 3.9 MB) / 2 GiB = 0.5019 -> 0.55
    g = p.generation
    assert p.recommended is not None and g["generation"] == "vllm-colocate"
    assert g["vllm_gpu_memory_utilization"] == lowest
    tried = {t["utilization"]: t for t in g["vllm_chosen"]["tried"]}
    assert all(tried[u]["kv_blocks"] is None for u in UTILIZATIONS if u < lowest)     # vLLM refuses to start
    assert tried[lowest]["kv_blocks"] == (int(lowest * device) - weights - activations - fixed) // block
    assert sum(x["is_peak"] for x in g["phases"]) == 1 and "generation" in {x["name"] for x in g["phases"]}
    write_export(p, "trl", str(tmp_path / "grpo.yaml"))      # the export writes the utilization chosen
    assert yaml.safe_load((tmp_path / "grpo.yaml").read_text())["vllm_gpu_memory_utilization"] == lowest


def test_transformers_generation_gets_vllm_beside_it(micro):
    """Generating with transformers, the answer's report adds vLLM colocated at its chosen utilization (not in its
    place): with vLLM's default max_model_len, the model's max_position_embeddings (4096 tokens: 256 blocks of
    4096 bytes, 1 MiB), the lowest utilization whose pool holds it on a 2 GiB device, by hand."""
    device = 2 * GIB
    p = plan(_grpo(micro, gpu="H100-80GB", gpu_memory="2GiB"), PlanOptions(batch_cap=2, methods=("single",)))
    weights = 2 * 106816
    room = [int(u * device) - weights - 4096 * (64 + 3 * 128) * 2 - (512 + 256) * MIB for u in UTILIZATIONS]
    lowest = min(u for u, r in zip(UTILIZATIONS, room, strict=True) if r >= 256 * 4096)
    assert lowest == 0.4                              # (1 MiB + 768 MiB + 3.9 MB) / 2 GiB = 0.3788 -> 0.4
    g = p.generation
    assert g["generation"] == "transformers" and g["max_batch_size"] == p.recommended.max_batch_size
    alt = g["vllm_colocate"]
    assert alt["fits"] and alt["vllm_gpu_memory_utilization"] == lowest and alt["label"] == "single"
    assert alt["flags"] == f"--use-vllm --vllm-gpu-memory-utilization {lowest:g}"


@pytest.mark.parametrize(("objective", "config_class"), [("grpo", "GRPOConfig"), ("rloo", "RLOOConfig")])
def test_generation_trl_export_reads_back(micro, tmp_path, objective, config_class):
    """The trl CLI's own parser takes every key (nothing left over but the accelerate config) into the trainer's
    config, and llmem's --from reads both files back to the planned set-up."""
    pytest.importorskip("trl")
    setup = _grpo(micro, objective=objective, gpus=2, seq_len=512 + 32, beta=0.04, use_vllm=True,
                  vllm_gpu_memory_utilization=0.25, vllm_max_model_length=MAX_MODEL_LEN, gpu="H100-80GB",
                  gpu_memory="8GiB", grad_ckpt=True)
    p = plan(setup, PlanOptions(batch_cap=2, global_batch=8, methods=("ddp",)))
    path, beside = tmp_path / f"{objective}.yaml", tmp_path / f"{objective}.accelerate.yaml"
    e = write_export(p, "trl", str(path))
    parser = importlib.import_module(f"trl.scripts.{objective}").make_parser()
    *out, to_launch, _cli = parser.parse_args_and_config(
        ["--config", str(path), "--dataset_name", "x", "--output_dir", str(tmp_path / "out"), "--use_cpu", "true"],
        return_remaining_strings=True, separate_remaining_strings=True)
    config = out[1]
    assert type(config).__name__ == config_class and to_launch == ["--accelerate_config", str(beside)]
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps, config.steps_per_generation) \
        == (e.micro_batch_size, e.accumulation_steps, 1)
    assert (config.num_generations, config.max_completion_length, config.beta) == (2, 32, 0.04)
    assert getattr(config, "loss_type", "dapo") == "dapo"        # GRPOConfig's default loss type; RLOO has none
    assert (config.use_vllm, config.vllm_mode, config.vllm_gpu_memory_utilization, config.vllm_max_model_length,
            config.vllm_enable_sleep_mode) == (True, "colocate", 0.25, MAX_MODEL_LEN, False)
    back = setup_from_file([path, beside]).setup
    assert (back.objective, back.gpus, back.method, back.seq_len, back.batch_size, back.grad_ckpt) == \
        (objective, 2, "ddp", 544, e.micro_batch_size, True)
    assert (back.num_generations, back.max_completion_length, back.beta, back.use_vllm, back.vllm_mode,
            back.vllm_gpu_memory_utilization, back.vllm_max_model_length) == \
        (2, 32, 0.04, True, "colocate", 0.25, MAX_MODEL_LEN)


def test_fewer_generations_is_the_largest_whose_smallest_batch_fits(micro):
    """On one GPU GRPOConfig makes the micro-batch a multiple of num_generations: when 8 completions do not fit,
    the suggestion is the largest count whose own plan (a separate search, batch = the count) fits."""
    fields = {"seq_len": 4096, "max_completion_length": 2048, "gpu": "H100-80GB", "gpu_memory": "500MiB",
              "cuda_context": "0"}
    options = PlanOptions(batch_cap=16, methods=("single",))
    setup = _grpo(micro, num_generations=8, batch_size=8, **fields)
    anatomy, gpu = setup_anatomy(setup), resolve_gpu(setup.gpu, setup.gpu_memory, setup.cuda_context)
    limit = limit_bytes(gpu, options.headroom)
    ctx = PlanContext(anatomy, gpu, options, memory_engine(options.engine, anatomy, gpu, None, limit), limit)
    single = Layout("single", 1, 1, 1)
    assert not ctx.search(setup, single).fits
    sug = generations_suggestion(ctx, setup, [single])
    largest = next(g for g in range(7, 1, -1)                 # the batch search of each count on its own
                   if ctx.search(_grpo(micro, num_generations=g, batch_size=g, **fields), single).fits)
    assert sug["fits"] and sug["changes"]["num_generations"] == largest and sug["max_batch_size"] == largest


def test_vllm_decodes_in_waves_of_what_its_kv_cache_holds(micro):
    """vLLM's generation time (llmem.planner.generation_time): the batch in waves of the sequences the pool's KV
    blocks hold at once, each decode step reading vLLM's weights and the wave's cache at the memory bandwidth
    (FLOP terms switched off with an unbounded rate); the pool worked out by hand."""
    from llmem.model.resolved import resolve
    from llmem.planner.generation_time import vllm_generation_s, vllm_waves

    batch, device, u = 4000, 2 * GIB, 0.4
    s = _grpo(micro, batch_size=batch, use_vllm=True, vllm_gpu_memory_utilization=u, vllm_max_model_length=64,
              gpu="H100-80GB", gpu_memory="2GiB")
    r = resolve(s)
    weights = 2 * 106816                                   # the micro model's parameters in bf16 (as above)
    sampler = 2 * batch * 256 * 4                          # max_num_seqs = batch rows of fp32 logits, twice
    room = int(u * device) - weights - max(4096 * (64 + 3 * 128) * 2, sampler) - (512 + 256) * MIB
    at_once = (room // 4096) // (64 // 16)                 # blocks of 4096 bytes; 4 blocks per 64-token sequence
    assert (at_once, -(-batch // at_once)) == vllm_waves(r, batch) == (2763, 2)
    p, c = 32, 32
    per_step = (weights + at_once * 256 * (p + c / 2)) / (r.gpu.memory_gbps * 1e9)   # 256 bytes of K+V a token
    assert vllm_generation_s(r, batch, 1.0, 1e30, 0.0) == pytest.approx(2 * (c - 1) * per_step, rel=1e-9)


def test_generation_is_amortised_over_the_steps_it_serves(micro):
    """TRL generates --batch-size x steps_per_generation completions at once and trains steps_per_generation
    micro-steps on them: each micro-step is charged 1/steps_per_generation of the batch's generation and scoring
    (llmem.planner.generation_time), not one micro-batch's. By hand, FLOP terms off (an unbounded rate): bf16
    weights 2 x 106816 bytes read once per decode step; K+V 2 layers x 2 x 2 heads x 16 x 2 bytes = 256 bytes a
    token a row, on average over prompt 32 + half of completion 32 = 48 tokens; 31 decode steps; the reference's
    forward (beta > 0) 0.5 s per --batch-size chunk."""
    from llmem.model.resolved import resolve
    from llmem.planner.generation_time import generation_time_s

    weights, bandwidth, fwd_s = 2 * 106816, 3350e9, 0.5

    def per_step_s(batch: int, steps: int, forward_s: float) -> float:
        r = resolve(_grpo(micro, batch_size=batch, precision="bf16", beta=0.04, gpu="H100-80GB",
                          steps_per_generation=steps))
        assert r.gpu.memory_gbps * 1e9 == bandwidth
        return generation_time_s(r, batch, 1.0, 1e30, 0.0, forward_s)

    one = 31 * (weights + 2 * 256 * 48) / bandwidth + fwd_s                 # batch 2, steps_per_generation 1
    assert per_step_s(2, 1, fwd_s) == pytest.approx(one, rel=1e-9)
    # steps_per_generation 2: 4 rows decoded at once, 2 chunks scored, halved: 0.5 s + 1.2159 us vs 0.5 s + 2.2043 us
    two = (31 * (weights + 4 * 256 * 48) / bandwidth + 2 * fwd_s) / 2
    assert per_step_s(2, 2, fwd_s) == pytest.approx(two, rel=1e-9)
    assert two - fwd_s == pytest.approx(1.2159e-6, rel=1e-4) and one - fwd_s == pytest.approx(2.2043e-6, rel=1e-4)
    # half the generation time of the doubled batch (batch 4 at steps_per_generation 1, its forward 2 x 0.5 s)
    assert per_step_s(2, 2, fwd_s) == pytest.approx(per_step_s(4, 1, 2 * fwd_s) / 2, rel=1e-12)
    p = plan(_grpo(micro, gpu="H100-80GB", steps_per_generation=2), PlanOptions(batch_cap=2, methods=("single",)))
    assert "every 2 micro-steps" in p.generation["generation_time"]
    assert "generation_time" not in plan(_grpo(micro, gpu="H100-80GB"),
                                         PlanOptions(batch_cap=2, methods=("single",))).generation


def test_pruned_utilization_search_is_the_exhaustive_one(monkeypatch):
    """The bound-ordered search (a utilization whose tokens/s bound cannot beat the fastest found is not searched)
    answers as searching every utilization does, where vLLM's waves grow with the batch (its sampler's rows take
    KV blocks: the bound times one wave)."""
    from llmem.planner import generation_plan

    setup = TrainingSetup("tiny-llama", objective="grpo", batch_size=8, seq_len=2048, max_completion_length=1024,
                          use_vllm=True, gpu="RTX4090")
    options = PlanOptions(methods=("single",))
    anatomy, gpu = setup_anatomy(setup), resolve_gpu(setup.gpu)
    limit = limit_bytes(gpu, options.headroom)
    ctx = PlanContext(anatomy, gpu, options, memory_engine(options.engine, anatomy, gpu, None, limit), limit)
    single = Layout("single", 1, 1, 1)
    c, _, pruned = generation_plan.choose_utilization(ctx, setup, single)
    monkeypatch.setattr(generation_plan, "_tokens_per_s_bound", lambda *a: float("inf"))
    d, _, every = generation_plan.choose_utilization(ctx, setup, single)
    assert any(t.pruned for t in pruned.tries) and not any(t.pruned for t in every.tries)
    assert (pruned.utilization, c.max_batch_size, c.time.tokens_per_s) == \
        (every.utilization, d.max_batch_size, d.time.tokens_per_s)


def test_a_colocated_plan_tells_a_layouts_own_refusal_as_it_is():
    # GRPO with vLLM colocated on 2 GPUs: fsdp dp 1 x cp 2 is refused for the objective (context parallelism under
    # TRL's trainers), as the same plan without vLLM refuses it: not as vLLM failing to start at every utilization
    kw = dict(model="tiny-llama", method="fsdp", gpus=2, precision="bf16-mixed", optimizer="sgd", batch_size=2,
              seq_len=16, objective="grpo", num_generations=2, max_completion_length=4, lora_rank=8)
    colocated = plan(TrainingSetup(**kw, use_vllm=True), PlanOptions(batch_cap=4))
    plain = plan(TrainingSetup(**{**kw, "lora_rank": 0}), PlanOptions(batch_cap=4))   # (peft's generate: no LoRA)
    cp = "fsdp (dp 1 x cp 2) skipped: --cp with --objective grpo: context parallelism under TRL's trainers"
    assert any(n.startswith(cp) for n in colocated.notes)
    assert any(cp in n for n in plain.notes)
    assert not any("vLLM colocated would not start" in n and "--cp" in n for n in colocated.notes)
