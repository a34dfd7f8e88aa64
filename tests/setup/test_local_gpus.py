"""`--gpu auto`: this machine's GPUs as `nvidia-smi --query-gpu=index,name,memory.total,memory.free` lists them (no
torch), the one with the least memory free deciding, its catalog entry by name and total, its free memory the
capacity; no GPU here: one line naming the fix."""

from __future__ import annotations

import shutil
import subprocess

import pytest

import llmem.setup.local_gpus as local
from llmem import estimate
from llmem.errors import LlmemError
from llmem.setup.gpus import GPU_CATALOG, resolve_gpu
from llmem.units import GIB, MIB

LISTING = ("0, NVIDIA H100 80GB HBM3, 81559, 80990\n"
           "1, NVIDIA H100 80GB HBM3, 81559, 41000\n")


@pytest.fixture
def smi(monkeypatch):
    """A driver listing two H100s, GPU 1 with 41,000 MiB free."""
    local.local_gpus.cache_clear()
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, LISTING, ""))
    yield
    local.local_gpus.cache_clear()


def test_the_query_is_read_in_mib():
    gpus = local.parse_query(LISTING + "not a line\n")
    assert [(g.index, g.total_bytes, g.free_bytes) for g in gpus] == [(0, 81559 * MIB, 80990 * MIB),
                                                                      (1, 81559 * MIB, 41000 * MIB)]


def test_auto_is_the_tightest_gpu_with_its_free_memory(smi):
    gpu = resolve_gpu("auto")
    assert gpu.name == "H100-80GB" and gpu.memory_bytes == 41000 * MIB
    assert gpu.bf16_tflops == GPU_CATALOG["H100-80GB"].bf16_tflops
    assert "GPU 1" in gpu.memory_source and f"{41000 * MIB / GIB:.2f} of" in gpu.memory_source


def test_the_estimate_decides_fits_against_the_free_memory_and_says_so(smi, monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 0, "0, NVIDIA H100 80GB HBM3, 81559, 64\n", ""))
    local.local_gpus.cache_clear()
    result = estimate("tiny-llama", gpu="auto", seq_len=64)
    assert result.fits is False               # 64 MiB free: tiny-llama's fp32 weights alone are over it
    assert any(n.startswith("--gpu auto: GPU 0") for n in result.notes)


def test_no_gpu_here_is_one_line(monkeypatch):
    local.local_gpus.cache_clear()
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(LlmemError, match="--gpu auto: no NVIDIA GPU here"):
        resolve_gpu("auto")
    local.local_gpus.cache_clear()
