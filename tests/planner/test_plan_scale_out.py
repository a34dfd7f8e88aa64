"""`llmem plan` over pipeline and context parallelism: the schedule's bubble, the stage split's busiest rank, the
stage-to-stage sends, the ring attention's K / V traffic (each worked out by hand), the layouts searched, and the
torchtitan export of a pipeline plan."""

import json
from types import SimpleNamespace

import pytest

from llmem.errors import LlmemError
from llmem.model.anatomy import load_anatomy
from llmem.model.resolved import assemble
from llmem.planner.engines import MemoryEngine
from llmem.planner.export import ExportPlan
from llmem.planner.export_torchtitan import torchtitan_sections
from llmem.planner.options import PlanOptions
from llmem.planner.parallel_time import busiest_stage, p2p_time_s, ring_attention_time_s
from llmem.planner.plan import plan
from llmem.planner.timing import COLLECTIVE_LATENCY_S, step_time
from llmem.setup.gpus import resolve_gpu
from llmem.setup.layout import Layout, ModelLimits, candidate_layouts
from llmem.setup.pipeline import PIPELINE_SCHEDULES
from llmem.setup.training import TrainingSetup

LAT = COLLECTIVE_LATENCY_S
# GPT-2's matmuls per token (test_planner's hand count): 12 layers of c_attn, c_proj, c_fc, mlp.c_proj; the tied head
GPT2_LAYER = 12 * (768 * 2304 + 768 * 768 + 2 * 768 * 3072)
GPT2_HEAD = 50257 * 768
A100_RATE = 312e12 * 0.4          # bf16 peak x the default MFU


def gpt2_attn_fwd(seq: int) -> float:
    return 12 * 4 * seq * 768 / 2        # scores + weighted values, causal kernels skip half


def test_bubble_of_the_flushing_schedules():
    for name in ("gpipe", "1f1b"):
        spec = PIPELINE_SCHEDULES[name]
        assert spec.bubble_fraction(4, 12) == pytest.approx(3 / 15)     # (pp - 1) / (m + pp - 1)
        assert spec.bubble_fraction(8, 8) == pytest.approx(7 / 15)
        assert spec.bubble_fraction(1, 8) == 0.0


def test_busiest_stage_of_torchtitans_split():
    a = load_anatomy("gpt2")
    # 12 layers + embedding + head = 14 effective over 4 stages: 4, 4, 3, 3 -> layers 3, 4, 3, 2 (+ head)
    assert busiest_stage(a, 4, 1, 1.0, 0.0).flops_share == pytest.approx(4 / 12)
    # a head worth 4 layers makes the last stage the busiest: 2 + 4 of 12 + 4
    last = busiest_stage(a, 4, 1, 1.0, 4.0)
    assert last.flops_share == pytest.approx(6 / 16)
    embeddings = 50257 * 768 + 1024 * 768                       # wte and wpe on the first stage
    assert last.params == a.total_params - embeddings - sum(a.layer_params(i) for i in range(10))


def test_p2p_sends_by_hand():
    # one micro-batch [2, 4096, 4096] bf16 received in forward and its gradient in backward, across nodes
    nbytes = 2 * 4096 * 4096 * 2
    assert p2p_time_s(2, 4096, 4096, 2, 1, 25.0, LAT) == pytest.approx(2 * (nbytes / 25e9 + LAT))
    assert p2p_time_s(2, 4096, 4096, 2, 2, 25.0, LAT) == pytest.approx(4 * (nbytes / 25e9 + LAT))
    # --sequence-parallel over tp 4: each stage sends its [2, 4096 / 4, 4096] shard
    assert p2p_time_s(2, 4096, 4096, 2, 1, 25.0, LAT, 4) == pytest.approx(2 * (nbytes / 4 / 25e9 + LAT))


def test_ring_attention_traffic_by_hand():
    a = SimpleNamespace(num_layers=32, num_kv_heads=8, head_dim=128)
    gather = 3 / 4 * (2 * 8192 * 8 * 128 * 2) / 300e9 + LAT          # K and V of all 8192 tokens, bf16
    rotate = (2 * 2048 * 8 * 128 * 4) / 300e9 + LAT                   # this rank's fp32 dK and dV
    idle = ring_attention_time_s(a, 1, 8192, 4, 2, 0.0, 0.0, 300.0, LAT)
    assert idle.comm_s == pytest.approx(32 * (2 * gather + 4 * rotate))  # forward + backward gather, 4 rotations
    assert idle.exposed_s == pytest.approx(idle.comm_s)                   # nothing to hide behind
    busy = ring_attention_time_s(a, 1, 8192, 4, 2, 1.0, 1.0, 300.0, LAT)  # long blocks, every layer recomputed
    assert busy.comm_s == pytest.approx(32 * (3 * gather + 4 * rotate))
    assert busy.exposed_s == pytest.approx(32 * rotate)                    # only the last rotation waits


