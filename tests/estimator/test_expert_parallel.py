"""--ep: torchtitan's expert parallelism under FSDP2. The experts' shards worked out by hand (experts / ep local
experts, then FSDP2's dim-0 shard over efsdp = dp / ep), the all-to-all rows and buffers (tokens x top_k routed
rows, hidden wide, in the compute dtype) from torchtitan's token_dispatcher.py, its rank-major -> expert-major
permutation on a small hand example, and the refusals (one line each)."""

from __future__ import annotations

import pytest
import torch

from llmem.errors import LlmemError
from llmem.model.resolved import resolve
from llmem.model.sharding import fsdp_unit_numel, local_shape
from llmem.setup.expert_parallel import effective_imbalance, received_rows, split_sizes
from llmem.setup.training import TrainingSetup


def _ep(**kw) -> TrainingSetup:
    base = dict(model="tiny-qwen3-moe", method="fsdp", gpus=4, ep=2, precision="bf16-mixed", batch_size=2,
                seq_len=256)
    return TrainingSetup(**{**base, **kw})


def _param(r, name: str):
    return next(p for p in r.anatomy.params if p.name == name)


def test_expert_shards_by_hand():
    # tiny-qwen3-moe: 8 experts, gate_up_proj [8, 2 x 256, 256], q_proj [4 heads x 64, 256]; 4 GPUs, ep 2
    r = resolve(_ep())
    lay = r.layout
    assert (lay.ep, lay.shard_degree, lay.expert_shard_degree) == (2, 4, 2)
    gate_up = _param(r, "model.layers.1.mlp.experts.gate_up_proj")
    q = _param(r, "model.layers.1.self_attn.q_proj.weight")
    assert local_shape(gate_up, lay) == (2, 512, 256)          # 8 / ep 2 = 4 local experts, / efsdp 2 = 2
    assert fsdp_unit_numel([gate_up], lay) == 4 * 512 * 256    # all-gathered over efsdp: the 4 local experts
    assert local_shape(q, lay) == (64, 256)                    # dense: 256 / dp 4, as without ep
    assert fsdp_unit_numel([q], lay) == 256 * 256
    plain = resolve(_ep(ep=1)).layout
    assert local_shape(gate_up, plain) == (2, 512, 256)        # the same bytes at rest ...
    assert fsdp_unit_numel([gate_up], plain) == 8 * 512 * 256  # ... but every expert gathered without ep
    # per rank at rest under bf16-mixed: fp32 master shard 2 x 512 x 256 x 4 B = 1 MiB; gathered in bf16 1 MiB
    assert 2 * 512 * 256 * 4 == 1 << 20 == 4 * 512 * 256 * 2


def test_received_rows_and_all_to_all_buffers():
    # 2 x 256 tokens x top-2 = 1024 routed rows; balanced, each rank receives what it sends
    assert received_rows(512, 2, 2, 1.0) == 1024
    assert received_rows(512, 2, 2, 1.5) == 1536               # the busiest rank, scaled by --ep-imbalance
    assert received_rows(512, 2, 1, 3.0) == 1024               # no ep: every row stays local
    assert split_sizes(1024, 2) == [512, 512] and split_sizes(5, 2) == [3, 2]
    # an imbalance is taken in 1/64ths (the learning copy's tokens are multiples of 64): 1.3 -> 84 / 64 = 1.3125
    assert effective_imbalance(1.3) == 1.3125 and effective_imbalance(1.5) == 1.5
    assert received_rows(512, 2, 2, 1.3) == 1024 * 84 // 64 == 1344
    # the dispatch output: 1024 rows x hidden 256 x bf16 = 512 KiB (the learned EP block's a2a buffers)
    assert received_rows(512, 2, 2, 1.0) * 256 * 2 == 512 * 1024


