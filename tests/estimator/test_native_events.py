"""The compiled event log (llmem/estimator/native_events.c) against its reference, llmem.estimator.events.EventLog:
random operations (allocations above and below min_bytes, one at a time, several at once and a block plan's kept
tensors and temporaries, frees of live keys and of -1, free_all of lists, size_of, a stop above some live bytes) must leave the same events, keys, live bytes and peaks, and raise the same errors; and
a real step's schedule built on each is the same."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import sysconfig

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmem.estimator import events
from llmem.estimator.engine import rank_step, step_schedule
from llmem.model.resolved import resolve
from llmem.setup.training import TrainingSetup

native = events._NATIVE
needs_native = pytest.mark.skipif(native is None, reason="the compiled event log is not built (no C compiler)")


def test_the_compiled_log_is_built_where_a_compiler_is():
    # `pip install` builds it (setup.py, optional=True): a missing module where cc exists is a broken build
    cc = sysconfig.get_config_var("CC")
    if shutil.which(cc.split()[0] if cc else "cc") is None:
        pytest.skip("no C compiler here: the Python log serves")
    assert native is not None, "llmem/estimator/native_events.c is not built: run `pip install -e .` again"
    assert issubclass(events.Schedule, native.EventLog)


OPS = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 5000), st.sampled_from(["weights", "activations"]), st.integers(0, 2)),
    st.tuples(st.just("free"), st.integers(0, 40)),
    st.tuples(st.just("free_all"), st.lists(st.integers(0, 40), max_size=4, unique=True)),
    st.tuples(st.just("size_of"), st.integers(-1, 40)),
    st.tuples(st.just("free_minus_one")),
    st.tuples(st.just("alloc_many"), st.lists(st.integers(0, 5000), max_size=5)),
    st.tuples(st.just("play_block"), st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5000), st.integers(0, 3)),
                                              max_size=8)),
), max_size=80)


def _run(log, ops: list, min_bytes: int, stop: int | None) -> list:
    """Each operation's outcome (its value, or its error's type and value) and the log's fields after it."""
    log.min_bytes, log.stop_above_bytes = min_bytes, stop
    out, live = [], []
    for op in ops:
        try:
            if op[0] == "alloc":
                key = log.alloc(op[1], op[2], op[3]) if op[3] else log.alloc(op[1], op[2])
                live.append(key)
                got = key
            elif op[0] == "free":
                got = log.free(live[op[1] % len(live)] if live else 7)
            elif op[0] == "free_all":
                keys = [live[i % len(live)] for i in op[1]] if live else []
                got = (log.free_all(keys), keys)
            elif op[0] == "alloc_many":
                got = log.alloc_many(op[1], "activations")
                live += got
            elif op[0] == "play_block":     # a plan frees only the temporaries it made (else KeyError, as a dict)
                got = log.play_block(op[1], "activations")
                live += got
            elif op[0] == "size_of":
                got = log.size_of(live[op[1] % len(live)] if live and op[1] >= 0 else -1)
            else:
                got = log.free(-1)
        except (KeyError, events.LiveBytesOver) as exc:
            got = (type(exc).__name__, str(exc), getattr(exc, "live_bytes", None))
        out.append((got, list(log.events), dict(log._live), log._next, log.live_bytes, log.peak_live_bytes))
    return out


@needs_native
@settings(max_examples=300, deadline=None)
@given(OPS, st.integers(0, 600), st.one_of(st.none(), st.integers(0, 40000)))
def test_random_operations_leave_the_same_log(ops, min_bytes, stop):
    assert _run(native.EventLog(), ops, min_bytes, stop) == _run(events.EventLog(), ops, min_bytes, stop)


@needs_native
def test_what_the_compiled_log_refuses():
    """Sizes and keys are ints (the Python reference would take a float size; no builder passes one)."""
    log = native.EventLog()
    with pytest.raises(TypeError):
        log.alloc(1.5, "activations")
    with pytest.raises(TypeError):
        log.free("0")
    with pytest.raises(TypeError):
        log.free_all((0,))
    with pytest.raises(TypeError):
        log.events = ()


_BUILD = """
import pickle, sys
from llmem.estimator import events
from llmem.estimator.engine import rank_step, step_schedule
from llmem.model.resolved import resolve
from llmem.setup.training import TrainingSetup
assert events._LogBase is events.EventLog
r, act = rank_step(resolve(TrainingSetup(model="tiny-llama", seq_len=128, batch_size=2, **eval(sys.argv[1]))))
s = step_schedule(r, act).build()
sys.stdout.buffer.write(pickle.dumps((s.events, s.phase_starts, s.marks)))
"""


@needs_native
@pytest.mark.parametrize("kw", [dict(), dict(method="fsdp", gpus=4, grad_ckpt=True),
                                dict(method="ds-zero3", gpus=2, lora_rank=8)])
def test_a_step_schedule_is_the_same_on_either_log(kw):
    """tiny-llama's whole step built on the compiled log here and on the Python one (LLMEM_NATIVE_EVENTS=off, in
    a process of its own): the same events, phases and marks."""
    r, act = rank_step(resolve(TrainingSetup(model="tiny-llama", seq_len=128, batch_size=2, **kw)))
    compiled = step_schedule(r, act).build()
    assert isinstance(compiled, native.EventLog)
    env = {**os.environ, "LLMEM_NATIVE_EVENTS": "off"}
    out = subprocess.run([sys.executable, "-c", _BUILD, repr(kw)], env=env, capture_output=True, check=True)
    reference = pickle.loads(out.stdout)
    assert len(compiled.events) > 100
    assert (compiled.events, compiled.phase_starts, compiled.marks) == reference
