"""The roofline the benchmarks compare against: this process's float32 matrix-multiply rate."""

from __future__ import annotations

import time

import torch


def matmul_gflops(size: int = 2048, repeats: int = 5) -> float:
    """float32 GEMM rate of this process's threads, GFLOP/s."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9
