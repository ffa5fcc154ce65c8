"""The roofline the benchmarks compare against: this process's matrix-multiply rate (float32 unless told)."""

from __future__ import annotations

import time

import torch


def matmul_gflops(size: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """GEMM rate of this process's threads in ``dtype``, GFLOP/s."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9
