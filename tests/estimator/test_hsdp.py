"""FSDP2's HSDP (--dp-replicate N): the dp ranks as N replicas, each FSDP-sharded over dp / N ranks, by hand.
tiny-llama: hidden 512, 4 layers of q, k, v, o 512 x 512, gate, up, down 512 x 1376 and two norms, embed_tokens and
lm_head 32000 x 512 each, the final norm 512 (45,421,056 parameters)."""

from __future__ import annotations

import pytest

from llmem.cli import main
from llmem.errors import LlmemError
from llmem.estimator.states import model_states
from llmem.model.anatomy import load_anatomy
from llmem.model.resolved import assemble, resolve
from llmem.planner.export import ExportPlan, export_accelerate, train_script_args
from llmem.planner.timing import COLLECTIVE_LATENCY_S, comm_sizes, step_time
from llmem.runtime import train_script
from llmem.setup.gpus import resolve_gpu
from llmem.setup.layout import Layout, candidate_layouts, resolve_layout
from llmem.setup.training import TrainingSetup

LAYER = 4 * 512 * 512 + 3 * 512 * 1376 + 2 * 512          # 3,163,136
EMBED = 32000 * 512
TOTAL = 2 * EMBED + 512 + 4 * LAYER                        # 45,421,056


def _shard_numel(shards: int) -> int:
    """Rank 0's FSDP2 shard of every tiny-llama parameter: dim 0 split in ceil(rows / shards)."""
    rows = {(512, 512): 4, (1376, 512): 2, (512, 1376): 1, (512,): 2}   # per layer: q k v o, gate up, down, norms
    per_layer = sum(n * -(-shape[0] // shards) * (shape[1] if len(shape) > 1 else 1) for shape, n in rows.items())
    return 4 * per_layer + 2 * -(-32000 // shards) * 512 + -(-512 // shards)


def test_layout_shards_within_each_replica():
    lay = resolve_layout("fsdp", 16, None, 8, 0, 0, replicas=2)
    assert (lay.dp, lay.replicas, lay.shard_degree) == (16, 2, 8)
    assert lay.mesh_shape == (("dp_replicate", 2), ("dp_shard", 8))
    two_d = resolve_layout("fsdp+tp", 16, 2, 8, 8, 8, replicas=2)
    assert two_d.mesh_shape == (("dp_replicate", 2), ("dp_shard", 4), ("tp", 2))
    assert two_d.label == "fsdp+tp (2x4dp x 2tp) hsdp"


def test_model_states_are_those_of_the_shard_group():
    """fp32 AdamW under HSDP 2 x 2 on 4 GPUs: rank 0 holds half of each parameter (2-way shards, dim 0 rounded
    up), for weights, gradients and both moments alike; plain FSDP on 4 GPUs a quarter."""
    ms = model_states(resolve(TrainingSetup(model="tiny-llama", method="fsdp", gpus=4, dp_replicate=2,
                                            precision="fp32", seq_len=64)))
    shard = _shard_numel(2)
    assert shard == TOTAL // 2                              # every dim 0 here is even
    assert (ms.weights, ms.gradients, ms.optimizer_states) == (shard * 4, shard * 4, 2 * shard * 4)
    plain = model_states(resolve(TrainingSetup(model="tiny-llama", method="fsdp", gpus=4, precision="fp32",
                                               seq_len=64)))
    assert plain.weights == _shard_numel(4) * 4 < ms.weights


def test_multi_node_plans_also_search_hsdp_within_a_node():
    labels = [lay.label for lay in candidate_layouts(16, 8, 32, 8)]
    assert "fsdp (2x8) hsdp" in labels and "zero2 (2x8) hsdp" in labels and "fsdp+tp (2x4dp x 2tp) hsdp" in labels
    assert not any("hsdp" in lay.label for lay in candidate_layouts(8, 8, 32, 8))   # one node: nothing to replicate


def test_time_model_gathers_inside_the_node_and_all_reduces_the_shards_across():
    """Llama-3.1-8B bf16-mixed on 2 nodes of 8 A100s (300 GB/s NVLink, 25 GB/s across): HSDP's all-gathers run over
    8 ranks on NVLink, its reduce-scatter too, then each rank's fp32 gradient shard is all-reduced over the 2
    replicas across nodes; FSDP over 16 runs every collective at 25 GB/s."""
    anatomy, gpu = load_anatomy("meta-llama/Llama-3.1-8B"), resolve_gpu("A100-80GB")
    setup = TrainingSetup(model="meta-llama/Llama-3.1-8B", method="fsdp", gpus=16, gpus_per_node=8, seq_len=2048)
    hsdp, fsdp = resolve_layout("fsdp", 16, None, 8, 32, 8, replicas=2), resolve_layout("fsdp", 16, None, 8, 32, 8)
    c = comm_sizes(anatomy, setup, hsdp, 1, 1.0)
    total = anatomy.total_params
    assert c.fsdp_gather_bytes == total * 2 and c.fsdp_reduce_bytes == total * 4     # bf16 gathered, fp32 reduced
    lat = anatomy.num_layers * COLLECTIVE_LATENCY_S          # one per unit (layers + root), one inside each ring
    ag = 7 / 8 * total * 2 / 300e9 + COLLECTIVE_LATENCY_S + lat
    replica_ar = 2 * (1 / 2) * (total * 4 / 8) / 25e9 + COLLECTIVE_LATENCY_S   # rank 0's fp32 shard, 2 replicas
    rs = 7 / 8 * total * 4 / 300e9 + COLLECTIVE_LATENCY_S + lat + replica_ar
    t_h = step_time(assemble(setup, anatomy, gpu, hsdp), 1, 1)
    assert t_h.dp_comm_s == pytest.approx(2 * ag + rs, rel=1e-9)   # gathered in forward and again in backward
    t_f = step_time(assemble(setup, anatomy, gpu, fsdp), 1, 1)
    assert t_f.dp_comm_s == pytest.approx(2 * (15 / 16 * total * 2 / 25e9 + COLLECTIVE_LATENCY_S + lat)
                                          + 15 / 16 * total * 4 / 25e9 + COLLECTIVE_LATENCY_S + lat, rel=1e-9)


def test_refusals_name_the_fix(capsys):
    with pytest.raises(LlmemError, match="use --method fsdp, zero2 or fsdp\\+tp"):
        TrainingSetup(model="tiny-llama", method="ddp", gpus=4, dp_replicate=2)
    with pytest.raises(LlmemError, match="does not divide the 4 data-parallel ranks"):
        resolve(TrainingSetup(model="tiny-llama", method="fsdp", gpus=4, dp_replicate=3))
    assert main(["estimate", "tiny-llama", "--method", "fsdp", "--gpus", "4", "--dp-replicate", "0"]) == 2
    err = capsys.readouterr().err
    assert "--dp-replicate must be >= 1" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_exports_carry_the_replicas():
    e = ExportPlan("meta-llama/Llama-3.1-8B", "LlamaForCausalLM", Layout("fsdp", 16, 1, 8, replicas=2), 2, 1, 2048,
                   "bf16-mixed", True, False, "adamw")
    args = train_script.build_parser().parse_args(train_script_args(e))
    assert (args.dp, args.dp_replicate) == (16, 2)
    import yaml

    cfg = yaml.safe_load(export_accelerate(e, "LlamaDecoderLayer"))
    pc = cfg["parallelism_config"]
    assert (pc["parallelism_config_dp_replicate_size"], pc["parallelism_config_dp_shard_size"]) == (2, 8)


def test_torchtitan_replicate_degree_is_read(tmp_path):
    from llmem.setup.sources import setup_from_file

    toml = tmp_path / "job.toml"
    toml.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ndata_parallel_shard_degree = 8\n'
                    'data_parallel_replicate_degree = 2\n[training]\nseq_len = 2048\nlocal_batch_size = 1\n')
    got = setup_from_file(str(toml), model="meta-llama/Llama-3.1-8B")
    assert (got.setup.method, got.setup.gpus, got.setup.dp_replicate) == ("fsdp", 16, 2)