def test_ep_forward_all_to_all_shapes(monkeypatch):
    """The EP forward on fake tensors: the dispatch all-to-all returns the received rows, the combine the sent
    ones, hidden wide in the compute dtype; the output is the tokens' [T, D]."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from llmem.runtime import expert_parallel as xp

    config = AutoConfig.for_model("qwen3_moe", hidden_size=16, moe_intermediate_size=8, num_experts=4,
                                  num_experts_per_tok=2)
    seen: list[tuple[tuple[int, ...], torch.dtype]] = []
    real = xp._all_to_all

    def recording(x, out_splits, in_splits, plan):
        out = real(x, out_splits, in_splits, plan)
        seen.append((tuple(out.shape), out.dtype))
        return out

    monkeypatch.setattr(xp, "_all_to_all", recording)
    experts = Qwen3MoeExperts(config).to(torch.bfloat16)
    xp.apply_expert_parallel(experts, xp.ExpertParallel(2, 1.5), fake=True)
    assert experts.gate_up_proj.shape == (2, 16, 16) and experts.num_experts == 2   # 4 / ep 2 local experts
    with FakeTensorMode(allow_non_fake_inputs=True):
        tokens = torch.empty(6, 16, dtype=torch.bfloat16)
        ids = torch.zeros(6, 2, dtype=torch.int64)
        out = experts(tokens, ids, torch.empty(6, 2, dtype=torch.bfloat16))
    # 6 tokens x top-2 = 12 rows sent; received 12 x 1.5 = 18 (dispatch), the 12 sent back (combine)
    assert seen == [((18, 16), torch.bfloat16), ((12, 16), torch.bfloat16)]
    assert tuple(out.shape) == (6, 16)


def test_permute_rank_major_to_expert_major():
    from llmem.runtime.expert_parallel import _permute

    # ep 2 x 2 local experts, counts rank-major: (e0, r0) = 1, (e1, r0) = 2, (e0, r1) = 3, (e1, r1) = 0
    routed = torch.arange(6.0).unsqueeze(1)
    shape, out, index, local = _permute(routed, torch.tensor([1, 2, 3, 0]), 2)
    assert index.tolist() == [0, 3, 4, 5, 1, 2]          # e0's rows from r0 then r1, then e1's
    assert out.squeeze(1).tolist() == [0.0, 3.0, 4.0, 5.0, 1.0, 2.0] and local.tolist() == [4, 2]
    assert tuple(shape) == (6, 1)


@pytest.mark.parametrize("kw,message", [
    ({"method": "ddp"}, "--ep runs under --method fsdp"),
    ({"gpus": 4, "ep": 3}, "does not divide the 4 FSDP2 ranks"),
    ({"ep_imbalance": 0.5}, "--ep-imbalance"),
    ({"ep": 1, "ep_imbalance": 2.0}, "add --ep N"),
    ({"cp": 2}, "--ep with --pp, --dp-replicate, --tp or --cp"),
    ({"lora_rank": 8}, "adapters"),
])
def test_setup_refusals(kw, message):
    with pytest.raises(LlmemError, match=message.replace("-", r"\-").replace("(", r"\(")):
        _ep(**kw)


def test_model_refusals():
    with pytest.raises(LlmemError, match="this model is dense"):
        resolve(_ep(model="tiny-llama"))
    with pytest.raises(LlmemError, match="does not divide the model's 8 routed experts"):
        resolve(_ep(gpus=6, ep=3))
    with pytest.raises(LlmemError, match="more than the 8 routed experts"):    # torchtitan's Shard(1) case
        resolve(_ep(gpus=16, ep=2))


def test_plan_and_paper_refuse_ep():
    from llmem.paper.engine import paper_estimate
    from llmem.planner.options import PlanOptions
    from llmem.planner.plan import plan

    # plan searches ep layouts (tests/planner/test_plan_ep.py) under the llmem engine and the time ranking only
    with pytest.raises(LlmemError, match="--ep searches with the llmem engine"):
        plan(_ep(), PlanOptions(ranking="paper"))
    with pytest.raises(LlmemError, match="no expert parallelism"):
        paper_estimate(_ep(), None, None)      # refused before the model is read


def test_alltoall_time_by_hand():
    from llmem.planner.timing import ep_alltoall_time_s

    latency_s = 10e-6          # one NCCL collective's fixed cost (timing.py's COLLECTIVE_LATENCY_S)

    r = resolve(_ep())
    # 4 MoE layers x (dispatch + combine) x (forward + backward); 1024 rows x 256 x 2 B, half to the other rank
    moved = 1024 * 256 * 2 / 2
    assert ep_alltoall_time_s(r, 2, 100.0) == pytest.approx(16 * (moved / 100e9 + latency_s))
    assert ep_alltoall_time_s(resolve(_ep(ep=1)), 2, 100.0) == 0.0


def test_torchtitan_config_reads_ep(tmp_path):
    from llmem.setup.sources import setup_from_file

    toml = tmp_path / "ep.toml"
    toml.write_text('[model]\nname = "qwen3"\n[training]\nlocal_batch_size = 2\nseq_len = 256\n[parallelism]\n'
                    'data_parallel_shard_degree = 4\nexpert_parallel_degree = 2\n[activation_checkpoint]\nmode = "none"\n')
    s = setup_from_file(toml, model="tiny-qwen3-moe").setup
    assert (s.method, s.gpus, s.ep) == ("fsdp", 4, 2)        # ep borrows from dp_shard: 4 GPUs, not 8


def test_torchtitan_export_round_trip(tmp_path):
    """expert_parallel_degree written from the layout and read back (`plan` does not search --ep yet: the exporter
    is given an ep layout directly)."""
    from types import SimpleNamespace

    from llmem.planner.export_torchtitan import export_torchtitan
    from llmem.setup.layout import Layout
    from llmem.setup.sources import setup_from_file

    setup = _ep(model="meta-llama/Llama-3.2-1B", ep=1)
    p = SimpleNamespace(setup=setup, anatomy=None)
    e = SimpleNamespace(layout=Layout("fsdp", 4, 1, 4, ep=2), model="meta-llama/Llama-3.2-1B",
                        precision="bf16-mixed", optimizer="adamw", offload_optimizer=False,
                        cpu_offload_policy=False, micro_batch_size=2, accumulation_steps=1, seq_len=256,
                        grad_ckpt=False, gpus_per_node=None)
    path = tmp_path / "ep.toml"
    path.write_text(export_torchtitan(p, e))
    import tomllib

    assert tomllib.loads(path.read_text())["parallelism"]["expert_parallel_degree"] == 2
    back = setup_from_file(str(path), model="tiny-qwen3-moe").setup
    assert (back.method, back.gpus, back.ep) == ("fsdp", 4, 2)


def test_estimate_refuses_ep_without_learned_activations():
    """The tests run with LLMEM_LEARN=never: --ep's all-to-all buffers exist only in the learned EP forward, so
    the estimate refuses rather than fall back to a recipe without them."""
    from llmem.estimator.engine import estimate, quick_peak_allocated, step_verdict
    from llmem.model.resolved import resolve

    # every engine a search uses: the full estimate, the planner's quick bound and the verdict
    for run in (lambda: estimate(_ep()), lambda: quick_peak_allocated(resolve(_ep())),
                lambda: step_verdict(resolve(_ep()), 80 * 2**30)):
        with pytest.raises(LlmemError, match="--ep needs the activations learned"):
            run()
