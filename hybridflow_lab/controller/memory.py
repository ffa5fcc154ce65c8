"""Process and device memory: the resident set the OS sees (soak runs, leak hunting) and per-phase memory fields."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import time
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


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")  # runs ldconfig: once per process
    return ctypes.CDLL(name) if name else None


def release_free_heap() -> None:
    """Hand the C allocator's free heap back to the OS (glibc's ``malloc_trim``; nothing where libc has none)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def memory_report(release: bool = False) -> dict[str, float]:
    """This process's resident MiB and live Python objects after a garbage collection. With ``release``,
    the C allocator first hands its free heap back to the OS, so what remains resident is memory in use
    rather than freed memory kept for reuse."""
    gc.collect()
    if release:
        release_free_heap()
    return {"rss_mb": resident_mb(), "python_objects": float(len(gc.get_objects()))}


class HeapRelease:
    """Hands the free heap back to the OS after a call, at most once every ``every_s`` seconds.

    glibc's malloc keeps much of what each step's freed tensors leave, so a rank's resident memory grew step after
    step (docs/reliability.md, Soak). A trim takes about 11 ms to hand back 300 MB: once every 10 s it is lost in
    the run's time. Ray's jemalloc, the other lever, made CPU steps 10-20% slower.
    """

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self.last = time.monotonic()

    def after_call(self) -> bool:
        """Trim if ``every_s`` has passed since the last trim; True if it trimmed."""
        if time.monotonic() - self.last < self.every_s:
            return False
        release_free_heap()
        self.last = time.monotonic()
        return True


def device_memory_mib(device: str) -> float:
    """Memory this process holds on ``device``: CUDA's allocated bytes, or the resident set on CPU, in MiB."""
    if device.startswith("cuda"):
        return torch.cuda.memory_allocated(device) / 2**20
    return resident_mb()


def device_used_mib(device: str) -> float:
    """The GPU's memory in use by every process on it, in MiB (``mem_get_info``): unlike ``memory_allocated`` it
    drops when vLLM sleeps (its allocator unmaps the memory while torch's tensors over it stay alive)."""
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**20


class PhaseMemory:
    """The memory around one phase (a worker call): before, after and, on CUDA, the peak allocated in between.

    ``fields()`` are the span attributes the timeline shows: ``memory_kind`` (``cuda_allocated`` or ``rss``),
    ``memory_before_mib``, ``memory_after_mib`` and, on CUDA, ``memory_peak_mib`` (``max_memory_allocated``) and
    ``device_used_before_mib``/``device_used_after_mib``: the whole GPU's use, which is what a colocated group can
    still get (and the one that shows vLLM asleep).
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.on_cuda = device.startswith("cuda")
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats(device)
            self.used_before = device_used_mib(device)
        self.before = device_memory_mib(device)

    def fields(self) -> dict[str, float | str]:
        out: dict[str, float | str] = {"memory_kind": "cuda_allocated" if self.on_cuda else "rss",
                                       "memory_before_mib": round(self.before, 1),
                                       "memory_after_mib": round(device_memory_mib(self.device), 1)}
        if self.on_cuda:
            out["memory_peak_mib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1)
            out["device_used_before_mib"] = round(self.used_before, 1)
            out["device_used_after_mib"] = round(device_used_mib(self.device), 1)
        return out
