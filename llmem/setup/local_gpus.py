"""The NVIDIA GPUs this machine has, as its driver lists them (`nvidia-smi --query-gpu`: index, name, total and free
memory), read without importing torch: what `--gpu auto` sizes against and what a `--from` file that leaves the
GPU count to the launcher is answered on.

Known limitation: the free memory is the driver's at the moment of asking; another process may take or release
memory before the run starts."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from functools import cache

from llmem.units import MIB

QUERY = ("--query-gpu=index,name,memory.total,memory.free", "--format=csv,noheader,nounits")   # memory in MiB


@dataclass(frozen=True)
class LocalGpu:
    index: int
    name: str            # the driver's name, e.g. "NVIDIA H100 80GB HBM3"
    total_bytes: int
    free_bytes: int


def parse_query(text: str) -> tuple[LocalGpu, ...]:
    """`nvidia-smi --query-gpu=index,name,memory.total,memory.free --format=csv,noheader,nounits` lines (MiB)."""
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and parts[0].isdigit() and parts[2].isdigit() and parts[3].isdigit():
            gpus.append(LocalGpu(int(parts[0]), parts[1], int(parts[2]) * MIB, int(parts[3]) * MIB))
    return tuple(gpus)


@cache
def local_gpus() -> tuple[LocalGpu, ...]:
    """This machine's NVIDIA GPUs (none without a driver or nvidia-smi), asked once per process."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        out = subprocess.run([smi, *QUERY], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return parse_query(out)
