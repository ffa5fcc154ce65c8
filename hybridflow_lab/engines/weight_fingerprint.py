"""Per-tensor fingerprints of model weights, computed on the trainer's side and on the rollout engine's.

A weight sync that silently misses a tensor leaves the rollout engine generating with stale weights
while training goes on (verl#7495). After every sync both sides fingerprint every tensor and the
fingerprints must agree. A 2-D weight's fingerprint is its product with a fixed +/-1 probe vector
(one number per row: any changed element moves its row's number), a 1-D weight's is the weight
itself, both in float64. The product form also works where the engine keeps a matrix only in a
repacked kernel layout (vLLM's CPU backend): the engine's own linear kernel computes it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

PROBE_SEED = 20240919  # the paper's arXiv date: any fixed value works, both sides derive the same probe
CHUNK_BYTES = 64 * 2**20  # the largest float64 temporary one fingerprint allocates


class WeightSyncError(RuntimeError):
    """The rollout engine's weights are not the trainer's after a sync; names the first tensor that differs."""

    def __init__(self, tensor: str, detail: str) -> None:
        super().__init__(f"weight sync: the rollout engine's {tensor} is not the trainer's ({detail}); it would "
                         "generate with stale or corrupted weights. Every tensor of the trainer's state dict must "
                         "reach the engine (check the names the sync sends against the engine's parameters)")
        self.tensor = tensor


def probe(columns: int, dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fixed +/-1 vector a matrix with ``columns`` columns is multiplied with (exact in every dtype)."""
    generator = torch.Generator().manual_seed(PROBE_SEED + columns)
    signs = torch.randint(0, 2, (columns,), generator=generator, device="cpu") * 2 - 1
    return signs.to(dtype=dtype, device=device)


def matrix_fingerprint(matrix: torch.Tensor, vector: torch.Tensor, dtype: torch.dtype | None = None,
                       chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """``matrix @ vector`` in float64 (after a cast to ``dtype`` where given), on the matrix's device.

    Computed over blocks of rows whose float64 copy is at most ``chunk_bytes``: a whole 150k-row embedding in
    float64 would be a temporary of several GB on the GPU.
    """
    rows = max(1, chunk_bytes // (8 * max(1, matrix.shape[1])))
    vector = vector.to(dtype=torch.float64, device=matrix.device)
    blocks = [(block if dtype is None else block.to(dtype)).double() @ vector for block in matrix.detach().split(rows)]
    return torch.cat(blocks)


def tensor_fingerprint(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensor @ probe`` for a matrix, the tensor itself for a vector, after a cast to ``dtype`` where given;
    float64 on the CPU."""
    if tensor.ndim == 2:
        return matrix_fingerprint(tensor, probe(tensor.shape[1]), dtype).cpu()
    values = tensor.detach() if dtype is None else tensor.detach().to(dtype)
    return values.double().reshape(-1).cpu()


def fingerprints(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor's fingerprint, after a cast to ``dtype`` (the rollout engine's) where given."""
    return {name: tensor_fingerprint(t, dtype) for name, t in state.items()}


def check_fingerprints(expected: Mapping[str, torch.Tensor], actual: Mapping[str, torch.Tensor],
                       rtol: float) -> None:
    """Raise ``WeightSyncError`` for the first tensor the sync did not send, the engine lacks, or that differs.

    An ``actual`` fingerprint may be longer than its ``expected`` one (an engine pads its vocabulary
    rows); the difference is measured against the largest magnitude of the expected fingerprint.
    """
    unsent = [name for name in actual if name not in expected]
    if unsent:
        raise WeightSyncError(unsent[0], f"the sync did not send it ({len(unsent)} tensors missing)")
    for name, want in expected.items():
        if name not in actual:
            raise WeightSyncError(name, "the engine has no such tensor")
        got = actual[name]
        if got.numel() < want.numel():
            raise WeightSyncError(name, f"{got.numel()} fingerprint values, the trainer's have {want.numel()}")
        diff = float((got[: want.numel()] - want).abs().max()) if want.numel() else 0.0
        scale = float(want.abs().max()) if want.numel() else 0.0
        if diff > rtol * scale + 1e-12:
            raise WeightSyncError(name, f"fingerprints differ by {diff:.3g}, {diff / max(scale, 1e-30):.2g} of "
                                        f"their largest value {scale:.3g}; tolerance {rtol:g}")
