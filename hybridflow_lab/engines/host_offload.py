"""Host-memory copies of a training engine's device state, for the offload around a generation.

The buffers are allocated at the first offload and reused by every later one (pinned where CUDA is available,
so the copies run at full speed and the pinned pool does not grow at every step).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch.distributed.tensor import DTensor


class HostCopies:
    """One host buffer per offloaded tensor, kept for the next offload."""

    def __init__(self) -> None:
        self.buffers: dict[Hashable, torch.Tensor] = {}

    def copy(self, key: Hashable, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in the host buffer kept under ``key`` (allocated when missing or of another shape)."""
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=torch.cuda.is_available())
            self.buffers[key] = buffer
        return buffer.copy_(tensor)


def offload_optimizer_state(optimizer: torch.optim.Optimizer, device: str, host: HostCopies) -> list[tuple[dict, str]]:
    """Move the optimizer's state tensors on ``device`` into ``host``'s buffers; returns where each was.

    AdamW keeps its step counts on the CPU (a device step would cost a sync per update): they stay there. FSDP2's
    sharded state (DTensors) moves with ``DTensor.to``, into new host memory each time.
    """
    moved = []
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.device == torch.device(device):
                state[key] = value.to("cpu") if isinstance(value, DTensor) else host.copy((id(state), key), value)
                moved.append((state, key))
    return moved


def reload_optimizer_state(moved: list[tuple[dict, str]], device: str) -> None:
    """Put the state ``offload_optimizer_state`` moved back on ``device`` (the host buffers stay for the next time)."""
    for state, key in moved:
        state[key] = state[key].to(device)
