"""Process memory as the operating system sees it, for soak runs and leak hunting (Linux)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from pathlib import Path


def resident_mb(pid: int | None = None) -> float:
    """Resident memory of process ``pid`` (default: this one) in MiB, from ``/proc``."""
    for line in Path(f"/proc/{pid or os.getpid()}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"/proc/{pid}/status has no VmRSS")


def memory_report(release: bool = False) -> dict[str, float]:
    """This process's resident MiB and live Python objects after a garbage collection. With ``release``,
    the C allocator first hands its free heap back to the OS (glibc's ``malloc_trim``), so what remains
    resident is memory in use rather than freed memory kept for reuse."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if release and libc:
        ctypes.CDLL(libc).malloc_trim(0)
    return {"rss_mb": resident_mb(), "python_objects": float(len(gc.get_objects()))}