def test_pipeline_step_time_of_gpt2_by_hand():
    a, gpu = load_anatomy("gpt2"), resolve_gpu("A100-80GB")
    setup = TrainingSetup(model="gpt2", method="single", gpus=2, pp=2, batch_size=4, seq_len=1024,
                          precision="bf16", gpu="A100-80GB")
    t = step_time(assemble(setup, a, gpu, Layout("single", 1, 1, 2, pp=2)), 1)
    # 14 effective layers over 2 stages of 7: stage 0 six layers, stage 1 six layers + the head (the busiest)
    layer = (2 * GPT2_LAYER + gpt2_attn_fwd(1024)) / 12
    share = (6 * layer + 2 * GPT2_HEAD) / (12 * layer + 2 * GPT2_HEAD)
    micro_s = share * (6 * (GPT2_LAYER + GPT2_HEAD) + 3 * gpt2_attn_fwd(1024)) * 1024 / A100_RATE
    p2p = 2 * (1024 * 768 * 2 / 300e9 + LAT)
    busy = 4 * (micro_s + p2p)
    assert t.pp_microbatches == 4 and t.global_batch_size == 4
    assert t.compute_s == pytest.approx(4 * micro_s)
    assert t.step_s == pytest.approx(busy / (1 - 1 / 5))                   # 1f1b's bubble (2 - 1) / (4 + 2 - 1)
    assert t.bubble_s == pytest.approx(busy / 4)


def test_context_parallel_step_time_of_gpt2_by_hand():
    a, gpu = load_anatomy("gpt2"), resolve_gpu("A100-80GB")
    setup = TrainingSetup(model="gpt2", method="fsdp", gpus=4, cp=2, batch_size=1, seq_len=1024, gpu="A100-80GB")
    t = step_time(assemble(setup, a, gpu, Layout("fsdp", 2, 1, 4, cp=2)), 1)
    # each rank runs 512 of the 1024 tokens, its queries against all 1024 keys
    assert t.compute_s == pytest.approx((6 * (GPT2_LAYER + GPT2_HEAD) + 3 * gpt2_attn_fwd(1024)) * 512 / A100_RATE)
    gather = 1 / 2 * (2 * 1024 * 12 * 64 * 2) / 300e9 + LAT
    rotate = (2 * 512 * 12 * 64 * 4) / 300e9 + LAT
    assert t.cp_comm_s == pytest.approx(12 * (2 * gather + 2 * rotate))
    assert t.global_batch_size == 2 and t.tokens_per_step == 2 * 1024        # cp ranks share their samples


def test_candidate_layouts_over_pp_and_cp():
    def labels(gpus: int, layers: int, seq: int, **kw) -> set[str]:
        return {lay.label for lay in candidate_layouts(gpus, 8, 32, 8, limits=ModelLimits(layers, seq), **kw)
                if lay.pp > 1 or lay.cp > 1}

    assert labels(8, 32, 4096, pp=None, cp=None) == {
        "fsdp (dp 4 x pp 2)", "fsdp (dp 2 x pp 4)", "single (pp 8)",
        "tp (tp 4 x pp 2)", "tp (tp 2 x pp 4)", "fsdp+tp (dp 2 x tp 2 x pp 2)",      # pp x tp: each stage's TP
        "fsdp (dp 4 x cp 2)", "fsdp (dp 2 x cp 4)", "fsdp (dp 1 x cp 8)"}
    # cp splits the sequence into 2 x cp chunks; pp at most one stage per layer
    assert labels(8, 2, 4100, pp=None, cp=None) == {"fsdp (dp 4 x pp 2)", "tp (tp 4 x pp 2)",
                                                    "fsdp+tp (dp 2 x tp 2 x pp 2)", "fsdp (dp 4 x cp 2)"}
    # a given degree fixes it: only those layouts
    fixed = candidate_layouts(8, 8, 32, 8, limits=ModelLimits(32, 4096), pp=4)
    assert [lay.label for lay in fixed] == ["fsdp (dp 2 x pp 4)", "tp (tp 2 x pp 4)"]
    # without the model's limits (the suggestions' and old callers' call): no pipeline or context layouts
    assert not any(lay.pp > 1 or lay.cp > 1 for lay in candidate_layouts(8, 8, 32, 8))


