"""The compiled replay loop (llmem/memory/native_replay.c) against its reference, the Python loop over CachingAllocator
(llmem.memory.phase_replay): random schedules (every pool and size class, several streams, frees in any order,
phases run more than once, expandable segments, a capacity that makes cudaMalloc fail and the cache be released)
must give the same runs, failure, statistics and component sums; what the compiled loop does not handle goes back to
the Python, whose errors the caller sees."""

from __future__ import annotations

import shutil
import sysconfig

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmem.errors import LlmemError
from llmem.estimator.engine import rank_step, replayed_step, step_schedule
from llmem.estimator.events import replay
from llmem.memory import phase_replay
from llmem.memory.phase_replay import _components_at_py, _phase_peaks_py, components_at, phase_peaks
from llmem.model.resolved import resolve
from llmem.setup.training import user_setup
from llmem.units import MIB

native = phase_replay.NATIVE


def test_the_compiled_loop_is_built_where_a_compiler_is():
    # `pip install` builds it (setup.py, optional=True): a missing module where cc exists is a broken build, which
    # would silently make every plan ten times slower
    if shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc") is None:
        pytest.skip("no C compiler here: the Python loop serves")
    assert native is not None, "llmem/memory/native_replay.c is not built: run `pip install -e .` again"


needs_native = pytest.mark.skipif(native is None, reason="the compiled loop is not built (no C compiler)")

# sizes across the allocator's classes: < 512 B, the small pool (<= 1 MiB), large under kMinLargeAlloc (10 MiB),
# large over it, and multiples of the 2 MiB rounding
SIZES = st.one_of(st.integers(1, 600), st.integers(600, MIB), st.integers(MIB + 1, 10 * MIB),
                  st.integers(10 * MIB, 80 * MIB), st.integers(1, 40).map(lambda k: k * 2 * MIB))


@st.composite
def schedules(draw):
    """(events, starts): allocations and frees of live keys in a random order, cut into phase runs."""
    events, live, next_key = [], [], 0
    for _ in range(draw(st.integers(1, 120))):
        if live and draw(st.booleans()):
            key = live.pop(draw(st.integers(0, len(live) - 1)))
            events.append((-1, key, 0, 0, "x"))
        else:
            comp = draw(st.sampled_from(["weights", "activations", "gradients"]))
            events.append((1, next_key, draw(SIZES), draw(st.integers(0, 2)), comp))
            live.append(next_key)
            next_key += 1
    cuts = sorted(draw(st.sets(st.integers(1, len(events) - 1), max_size=4))) if len(events) > 1 else []
    return events, [0, *cuts, len(events)]


@needs_native
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules(), st.booleans(), st.one_of(st.none(), st.integers(30 * MIB, 400 * MIB)))
def test_compiled_and_python_loops_agree(sched, expandable, capacity):
    events, starts = sched
    ref = _phase_peaks_py(events, starts, expandable, capacity)
    got = phase_peaks(events, starts, expandable, capacity)
    raw = native.phase_peaks(events, starts, expandable, capacity)
    assert raw is not None                  # handled by the compiled loop, not handed back
    assert got == ref
    at = sorted({r.peak_at for r in ref.runs if r.peak_at >= 0})
    assert native.components_at(events, at) == _components_at_py(events, at)


@needs_native
def test_a_capacity_that_releases_the_cache_then_fails():
    # 30 MiB freed (its segment cached), 40 MiB: at 50 MiB the cudaMalloc fails, the cache is released, the retry
    # fits; then 20 MiB more cannot fit beside the 40 (a failure at event 3, with the allocator's counts then)
    events = [(1, 0, 30 * MIB, 0, "a"), (-1, 0, 0, 0, "a"), (1, 1, 40 * MIB, 0, "a"), (1, 2, 20 * MIB, 0, "a")]
    got = native.phase_peaks(events, [0, 4], False, 50 * MIB)
    runs, failure, stats = got
    assert runs == [(40 * MIB, 40 * MIB, 2)]
    assert failure == (3, 20 * MIB, 40 * MIB, 40 * MIB)
    assert stats[7] == 2 and stats[8] == 1           # two retries (40 MiB, then 20 MiB), one OOM
    assert phase_peaks(events, [0, 4], False, 50 * MIB) == _phase_peaks_py(events, [0, 4], False, 50 * MIB)


