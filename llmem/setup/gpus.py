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


@dataclass(frozen=True, kw_only=True)
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

# Memory bandwidth (memory_gbps): the vendors' datasheet peaks (HBM / GDDR), GB/s.
GPU_CATALOG: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec(name="V100-16GB", memory_bytes=16384 * MIB, compute_capability=(7, 0),
                cuda_context_bytes=330 * MIB, cublas_workspace_bytes=_WS_PRE_HOPPER,
                bf16_tflops=125.0, link_gbps=150.0, memory_gbps=900.0,
                memory_source="the paper's m_total (16384 MiB, kept so the paper engine reproduces it); "
                              "the driver reports less"),
        GpuSpec(name="V100-32GB", memory_bytes=32768 * MIB, compute_capability=(7, 0),
                cuda_context_bytes=330 * MIB, cublas_workspace_bytes=_WS_PRE_HOPPER,
                bf16_tflops=125.0, link_gbps=150.0, memory_gbps=900.0),
        GpuSpec(name="T4", memory_bytes=15102 * MIB, compute_capability=(7, 5),
                cuda_context_bytes=330 * MIB, cublas_workspace_bytes=_WS_PRE_HOPPER,
                bf16_tflops=65.0, link_gbps=16.0, memory_gbps=320.0,
                memory_source=_OOM_MESSAGE + " (14.75 GiB)"),
        GpuSpec(name="A10G", memory_bytes=23028 * MIB, compute_capability=(8, 6),
                cuda_context_bytes=420 * MIB, cublas_workspace_bytes=_WS_PRE_HOPPER,
                bf16_tflops=70.0, link_gbps=16.0, memory_gbps=600.0),
        GpuSpec(name="RTX3090", memory_bytes=24576 * MIB, compute_capability=(8, 6),
                cuda_context_bytes=420 * MIB, cublas_workspace_bytes=_WS_PRE_HOPPER,
                bf16_tflops=71.0, link_gbps=25.0, memory_gbps=936.0),
        GpuSpec(name="RTX4090", memory_bytes=24218 * MIB, compute_capability=(8, 9),
                cuda_context_bytes=420 * MIB, cublas_workspace_bytes=_WS_PRE_HOPPER,
                bf16_tflops=165.0, link_gbps=25.0, memory_gbps=1008.0,
                memory_source=_OOM_MESSAGE + " (23.65 GiB)"),
        GpuSpec(name="L4", memory_bytes=23034 * MIB, compute_capability=(8, 9),
                cuda_context_bytes=420 * MIB, cublas_workspace_bytes=_WS_PRE_HOPPER,
                bf16_tflops=121.0, link_gbps=25.0, memory_gbps=300.0),
        GpuSpec(name="L40S", memory_bytes=46068 * MIB, compute_capability=(8, 9),
                cuda_context_bytes=420 * MIB, cublas_workspace_bytes=_WS_PRE_HOPPER,
                bf16_tflops=362.0, link_gbps=25.0, memory_gbps=864.0),
        GpuSpec(name="A100-40GB", memory_bytes=42_298_834_944, compute_capability=(8, 0),
                cuda_context_bytes=420 * MIB, cublas_workspace_bytes=_WS_PRE_HOPPER,
                bf16_tflops=312.0, link_gbps=300.0, memory_gbps=1555.0,
                memory_source="driver total measured on an A100-40GB (issue 10: 42,298,834,944 B = 39.39 "
                              "GiB)"),
        GpuSpec(name="A100-80GB", memory_bytes=81050 * MIB, compute_capability=(8, 0),
                cuda_context_bytes=420 * MIB, cublas_workspace_bytes=_WS_PRE_HOPPER,
                bf16_tflops=312.0, link_gbps=300.0, memory_gbps=2039.0,
                memory_source=_OOM_MESSAGE + " (79.15 GiB, total_memory=81050MB)"),
        GpuSpec(name="H100-80GB", memory_bytes=81559 * MIB, compute_capability=(9, 0),
                cuda_context_bytes=520 * MIB, cublas_workspace_bytes=_WS_HOPPER,
                bf16_tflops=989.0, link_gbps=450.0, memory_gbps=3350.0),
        GpuSpec(name="H200", memory_bytes=143771 * MIB, compute_capability=(9, 0),
                cuda_context_bytes=520 * MIB, cublas_workspace_bytes=_WS_HOPPER,
                bf16_tflops=989.0, link_gbps=450.0, memory_gbps=4800.0),
        GpuSpec(name="B200", memory_bytes=183359 * MIB, compute_capability=(10, 0),
                cuda_context_bytes=600 * MIB, cublas_workspace_bytes=_WS_HOPPER,
                bf16_tflops=2250.0, link_gbps=900.0, memory_gbps=8000.0),
        GpuSpec(name="MI300X", memory_bytes=196592 * MIB, compute_capability=(9, 4),
                cuda_context_bytes=600 * MIB, cublas_workspace_bytes=_WS_HOPPER,
                bf16_tflops=1307.0, link_gbps=448.0, memory_gbps=5300.0),
    )
}