def test_plan_with_a_fixed_pp_searches_it_and_exports_it():
    p = plan(TrainingSetup(model="tiny-llama", gpus=4, pp=2, batch_size=2, seq_len=256, gpu="A100-80GB"))
    assert [c.layout.label for c in p.candidates] == ["fsdp (dp 2 x pp 2)"]
    best = p.recommended
    assert best.fits and best.time.pp_microbatches == 2 and best.time.bubble_s > 0
    e = ExportPlan("meta-llama/Llama-3.1-8B", "LlamaForCausalLM", best.layout, 3, 2, 256, "bf16-mixed", False,
                   False)
    sections = torchtitan_sections(SimpleNamespace(setup=p.setup, anatomy=SimpleNamespace(num_layers=32),
                                                   recommended=best), e)
    # 3 samples per pipeline micro-batch x the plan's 2 micro-batches, x 2 accumulation steps x 2 dp ranks
    assert sections["training"]["local_batch_size"] == 6 and sections["training"]["global_batch_size"] == 24
    par = sections["parallelism"]
    assert (par["pipeline_parallel_degree"], par["pipeline_parallel_microbatch_size"], par["data_parallel_shard_degree"],
            par["pipeline_parallel_schedule"]) == (2, 3, 2, "1F1B")


def test_plan_refuses_a_pp_the_model_cannot_split():
    with pytest.raises(LlmemError, match="--pp 8"):
        plan(TrainingSetup(model="tiny-llama", gpus=8, pp=8, batch_size=8, seq_len=256, gpu="A100-80GB",
                           method="single", precision="bf16"))


