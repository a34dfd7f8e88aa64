"""Out of memory as PyTorch's allocator decides it (llmem.memory.capacity): the step replayed at the device's
capacity, the cache released and retried when a segment does not fit, `fits` = the replay completes."""

from __future__ import annotations

from llmem import estimate
from llmem.estimator.events import Schedule, replay
from llmem.memory.capacity import at_capacity, resident_managed_bytes
from llmem.planner.options import PlanOptions
from llmem.planner.plan import plan
from llmem.result import OutOfMemory
from llmem.runtime.trace import trace
from llmem.setup.gpus import GPU_CATALOG, NCCL_BUFFER_BYTES, resolve_gpu
from llmem.setup.training import user_setup
from llmem.units import GIB, MIB


def _cached_then_bigger() -> Schedule:
    """A 30 MiB tensor freed (its segment stays cached), then a 40 MiB one the cached segment cannot hold."""
    s = Schedule()
    s.phase = "it0:forward"
    s.mark("layer 0")
    s.free(s.alloc(30 * MIB, "activations"))
    s.mark("layer 1")
    s.alloc(40 * MIB, "activations")
    return s


def test_unlimited_device_keeps_the_cached_segment():
    # both segments are held: 30 + 40 MiB (sizes over 10 MiB round to 2 MiB, so they are exact)
    assert replay(_cached_then_bigger()).peak_reserved_bytes == 70 * MIB


def test_full_device_releases_the_cache_and_retries():
    # at 50 MiB the 40 MiB cudaMalloc fails, release_cached_blocks frees the idle 30 MiB segment, the retry fits:
    # reserved never exceeds 40 MiB
    rep = replay(_cached_then_bigger(), capacity_bytes=50 * MIB)
    assert rep.oom is None
    assert rep.peak_reserved_bytes == 40 * MIB
    assert rep.peak_allocated_bytes == 40 * MIB


def test_out_of_memory_names_the_failed_allocation():
    rep = replay(_cached_then_bigger(), capacity_bytes=35 * MIB)
    assert rep.oom == OutOfMemory("it0:forward", "layer 1", "activations", 40 * MIB, 0, 0, 35 * MIB)


def test_capacity_decision_replays_only_when_the_peaks_do_not_decide():
    calls = []

    def capped(capacity: int) -> tuple[int, OutOfMemory | None]:
        calls.append(capacity)
        return 90, None

    def over(capacity: int) -> OutOfMemory:
        return OutOfMemory("it0:backward", "", "activations", 0, 120, 130, capacity)

    assert at_capacity(80, 95, 100, capped, over).reserved_bytes == 95 and calls == []   # reserved within
    assert at_capacity(120, 130, 100, capped, over).oom.allocated_bytes == 120 and calls == []   # allocated over
    got = at_capacity(80, 130, 100, capped, over)                                        # undecided: replayed
    assert calls == [100] and got.completes and got.reserved_bytes == 90


def test_paged_states_are_resident_only_while_there_is_room():
    assert resident_managed_bytes(10 * GIB, 4 * GIB) == 4 * GIB
    assert resident_managed_bytes(1 * GIB, 4 * GIB) == 1 * GIB
    assert resident_managed_bytes(1 * GIB, -5) == 0


def _old_rule(r) -> bool:
    """The rule this replaces: the uncapped reserved peak plus what lies outside the allocator within memory."""
    return r.peak_reserved_bytes + r.components["cuda_context"] + r.components["managed_memory"] \
        <= r.gpu_memory_bytes


def _is_monotone(flags: list[bool]) -> bool:
    """True up to some point, false after it."""
    return flags == sorted(flags, reverse=True)


def test_fits_is_monotone_in_sequence_length_where_the_uncapped_reserved_peak_is_not():
    # Llama-3.2-3B, pure bf16 full fine-tuning, batch 4: the uncapped reserved peak swings 36.3 / 38.0 / 34.5 /
    # 36.2 GiB from 704 to 800 tokens while the allocated peak grows smoothly
    runs = [estimate(user_setup(model="meta-llama/Llama-3.2-3B", seq_len=s, batch_size=4, precision="bf16",
                                gpu_memory="37GiB")) for s in range(704, 929, 32)]
    assert not _is_monotone([_old_rule(r) for r in runs])
    assert _is_monotone([r.fits for r in runs])
    allocated = [r.peak_allocated_bytes for r in runs]
    assert allocated == sorted(allocated)
    for r in runs:
        if r.fits:   # on the device the reserved peak stays within what the allocator may use
            assert r.peak_allocated_bytes <= r.capped_reserved_bytes <= r.capacity_bytes
            assert r.device_used_bytes <= r.gpu_memory_bytes
            assert sum(r.components.values()) == r.device_used_bytes
        else:
            assert r.oom is not None and r.capped_reserved_bytes is None


def test_capacity_is_the_memory_less_what_lies_outside_the_allocator():
    r = estimate(user_setup(model="gpt2", gpus=2, method="ddp"))
    gpu = resolve_gpu("A100-80GB")
    # the CUDA context and NCCL's buffers (a process group with a peer) are cudaMalloc'd outside the allocator
    assert r.capacity_bytes == gpu.memory_bytes - gpu.cuda_context_bytes - NCCL_BUFFER_BYTES


def test_plan_names_the_largest_batch_the_capacity_aware_replay_fits():
    # Llama-3.1-8B, FSDP x4 A100-80GB, 4096 tokens, checkpointing: at batch 5 the uncapped reserved peak
    # (82.9 GiB) is over the device while allocated (59.8 GiB) is far within; the plan answers from the allocator
    base = dict(model="meta-llama/Llama-3.1-8B", gpus=4, method="fsdp", seq_len=4096, grad_ckpt=True,
                gpu="A100-80GB")
    runs = {b: estimate(user_setup(**base, batch_size=b)) for b in range(1, 10)}
    fits = [runs[b].fits for b in sorted(runs)]
    assert _is_monotone(fits)
    largest = sum(fits)
    assert not _old_rule(runs[5]) and runs[5].fits
    assert largest >= 5
    p = plan(user_setup(**base), PlanOptions(methods=("fsdp",)))
    assert p.candidates[0].max_batch_size == largest
    shown = p.candidates[0].to_dict()
    assert shown["peak_reserved_bytes"] == runs[largest].peak_reserved_bytes
    assert shown["capped_reserved_bytes"] == runs[largest].capped_reserved_bytes


def test_trace_and_estimate_decide_alike_at_a_capacity():
    base = dict(model="tiny-llama", batch_size=2, seq_len=128)
    t = trace(user_setup(**base))
    # a device between the allocated and the reserved peak, and one below the allocated peak
    for mem in ((t.peak_allocated_bytes + t.peak_reserved_bytes) // 2, t.peak_allocated_bytes - 64 * MIB):
        s = user_setup(**base, gpu_memory=mem + t.components["cuda_context"])
        tr, est = trace(s), estimate(s)
        assert tr.fits == est.fits
        if not tr.fits:
            assert tr.oom.capacity_bytes == mem and tr.oom.requested_bytes > 0
        else:
            assert tr.capped_reserved_bytes <= mem


def test_every_gpu_names_the_source_of_its_capacity():
    for gpu in GPU_CATALOG.values():
        assert gpu.memory_source
    assert resolve_gpu("A100-80GB", memory="70GiB").memory_source == "--gpu-memory"