_ALIASES = {
    "V100": "V100-16GB", "A100": "A100-80GB", "H100": "H100-80GB", "A10": "A10G",
    "RTX-3090": "RTX3090", "RTX-4090": "RTX4090", "4090": "RTX4090", "3090": "RTX3090",
    "H200-141GB": "H200", "A100-40G": "A100-40GB", "A100-80G": "A100-80GB",
}


AUTO_GPU = "auto"    # --gpu auto: this machine's GPU, sized by the memory free on it now


def resolve_gpu(name: str = "A100-80GB", memory: str | int | None = None,
                cuda_context: str | int | None = None) -> GpuSpec:
    """Catalog look-up, case-insensitive, with `--gpu-memory` / `--cuda-context` overrides; `auto`: this machine's
    GPU with the least memory free (llmem.setup.local_gpus)."""
    if name.lower() == AUTO_GPU and memory is None:
        return _with_context(auto_gpu(), cuda_context)
    key = {k.upper(): k for k in GPU_CATALOG}.get(name.upper())
    key = key or _ALIASES.get(name) or {k.upper(): v for k, v in _ALIASES.items()}.get(name.upper())
    if key is None:
        if memory is None:
            raise LlmemError(f"unknown GPU {name!r}: choose one of {', '.join(GPU_CATALOG)} or give --gpu-memory")
        base = GpuSpec(name=name, memory_bytes=0, cuda_context_bytes=420 * MIB,
                       cublas_workspace_bytes=_WS_PRE_HOPPER, bf16_tflops=312.0, link_gbps=300.0)
    else:
        base = GPU_CATALOG[key]
    if memory is not None:
        base = replace(base, memory_bytes=parse_bytes(memory), memory_source="--gpu-memory")
    return _with_context(base, cuda_context)


def _with_context(gpu: GpuSpec, cuda_context: str | int | None) -> GpuSpec:
    if cuda_context is None:
        return gpu
    return replace(gpu, cuda_context_bytes=0 if str(cuda_context) in ("0", "0B") else parse_bytes(cuda_context))


def auto_gpu() -> GpuSpec:
    """The local GPU with the least memory free now (the one a step on every GPU meets first), as its catalog entry
    (by name and total memory) with the free memory as its capacity: the CUDA context and the step must fit in what
    is free."""
    from llmem.setup.local_gpus import local_gpus

    gpus = local_gpus()
    if not gpus:
        raise LlmemError("--gpu auto: no NVIDIA GPU here (nvidia-smi lists none): name one (`llmem gpus`) or give "
                         "--gpu-memory")
    local = min(gpus, key=lambda g: (g.free_bytes, g.index))
    entry = catalog_gpu_for(local.name, local.total_bytes)
    base = GPU_CATALOG[entry] if entry else GpuSpec(name=local.name, memory_bytes=0, cuda_context_bytes=420 * MIB,
                                                     cublas_workspace_bytes=_WS_PRE_HOPPER, bf16_tflops=312.0,
                                                     link_gbps=300.0)
    return replace(base, memory_bytes=local.free_bytes,
                   memory_source=f"--gpu auto: GPU {local.index} ({local.name}) has {local.free_bytes / GIB:.2f} of "
                                 f"{local.total_bytes / GIB:.2f} GiB free now; fits is decided against the free memory")


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