def test_cli_plan_with_pp_defaults_its_batch_to_the_stages(capsys):
    from llmem.cli import main

    # no --batch-size: a micro-batch of 1 per pipeline micro-batch, pp of them (Schedule1F1B takes no fewer)
    assert main(["plan", "tiny-llama", "--gpus", "4", "--pp", "2", "--seq-len", "256", "--max-batch", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended"]["label"] == "fsdp (dp 2 x pp 2)" and out["recommended"]["pp_microbatches"] == 2


def test_plan_without_scale_out_refuses_a_fixed_pp():
    with pytest.raises(LlmemError, match="--layouts dp-tp"):
        plan(TrainingSetup(model="tiny-llama", gpus=4, pp=2, batch_size=2, seq_len=256, gpu="A100-80GB"),
             PlanOptions(layouts="dp-tp"))


# --- the screen's proof that a layout cannot win (llmem.planner.search.cannot_win) ---------------------------------
# A fake engine whose fit by batch is given: "fits" (device-used 900 of a 1000-byte limit), "frag" (out of memory by
# fragmentation: replayed at the capacity; a draft, which never replays, takes it as fitting) or, past the pattern,
# "alloc" (the allocated peak alone over the capacity, so every larger batch too).
LIMIT = 1000


class PatternEngine(MemoryEngine):
    has_quick = True

    def __init__(self, pattern: dict[int, str]) -> None:
        super().__init__(None, None, LIMIT)
        self.pattern, self.fulls, self.drafts = pattern, [], []

    def _result(self, batch: int, draft: bool):
        from llmem.result import MemoryResult, OutOfMemory

        kind = self.pattern.get(batch, "alloc")
        if kind == "frag" and draft:
            kind = "fits"
        used = {"fits": 900, "frag": 1100, "alloc": 1500}[kind]
        oom = None if kind == "fits" else OutOfMemory("it0:backward", "", "activations", 1, used, used, LIMIT)
        return MemoryResult("llmem", used, used, used, LIMIT, {}, capacity_bytes=LIMIT, oom=oom,
                            by_fragmentation=kind == "frag")

    def full(self, setup, layout=None):
        self.fulls.append(setup.batch_size)
        return self._result(setup.batch_size, False)

    def draft(self, setup, layout=None):
        self.drafts.append(setup.batch_size)
        return self._result(setup.batch_size, True)


def _proof(pattern: dict[int, str], start: int, top: int = 64):
    from llmem.planner.search import PlanContext, out_of_memory_from

    engine = PatternEngine(pattern)
    ctx = PlanContext(None, None, PlanOptions(), engine, LIMIT)
    setup = TrainingSetup(model="tiny-llama", gpus=8, seq_len=256, gpu="A100-80GB")
    return out_of_memory_from(ctx, setup, Layout("fsdp", 8, 1, 8), start, top), engine


# fits to 9, not at 10, at 11 again (fragmentation), not at 12, over the capacity by allocation from 13
NOT_MONOTONE = {**{b: "fits" for b in range(1, 10)}, 10: "frag", 11: "fits", 12: "frag"}


def test_cannot_win_is_proved_only_where_no_batch_from_the_winning_one_fits():
    proved, engine = _proof(NOT_MONOTONE, 12)
    assert proved and engine.fulls == [12, 13]          # 12 out by its replay, 13 by its allocated peak: all above
    proved, engine = _proof({**NOT_MONOTONE, 12: "alloc"}, 10)
    assert not proved and engine.fulls == [10, 11]      # 11 fits: the batch search may answer it, so search it


def test_no_full_estimate_where_the_drafts_see_no_end_of_memory():
    proved, engine = _proof({b: "fits" for b in range(1, 30)}, 10)
    assert not proved and engine.fulls == [] and engine.drafts == [10, 11, 12]


def test_above_the_quick_bounds_batch_nothing_is_probed():
    proved, engine = _proof(NOT_MONOTONE, 12, top=12)   # 12 out; above it the quick bound rules every batch out
    assert proved and engine.fulls == [12]


def test_smallest_winning_batch_bisects_the_time_model(monkeypatch):
    import llmem.planner.search as search

    monkeypatch.setattr(search, "time_at_max_batch",
                        lambda ctx, setup, layout, b: SimpleNamespace(tokens_per_s=100.0 * b))
    setup = TrainingSetup(model="tiny-llama", gpus=8, seq_len=256, gpu="A100-80GB")
    lay = Layout("fsdp", 8, 1, 8)
    assert search.smallest_winning_batch(None, setup, lay, lambda tps: tps > 450, 16) == 5
    assert search.smallest_winning_batch(None, setup, lay, lambda tps: tps >= 100, 16) == 1


def test_a_layout_proved_unable_to_win_is_not_faster_when_searched(monkeypatch):
    """Two nodes of a tight GPU: every layout is screened; one the proof rules out (every batch at which its time
    model would win is out of memory), searched here on a fresh engine, is indeed not faster than the answer."""
    import llmem.planner.plan as planning
    from llmem.planner.engines import memory_engine
    from llmem.planner.search import PlanContext, attach_time

    proved, real = [], planning.cannot_win

    def spy(ctx, setup, layout, wins):
        out = real(ctx, setup, layout, wins)
        if out:
            proved.append(layout)
        return out

    monkeypatch.setattr(planning, "cannot_win", spy)
    setup = TrainingSetup(model="tiny-llama", gpus=16, seq_len=1024, gpu="A100-80GB", gpu_memory="2GiB")
    p = planning.plan(setup, PlanOptions(batch_cap=64))
    assert proved and p.recommended is not None
    ctx = PlanContext(p.anatomy, p.gpu, p.options, memory_engine("llmem", p.anatomy, p.gpu, None, p.limit_bytes),
                      p.limit_bytes)
    for layout in proved:
        c = ctx.search(setup, layout)
        attach_time(ctx, c, setup)
        assert not c.fits or c.time.tokens_per_s <= p.recommended.time.tokens_per_s, layout.label


@pytest.mark.parametrize("seq_len, memory", [(1024, "2GiB"), (8192, "3GiB")])
def test_the_screens_search_order_does_not_change_the_answer(monkeypatch, seq_len, memory):
    """The screened layouts are searched likeliest-fastest first and the rest proved out against the fastest found:
    the same answer (layout, micro-batch, tokens/s) as every layout searched, the screen off."""
    import llmem.planner.plan as planning

    setup = TrainingSetup(model="tiny-llama", gpus=16, seq_len=seq_len, gpu="A100-80GB", gpu_memory=memory)
    screened = planning.plan(setup, PlanOptions(batch_cap=64))
    monkeypatch.setattr(planning, "_screens", lambda ctx, setup: False)
    every = planning.plan(setup, PlanOptions(batch_cap=64))
    assert len(screened.candidates) < len(every.candidates)

    def answer(p):
        r = p.recommended
        return p.recommendation, r.max_batch_size, r.time.tokens_per_s

    assert screened.recommended is not None and answer(screened) == answer(every)
