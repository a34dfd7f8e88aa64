"""GPU catalog: memory capacity, the CUDA context assumption, compute and link speeds.

Memory is the device's total as the driver reports it to PyTorch (`torch.cuda.mem_get_info()[1]`, the "GPU 0 has a
total capacity of X GiB" of PyTorch's OOM message), which is less than the marketing size and than nvidia-smi's
"Total" (the driver keeps some). Each entry names its source (`memory_source`); where no driver figure was found,
the nvidia-smi total stands and says so. `--gpu-memory` overrides.
The CUDA context (driver context, kernel images loaded lazily, cuBLAS/cuDNN handles) lives outside PyTorch's caching
allocator, so it appears in `device_used` but not in `max_memory_reserved`. Its size depends on the driver, the CUDA
version and which kernels load; the values below are typical of PyTorch 2.x with CUDA 12 and lazy module loading
(CUDA_MODULE_LOADING=LAZY, the default since CUDA 11.7) and are an **assumption** the user can override with
`--cuda-context`. The cuBLAS workspace, in contrast, is taken from the caching allocator (PyTorch >= 2.1), so it is
counted inside allocated/reserved; its default size follows CUBLAS_WORKSPACE_CONFIG's defaults in PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmem.errors import LlmemError
from llmem.units import GIB, KIB, MIB, parse_bytes

_UNMEASURED = "nvidia-smi total; the driver's total (what PyTorch can use) not found for this GPU, likely ~1-2 % less"
_OOM_MESSAGE = "driver total as PyTorch's OOM message and get_device_properties report it on Linux"


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    cuda_context_bytes: int       # outside the caching allocator (nvidia-smi shows it, torch does not)
    cublas_workspace_bytes: int   # inside the caching allocator, one per stream/handle used by the step
    bf16_tflops: float            # dense peak for matrix work, fp16 where the GPU lacks bf16
    link_gbps: float              # per-GPU bandwidth to peers inside a node, GB/s, one direction
    compute_capability: tuple[int, int] = (8, 0)
    memory_gbps: float = 2039.0   # device-memory (HBM/GDDR) bandwidth, GB/s: memory-bound work (dequantisation)
    memory_source: str = _UNMEASURED

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


# cuBLAS workspace: PyTorch's default CUBLAS_WORKSPACE_CONFIG is ":4096:8" (8 x 4 MiB... taken as one 32 MiB
# block) on Hopper and newer, ":4096:2:16:8" (2 x 4 MiB + 8 x 16 KiB) before it.
_WS_HOPPER = 32 * MIB
_WS_PRE_HOPPER = 2 * 4096 * KIB + 8 * 16 * KIB

# Memory bandwidth (last field): the vendors' datasheet peaks (HBM / GDDR), GB/s.
GPU_CATALOG: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec("V100-16GB", 16384 * MIB, 330 * MIB, _WS_PRE_HOPPER, 125.0, 150.0, (7, 0), 900.0,
                "the paper's m_total (16384 MiB, kept so the paper engine reproduces it); the driver reports less"),
        GpuSpec("V100-32GB", 32768 * MIB, 330 * MIB, _WS_PRE_HOPPER, 125.0, 150.0, (7, 0), 900.0),
        GpuSpec("T4", 15102 * MIB, 330 * MIB, _WS_PRE_HOPPER, 65.0, 16.0, (7, 5), 320.0, _OOM_MESSAGE + " (14.75 GiB)"),
        GpuSpec("A10G", 23028 * MIB, 420 * MIB, _WS_PRE_HOPPER, 70.0, 16.0, (8, 6), 600.0),
        GpuSpec("RTX3090", 24576 * MIB, 420 * MIB, _WS_PRE_HOPPER, 71.0, 25.0, (8, 6), 936.0),
        GpuSpec("RTX4090", 24218 * MIB, 420 * MIB, _WS_PRE_HOPPER, 165.0, 25.0, (8, 9), 1008.0,
                _OOM_MESSAGE + " (23.65 GiB)"),
        GpuSpec("L4", 23034 * MIB, 420 * MIB, _WS_PRE_HOPPER, 121.0, 25.0, (8, 9), 300.0),
        GpuSpec("L40S", 46068 * MIB, 420 * MIB, _WS_PRE_HOPPER, 362.0, 25.0, (8, 9), 864.0),
        GpuSpec("A100-40GB", 42_298_834_944, 420 * MIB, _WS_PRE_HOPPER, 312.0, 300.0, (8, 0), 1555.0,
                "driver total measured on an A100-40GB (issue 10: 42,298,834,944 B = 39.39 GiB)"),
        GpuSpec("A100-80GB", 81050 * MIB, 420 * MIB, _WS_PRE_HOPPER, 312.0, 300.0, (8, 0), 2039.0,
                _OOM_MESSAGE + " (79.15 GiB, total_memory=81050MB)"),
        GpuSpec("H100-80GB", 81559 * MIB, 520 * MIB, _WS_HOPPER, 989.0, 450.0, (9, 0), 3350.0),
        GpuSpec("H200", 143771 * MIB, 520 * MIB, _WS_HOPPER, 989.0, 450.0, (9, 0), 4800.0),
        GpuSpec("B200", 183359 * MIB, 600 * MIB, _WS_HOPPER, 2250.0, 900.0, (10, 0), 8000.0),
        GpuSpec("MI300X", 196592 * MIB, 600 * MIB, _WS_HOPPER, 1307.0, 448.0, (9, 4), 5300.0),
    )
}

_ALIASES = {
    "V100": "V100-16GB", "A100": "A100-80GB", "H100": "H100-80GB", "A10": "A10G",
    "RTX-3090": "RTX3090", "RTX-4090": "RTX4090", "4090": "RTX4090", "3090": "RTX3090",
    "H200-141GB": "H200", "A100-40G": "A100-40GB", "A100-80G": "A100-80GB",
}


def resolve_gpu(name: str = "A100-80GB", memory: str | int | None = None,
                cuda_context: str | int | None = None) -> GpuSpec:
    """Catalog look-up, case-insensitive, with `--gpu-memory` / `--cuda-context` overrides."""
    key = {k.upper(): k for k in GPU_CATALOG}.get(name.upper())
    key = key or _ALIASES.get(name) or {k.upper(): v for k, v in _ALIASES.items()}.get(name.upper())
    if key is None:
        if memory is None:
            raise LlmemError(f"unknown GPU {name!r}: choose one of {', '.join(GPU_CATALOG)} or give --gpu-memory")
        base = GpuSpec(name, 0, 420 * MIB, _WS_PRE_HOPPER, 312.0, 300.0)
    else:
        base = GPU_CATALOG[key]
    changes = {}
    if memory is not None:
        changes["memory_bytes"] = parse_bytes(memory)
        changes["memory_source"] = "--gpu-memory"
    if cuda_context is not None:
        changes["cuda_context_bytes"] = 0 if str(cuda_context) in ("0", "0B") else parse_bytes(cuda_context)
    if changes:
        base = replace(base, **changes)
    return base


def catalog_gpu_for(device_name: str, total_bytes: int) -> str | None:
    """The catalog entry of a CUDA device (torch.cuda.get_device_name / get_device_properties().total_memory): the
    entries whose family ("A100", "H100", ...) the device's name contains, the one whose memory is nearest the
    device's (an A100-SXM4-40GB is the A100-40GB); None when no family matches."""
    name = device_name.replace(" ", "").upper()
    family = [g for g in GPU_CATALOG.values() if g.name.split("-")[0].upper() in name]
    if not family:
        return None
    return min(family, key=lambda g: abs(g.memory_bytes - total_bytes)).name


# NCCL allocates its channel buffers with cudaMalloc, outside PyTorch's allocator: roughly NCCL_BUFFSIZE (4 MiB) per
# channel and protocol for each peer connection. We assume 256 MiB per GPU once a process group with peers exists
# (typical for 8 GPUs on NVLink with NCCL 2.18+); it is part of what nvidia-smi shows, not of torch's counters.
NCCL_BUFFER_BYTES = 256 * MIB


def outside_allocator_bytes(gpu: GpuSpec, world_size: int) -> int:
    """Device memory in use that PyTorch's counters never see: the CUDA context and NCCL's buffers."""
    return gpu.cuda_context_bytes + (NCCL_BUFFER_BYTES if world_size > 1 else 0)
