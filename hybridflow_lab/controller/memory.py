"""Process and device memory: the resident set the OS sees (soak runs, leak hunting) and per-phase memory fields."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from pathlib import Path

import torch


def resident_mb(pid: int | None = None) -> float:
    """Resident memory of process ``pid`` (default: this one) in MiB, from ``/proc``."""
    return _status_mib("VmRSS", pid)


def peak_resident_mb(pid: int | None = None) -> float:
    """The high-water resident memory of process ``pid`` (default: this one) in MiB (``VmHWM``)."""
    return _status_mib("VmHWM", pid)


def _status_mib(field: str, pid: int | None) -> float:
    for line in Path(f"/proc/{pid or os.getpid()}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"/proc/{pid or os.getpid()}/status has no {field}")


def memory_report(release: bool = False) -> dict[str, float]:
    """This process's resident MiB and live Python objects after a garbage collection. With ``release``,
    the C allocator first hands its free heap back to the OS (glibc's ``malloc_trim``), so what remains
    resident is memory in use rather than freed memory kept for reuse."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if release and libc:
        ctypes.CDLL(libc).malloc_trim(0)
    return {"rss_mb": resident_mb(), "python_objects": float(len(gc.get_objects()))}


def device_memory_mib(device: str) -> float:
    """Memory this process holds on ``device``: CUDA's allocated bytes, or the resident set on CPU, in MiB."""
    if device.startswith("cuda"):
        return torch.cuda.memory_allocated(device) / 2**20
    return resident_mb()


class PhaseMemory:
    """The memory around one phase (a worker call): before, after and, on CUDA, the peak allocated in between.

    ``fields()`` are the span attributes the timeline shows: ``memory_kind`` (``cuda_allocated`` or ``rss``),
    ``memory_before_mib``, ``memory_after_mib`` and, on CUDA, ``memory_peak_mib`` (``max_memory_allocated``).
    """

    def __init__(self, device: str) -> None:
        self.device = device
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(device)
        self.before = device_memory_mib(device)

    def fields(self) -> dict[str, float | str]:
        out: dict[str, float | str] = {"memory_kind": "cuda_allocated" if self.device.startswith("cuda") else "rss",
                                       "memory_before_mib": round(self.before, 1),
                                       "memory_after_mib": round(device_memory_mib(self.device), 1)}
        if self.device.startswith("cuda"):
            out["memory_peak_mib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1)
        return out
