"""--cp: the rank's tokens, the layout (FSDP2 over dp x cp), torch's ring-attention buffers worked out by hand from
torch/distributed/tensor/experimental/_context_parallel/_attention.py, and the refusals (one line each)."""

from __future__ import annotations

import pytest

from llmem.errors import LlmemError
from llmem.memory.activations.context_parallel import rank_seq_len, ring_buffers
from llmem.setup.layout import resolve_layout
from llmem.setup.training import TrainingSetup

MiB = 1 << 20


def _cp(**kw) -> TrainingSetup:
    base = dict(model="tiny-llama", method="fsdp", gpus=4, cp=2, precision="bf16-mixed", batch_size=2,
                seq_len=256)
    return TrainingSetup(**{**base, **kw})


def test_rank_tokens_and_layout():
    # head-tail load balancing: 2 x cp chunks of seq_len / (2 cp), two per rank
    assert rank_seq_len(256, 2) == 128
    assert rank_seq_len(8192, 8) == 1024
    lay = resolve_layout("fsdp", 8, None, None, 8, 8, cp=4)
    assert (lay.dp, lay.cp, lay.world_size) == (2, 4, 8)
    assert lay.shard_degree == 8                        # torchtitan's "fsdp" mesh: dp_shard x cp
    assert lay.mesh_shape == (("dp_shard", 2), ("cp", 4))
    assert "cp 4" in lay.label
    with pytest.raises(LlmemError, match="does not divide --gpus"):
        resolve_layout("fsdp", 6, None, None, 8, 8, cp=4)


def test_ring_buffers_by_hand():
    # batch 2 x 1024 local tokens, 8 query heads x 64, 4 kv heads x 64 (GQA), bf16, cp 2
    t, q_dim, kv_dim = 2 * 1024, 8 * 64, 4 * 64
    ring = ring_buffers(t, q_dim, kv_dim, 2, 2)
    kv_bf16 = 1 * MiB                                   # 2048 x 256 x 2 B (q: 2048 x 512 x 2 B = 2 MiB)
    assert ring.kv_concat_bytes == 2 * kv_bf16          # [k, v] flattened
    assert ring.kv_gathered_bytes == 2 * 2 * kv_bf16    # all-gathered over 2 ranks
    # fp32 out (4 MiB) + half partial out bf16 (1 MiB) and fp32 (2 MiB) + a merge temporary (2 MiB) + re-cat (4 MiB)
    assert ring.forward_merge_bytes == 13 * MiB
    assert ring.grad_accum_fp32_bytes == 4 * MiB + 2 * 2 * MiB          # dq, dk, dv in fp32
    assert ring.grad_rounds_bytes == (2 + 1 + 1) * MiB + (1 + 1 + 1) * MiB
    assert ring.grad_kv_rotated_bytes == 2 * 4 * MiB                    # [dk, dv] fp32 and its all-to-all output
    # the ring's backward peak as torch's code on fake tensors allocates it at this shape: 29 MiB (+ the lse chunk)
    assert ring.backward_excess_bytes == 29 * MiB
    assert ring.forward_excess_bytes == 4 * MiB + 13 * MiB
    assert ring.forward_pieces == (4 * MiB, 4 * MiB, 1 * MiB, 2 * MiB, 2 * MiB, 4 * MiB)


@pytest.mark.parametrize("kw, match", [
    (dict(seq_len=250), "divisible by 4"),
    (dict(attn="eager"), "--attn sdpa"),
    (dict(attn="flash"), "--attn sdpa"),
    (dict(packing=True), "--packing"),
    (dict(method="ddp"), "--method fsdp"),
    (dict(method="fsdp+tp", tp=2), "--method fsdp"),
    (dict(precision="fp32"), "math path"),
    (dict(lora_rank=8), "adapters"),
    (dict(cp=0), ">= 1"),
])
def test_refusals(kw, match):
    with pytest.raises(LlmemError, match=match) as err:
        _cp(**kw)
    assert "\n" not in str(err.value)


def test_cli_exit_2(capsys):
    from llmem.cli import main

    code = main(["estimate", "tiny-llama", "--method", "fsdp", "--gpus", "2", "--cp", "2", "--seq-len", "250",
                 "--precision", "bf16-mixed"])
    assert code == 2


def test_rank_activations_and_the_rings_kept_copy():
    """The rank's activations are those of seq_len / cp tokens, plus one [b, s/cp, heads x head_dim] copy per
    layer: the ring's merged output is [b, h, s, d]-contiguous, so HF's transpose(1, 2).contiguous() copies it
    (the trace at 4 x 1024, cp 2 keeps 4 x 2 MiB more in each layer's self_attn than the plain step at 4 x 512)."""
    from llmem.memory.activations.context_parallel import rank_tokens
    from llmem.memory.activations.profile import activation_profile
    from llmem.model.resolved import resolve

    ring = rank_tokens(resolve(_cp(gpus=2)))
    plain = resolve(_cp(gpus=2, cp=1, seq_len=128))
    assert ring.setup.seq_len == 128 and ring.layout.shard_degree == 2
    extra = activation_profile(ring).per_layer_saved - activation_profile(plain).per_layer_saved
    assert extra == 2 * 128 * 512 * 2                   # batch x local tokens x 8 heads x 64 x bf16


def test_torchtitan_config_reads_cp(tmp_path):
    from llmem.setup.sources import setup_from_file

    toml = tmp_path / "cp.toml"
    toml.write_text('[model]\nname = "llama3"\n[training]\nlocal_batch_size = 2\nseq_len = 256\n[parallelism]\ndata_parallel_shard_degree = 2\n'
                    'context_parallel_degree = 2\n[activation_checkpoint]\nmode = "full"\n')
    s = setup_from_file(toml, model="tiny-llama").setup
    assert (s.method, s.gpus, s.cp) == ("fsdp", 4, 2)
