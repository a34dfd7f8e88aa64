"""--shard-embeddings (torchtune's custom_sharded_layers ['tok_embeddings', 'output']): the input embedding and the
lm_head FSDP2 units of their own, by hand.

tiny-llama: vocab 32000, hidden 512, 4 layers, untied; bf16-mixed: FSDP2 gathers in bf16 (2 bytes) and reduces in
fp32 (4 bytes). The embedding and the lm_head are 32000 x 512 = 16 384 000 elements each, the final norm 512.
Without the flag the root unit gathers all three: (2 x 16 384 000 + 512) x 2 = 65 537 024 bytes, kept from forward to
backward; with it the root gathers the norm alone (1 024 bytes), and the lm_head's backward gathers its own weight
only: 16 384 000 x 2 = 32 768 000 bytes. Each of the two units reduce-scatters 16 384 000 x 4 = 65 536 000 bytes of
fp32 gradient input into a 2-rank shard of 32 768 000 bytes."""

from __future__ import annotations

import pytest
from documented_configs import DATA, approximate

from llmem.cli import main
from llmem.errors import LlmemError
from llmem.estimator.engine import step_schedule
from llmem.memory.activations.profile import activation_profile
from llmem.model.resolved import resolve
from llmem.setup.methods import METHODS
from llmem.setup.sources import setup_from_file
from llmem.setup.support import check_support
from llmem.setup.training import TrainingSetup

VOCAB_H = 32000 * 512
NORM = 512


def _setup(**kw) -> TrainingSetup:
    base = dict(model="tiny-llama", method="fsdp", gpus=2, precision="bf16-mixed", batch_size=2, seq_len=256)
    return TrainingSetup(**{**base, **kw})


def _events(setup: TrainingSetup) -> list[tuple[str, str, int, int, str]]:
    """(phase, where, ±1, bytes, component) of each event of the step's schedule."""
    r = resolve(setup)
    sch = step_schedule(r, activation_profile(r)).build()
    starts = sch.phase_starts
    out = []
    for i, (sign, _key, size, _stream, comp) in enumerate(sch.events):
        phase = [name for at, name in starts if at <= i][-1]
        out.append((phase, sch.where(i), sign, size, comp))
    return out


def _gathered_at_layer_0(events) -> int:
    """The unsharded parameters live when the first forward reaches layer 0 (the root's, the embedding's if kept)."""
    live = 0
    for ph, where, sign, size, comp in events:
        if ph == "it0:forward" and where == "layer 0":
            return live
        live += sign * size if comp == "gathered_weights" else 0
    raise AssertionError("no layer 0 in the first forward")


def test_the_root_keeps_the_norm_alone_gathered():
    assert _gathered_at_layer_0(_events(_setup())) == (2 * VOCAB_H + NORM) * 2 == 65_537_024
    assert _gathered_at_layer_0(_events(_setup(shard_embeddings=True))) == NORM * 2 == 1_024


def test_the_lm_heads_backward_gathers_its_weight_only():
    events = _events(_setup(shard_embeddings=True))
    head = [size for ph, where, sign, size, comp in events if ph == "it1:backward" and where == "lm_head and loss"
            and sign > 0 and comp == "gathered_weights"]
    assert head == [VOCAB_H * 2] == [32_768_000]


def test_each_unit_reduce_scatters_its_own_fp32_gradient():
    events = _events(_setup(shard_embeddings=True))
    inputs = [size for ph, _w, sign, size, comp in events if ph == "it1:backward" and sign > 0
              and comp == "communication_buffers" and size == VOCAB_H * 4]
    assert len(inputs) == 2          # the lm_head's at its post-backward, the embedding's in the final callback


def test_the_peak_drops_by_the_embedding_kept_gathered():
    """The peak is in the loss's backward: without the flag the root keeps the embedding, the norm and the lm_head
    gathered (65 537 024 bytes) and the last layer is prefetched (6 326 272 bytes); with it the root keeps the norm
    (1 024 bytes) and the lm_head's prefetched all-gather output is live (32 768 000 bytes), the last layer not yet
    prefetched (the lm_head's pre-backward does it)."""
    def peak(s: TrainingSetup) -> int:
        r = resolve(s)
        return step_schedule(r, activation_profile(r)).build().peak_live_bytes
    base, own = peak(_setup()), peak(_setup(shard_embeddings=True))
    layer_bf16 = (4 * 512 * 512 + 3 * 1376 * 512 + 2 * 512) * 2         # q, k, v, o, gate, up, down, two norms
    assert layer_bf16 == 6_326_272
    assert base - own == (2 * VOCAB_H + NORM) * 2 + layer_bf16 - (NORM * 2 + VOCAB_H * 2) == 39_094_272


@pytest.mark.parametrize("kw, why", [
    ({"method": "ddp"}, "modelled under --method fsdp or zero2 only, got ddp"),
    ({"method": "fsdp+tp", "gpus": 4, "tp": 2}, "got fsdp\\+tp"),
    ({"fused_ce": True}, "--shard-embeddings with --fused-ce is not modelled"),
    ({"reshard_after_forward": 2, "gpus": 4}, "--shard-embeddings with --reshard-after-forward N"),
])
def test_refusals(kw, why):
    s = _setup(shard_embeddings=True, **kw)
    with pytest.raises(LlmemError, match=why):
        check_support(s, METHODS[s.method])


def test_tied_embeddings_are_refused_in_one_line(capsys):
    argv = ["estimate", "tiny-qwen2", "--method", "fsdp", "--gpus", "2", "--shard-embeddings"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--shard-embeddings with tied input and output embeddings is not modelled" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def _torchtune(tmp_path, sharded: str):
    text = (DATA / "torchtune" / "full-distributed.yaml").read_text()
    path = tmp_path / "c.yaml"
    path.write_text(text + f"\ncustom_sharded_layers: {sharded}\n")
    return setup_from_file(path)


def test_torchtune_custom_sharded_layers_is_the_flag(tmp_path):
    fs = _torchtune(tmp_path, "['tok_embeddings', 'output']")
    assert fs.setup.shard_embeddings is True
    assert "custom_sharded_layers" not in approximate(fs)
    assert {u.key: u.field for u in fs.record.used}["custom_sharded_layers"] == "shard_embeddings"


def test_torchtune_other_sharded_layers_stay_ignored(tmp_path):
    fs = _torchtune(tmp_path, "['decoder.tok_embeddings']")     # llama3_2_vision's configs
    assert fs.setup.shard_embeddings is False
    assert "custom_sharded_layers" in approximate(fs)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, {"grad_ckpt": True}, {"offload_param": True}])
def test_the_trace_agrees(kw):
    """torch's FSDP2 with fully_shard on the embedding and the lm_head (llmem.runtime.distributed), traced: within
    2 % on both counters (the CI matrix's rows)."""
    from llmem.validate.compare import compare_one

    row = compare_one(_setup(shard_embeddings=True, **kw), "trace")
    assert row.error == ""
    for counter in ("peak_allocated_bytes", "peak_reserved_bytes"):
        assert abs(row.error_pct(counter)) < 2.0, (counter, row.error_pct(counter))