@needs_native
@pytest.mark.parametrize("events, error", [
    ([(1, 0, -5, 0, "a")], ValueError),                  # a negative size: the reference's ValueError
    ([(-1, 7, 0, 0, "a")], KeyError),                    # a free of a key never allocated
    ([(1, 0, 1 << 64, 0, "a")], LlmemError),             # past 64-bit sizes: the reference's one-line error
    ([(1, 0, (1 << 64) - 4096, 0, "a")], LlmemError),    # rounded past the address space
])
def test_what_the_compiled_loop_does_not_handle_gets_the_references_error(events, error):
    assert native.phase_peaks(events, [0, len(events)], False, None) is None
    with pytest.raises(error):
        phase_peaks(events, [0, len(events)], False, None)


def test_components_at_sums_in_first_seen_order():
    events = [(1, 0, 10, 0, "w"), (1, 1, 5, 0, "a"), (-1, 0, 10, 0, "w"), (1, 2, 7, 0, "g")]
    # by hand: after event 1 {w: 10, a: 5}; after event 3 w is 0 (left out), a 5, g 7
    assert components_at(events, [1, 3]) == [{"w": 10, "a": 5}, {"a": 5, "g": 7}]
    assert _components_at_py(events, [1, 3]) == [{"w": 10, "a": 5}, {"a": 5, "g": 7}]


@needs_native
@pytest.mark.parametrize("flags", [
    dict(method="fsdp", gpus=4, batch_size=2),
    dict(method="ddp", gpus=2, grad_ckpt=True, expandable_segments=True),
    dict(method="single", lora_rank=8, quant_base="nf4"),
])
def test_a_real_step_replays_alike(monkeypatch, flags):
    # a whole step of tiny-llama, by both loops, uncapped and at a capacity just under its reserved peak
    s = user_setup(model="tiny-llama", seq_len=128, precision="bf16-mixed", **flags)
    r, act = rank_step(resolve(s))
    sched = step_schedule(r, act).build()
    monkeypatch.setenv("LLMEM_NATIVE_REPLAY", "off")
    ref = replay(sched, s.expandable_segments)
    ref_cap = replay(sched, s.expandable_segments, capacity_bytes=ref.peak_reserved_bytes - 2 * MIB)
    monkeypatch.delenv("LLMEM_NATIVE_REPLAY")
    assert phase_replay.native_available()
    assert replay(sched, s.expandable_segments) == ref
    assert replay(sched, s.expandable_segments, capacity_bytes=ref.peak_reserved_bytes - 2 * MIB) == ref_cap
    assert replayed_step(r, act).peak_reserved_bytes == ref.peak_reserved_bytes


@needs_native
@pytest.mark.parametrize("seed", range(4))
def test_long_schedules_with_many_cached_blocks_agree(seed):
    # thousands of events, most tensors kept a while: free lists hundreds of blocks long, as a deep model's are
    import random

    rng = random.Random(seed)
    events, live = [], []
    for key in range(4000):
        if live and rng.random() < 0.45:
            events.append((-1, live.pop(rng.randrange(len(live))), 0, 0, "x"))
        size = rng.choice([rng.randint(1, MIB), rng.randint(MIB, 12 * MIB), rng.randint(12 * MIB, 200 * MIB)])
        events.append((1, key, size, rng.randint(0, 2), rng.choice("abc")))
        live.append(key)
    starts = [0, len(events) // 3, len(events) // 2, len(events)]
    for expandable in (False, True):
        for capacity in (None, 40 << 30):
            assert phase_peaks(events, starts, expandable, capacity) == \
                _phase_peaks_py(events, starts, expandable, capacity)
