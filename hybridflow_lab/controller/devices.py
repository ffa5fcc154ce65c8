"""Which torch device a rank runs on, checked before any role is built."""

from __future__ import annotations

import torch

DEVICE_KINDS = ("cpu", "cuda")


def rank_device(requested: str, backend: str) -> str:
    """The device string a rank's roles put their tensors on, from its pool's ``requested`` device.

    ``"cpu"``; ``"cuda"``: on the ray backend the one GPU Ray shows this rank (``cuda:0``), locally the
    current one; ``"cuda:<i>"``: that GPU (the local backend; a ray rank sees only index 0). Raises
    ``ValueError`` naming the device when this process cannot use it.
    """
    try:
        device = torch.device(requested)
    except RuntimeError as exc:
        raise ValueError(f"device {requested!r} is not a device name; use one of {', '.join(DEVICE_KINDS)}") from exc
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise ValueError(f"device {requested!r}: ranks run on {' or '.join(DEVICE_KINDS)}, not {device.type}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {requested!r} is not usable here: torch {torch.__version__} sees no CUDA device "
                         f"(CUDA build: {torch.version.cuda or 'none'}); place the group on a CPU pool "
                         "(device='cpu') or run on a machine with GPUs")
    visible = torch.cuda.device_count()
    index = device.index if device.index is not None else 0 if backend == "ray" else torch.cuda.current_device()
    if index >= visible:
        where = "Ray shows each rank only its own GPU, cuda:0" if backend == "ray" else f"{visible} GPU(s) visible"
        raise ValueError(f"device {requested!r} does not exist: {where}")
    torch.cuda.set_device(index)
    return f"cuda:{index}"
