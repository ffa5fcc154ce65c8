"""The rooflines the benchmarks compare against: this process's matrix-multiply rate (float32 unless told), and
the time a model's own linear layers take at a given batch."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn


def matmul_gflops(size: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """GEMM rate of this process's threads in ``dtype``, GFLOP/s."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


def linear_pass(layers: Sequence[nn.Linear], rows: int) -> Callable[[], None]:
    """One pass over ``layers``, in order, each on ``rows`` rows, to time: what a forward's matrix products cost at
    that batch through torch's own GEMMs, with the weights' real sizes and cache traffic and nothing else."""
    inputs = {size: torch.randn(rows, size, dtype=layers[0].weight.dtype)
              for size in {layer.in_features for layer in layers}}

    @torch.no_grad()
    def one_pass() -> None:
        for layer in layers:
            F.linear(inputs[layer.in_features], layer.weight, layer.bias)

    return one_pass
