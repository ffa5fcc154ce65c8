"""The soak bench's arithmetic (the bench itself runs in tests/test_bench_cli.py) and the ranks' heap release."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from hybridflow_lab.bench.soak import slope_per_100
from hybridflow_lab.controller.memory import HeapRelease, resident_mb


def test_soak_growth_is_the_least_squares_slope_per_100_steps():
    assert slope_per_100([10 + 0.5 * step for step in range(40)]) == pytest.approx(50.0)
    assert slope_per_100([3.0] * 10) == 0.0
    assert slope_per_100([5.0]) == 0.0


def _heap_with_a_freed_hole(mib: int) -> None:
    """Leave ``mib`` MiB of freed, touched blocks under a live one, where glibc keeps them for reuse."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(4096) for _ in range(mib * 256)]
    for block in blocks:
        ctypes.memset(block, 1, 4096)
    for block in blocks[:-1]:
        libc.free(block)


def test_a_ranks_freed_heap_goes_back_to_the_os_once_a_period():
    _heap_with_a_freed_hole(200)
    held = resident_mb()
    assert not HeapRelease(every_s=3600).after_call()
    assert resident_mb() > held - 20
    assert HeapRelease(every_s=0).after_call()
    assert resident_mb() < held - 150
