"""measure: the step for real on the CPU, and trace checked against it (same accounting, real vs fake tensors)."""

from __future__ import annotations

import pytest
import torch

from llmem.errors import LlmemError
from llmem.result import COMPONENTS
from llmem.runtime.measure import measure, measure_cpu_with_details
from llmem.runtime.trace import trace_with_details
from llmem.setup.training import TrainingSetup


def _close(a: int, b: int, rel: float = 0.005) -> bool:
    return abs(a - b) <= rel * max(a, b)


def _compare(setup):
    """trace (fake tensors, CPU SDPA choice) against measure (real CPU tensors): peaks and per-phase peaks."""
    traced, td = trace_with_details(setup, cuda_kernels=False)
    measured, md = measure_cpu_with_details(setup)
    assert measured.engine == "measure"
    assert _close(traced.peak_allocated_bytes, measured.peak_allocated_bytes), \
        (traced.peak_allocated_bytes, measured.peak_allocated_bytes)
    assert _close(traced.peak_reserved_bytes, measured.peak_reserved_bytes)
    assert td.phase_peaks.keys() == md.phase_peaks.keys()
    for phase, peak in td.phase_peaks.items():
        assert _close(peak["tensor_bytes"], md.phase_peaks[phase]["tensor_bytes"]), phase
    return traced, measured, td, md


@pytest.mark.slow   # 20-30 s on 2 cores; test_trace_matches_real_cpu_methods and the CI matrix cover the path by default
def test_trace_matches_real_cpu_gpt2():
    # SGD keeps the model states small, so activations and logits decide the forward / backward peaks
    setup = TrainingSetup(model="gpt2", batch_size=1, seq_len=128, precision="fp32", optimizer="sgd")
    traced, measured, td, md = _compare(setup)
    assert td.category_max["activations"] == md.category_max["activations"]
    assert td.category_max["logits_and_loss"] == md.category_max["logits_and_loss"]


@pytest.mark.slow   # 20-30 s on 2 cores; test_trace_matches_real_cpu_methods and the CI matrix cover the path by default
def test_trace_matches_real_cpu_opt125m():
    setup = TrainingSetup(model="facebook/opt-125m", batch_size=1, seq_len=128, precision="fp32")
    traced, measured, _, _ = _compare(setup)
    assert traced.peak_phase == measured.peak_phase == "optimizer_step"


@pytest.mark.parametrize("kw", [
    {"precision": "bf16-mixed"},
    {"precision": "bf16", "grad_ckpt": True},
    {"method": "ddp", "gpus": 2, "precision": "bf16-mixed"},
    {"method": "fsdp", "gpus": 4, "precision": "bf16-mixed"},
    {"method": "zero2", "gpus": 2, "precision": "fp32", "optimizer": "sgd-momentum"},
])
def test_trace_matches_real_cpu_methods(small_llama, kw):
    _compare(TrainingSetup(model=small_llama, batch_size=2, seq_len=64, **kw))


def test_trace_sees_tensor_parallel_internals(small_llama):
    """With real DTensors the dispatch mode sees DTensor ops, not the local ops (redistributions) DTensor runs
    inside them; on fake tensors all of them come through the fake mode. So the real count is a lower bound."""
    setup = TrainingSetup(model=small_llama, method="tp", gpus=2, batch_size=2, seq_len=64, precision="fp32",
                          optimizer="sgd-momentum")
    traced, _ = trace_with_details(setup, cuda_kernels=False)
    measured, _ = measure_cpu_with_details(setup)
    assert measured.peak_allocated_bytes <= traced.peak_allocated_bytes <= 1.05 * measured.peak_allocated_bytes


def test_real_count_matches_the_profiler(small_llama):
    """An independent count of the real run: the profiler's allocator-level memory timeline."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    from llmem.runtime import measure as m
    from llmem.runtime.ledger import Ledger
    from llmem.runtime.replay import replay_ledger
    from llmem.runtime.step import prepared_step

    setup = TrainingSetup(model=small_llama, batch_size=2, seq_len=128, precision="fp32", optimizer="sgd")
    with prepared_step(setup, fake=False, device="cpu", cuda_kernels=False) as step:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                     with_stack=True) as prof:
            step.run(2)
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    profiler_peak = max(sum(row) for row in sizes)

    ledger = Ledger(workspace_bytes=0, round_to=1)      # raw bytes, like the CPU allocator
    m._run(setup, torch.device("cpu"), 2, ledger, None, lambda msg: None)
    ledger_peak = max(p["tensor_bytes"] for p in replay_ledger(ledger)["phase_peaks"].values())
    assert abs(ledger_peak - profiler_peak) <= 4096, (ledger_peak, profiler_peak)


def test_measure_result_shape(small_llama):
    res = measure(TrainingSetup(model=small_llama, batch_size=1, seq_len=32, precision="bf16-mixed"), device="cpu")
    assert set(res.components) == set(COMPONENTS)
    assert sum(res.components.values()) == res.device_used_bytes
    assert res.peak_phase in ("forward", "backward", "optimizer_step")
    assert res.setup.total_params > 0


def test_measure_reports_oom_as_llmem_error(small_llama, monkeypatch):
    from llmem.runtime import measure as m

    def boom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(m, "_measure_cpu", boom)
    with pytest.raises(LlmemError, match="out of memory at batch size 3"):
        measure(TrainingSetup(model=small_llama, batch_size=3, seq_len=32), device="cpu")


def test_measure_cuda_without_gpu_is_an_error(small_llama):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(LlmemError, match="no CUDA GPU"):
        measure(TrainingSetup(model=small_llama, batch_size=1, seq_len=8), device="cuda")


def test_measure_on_cpu_refuses_activation_offload_and_validate_skips_it(small_llama, monkeypatch):
    """On the CPU the host is the device: nothing would be offloaded, so measure refuses, and validate reports the
    row as skipped (not failed)."""
    from llmem.validate import compare as validate

    setup = TrainingSetup(model=small_llama, batch_size=1, seq_len=32, precision="bf16", optimizer="sgd",
                          offload_activations=True)
    with pytest.raises(LlmemError, match="offload-activations needs a device distinct from the host"):
        measure(setup, device="cpu")
    (row,) = validate.run_matrix([setup], "measure", "cpu")
    assert row.truth is None and "GPU" in row.skipped and not row.error
    monkeypatch.setitem(validate.MATRICES, "offload-only", [setup])
    rows, summary = validate.validate("measure", "offload-only", 2.0, "cpu")
    assert summary["passed"] and rows[0].skipped


def test_measure_counts_paged_optimizer_states_in_device_used(small_llama):
    """paged-adamw-8bit: uint8 state1 + state2 of every parameter of >= 1e5 elements are managed memory. small_llama
    by hand: embedding and lm_head 2000 x 256 = 512,000 each; per layer gate, up, down 256 x 512 = 131,072 each (q/o
    65,536 and k/v 32,768 stay under 1e5): 2 x (2 x 512,000 + 2 x 3 x 131,072) = 3,620,864 B."""
    res = measure(TrainingSetup(model=small_llama, batch_size=1, seq_len=32, precision="bf16-mixed",
                                optimizer="paged-adamw-8bit"), device="cpu")
    assert res.components["managed_memory"] == 3_620_864
    assert sum(res.components.values()) == res.device_used_bytes
    assert res.device_used_bytes == res.peak_reserved_bytes + res.components["cuda_context"] + 3_620_864
