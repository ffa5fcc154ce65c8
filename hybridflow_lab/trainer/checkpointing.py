"""Step checkpoints written atomically: a crash while saving leaves the previous one usable.

Layout: ``<run>/checkpoints/step_000010/`` holds each role's engine checkpoint and
``trainer_state.json``; ``<run>/checkpoints/latest`` names the newest complete one. A
checkpoint is written into ``step_000010.tmp`` and renamed when every part is on disk.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

STATE_FILE = "trainer_state.json"
LATEST = "latest"


def step_dir(run_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def staging_dir(run_dir: str | os.PathLike[str], step: int) -> Path:
    """The directory to write a checkpoint into before ``commit`` (emptied first)."""
    staging = step_dir(run_dir, step).with_suffix(".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def commit(run_dir: str | os.PathLike[str], step: int, state: dict[str, Any], keep: int) -> Path:
    """Write the trainer state, rename the staging directory into place, point ``latest`` at it."""
    staging, final = step_dir(run_dir, step).with_suffix(".tmp"), step_dir(run_dir, step)
    _write_atomic(staging / STATE_FILE, json.dumps(state, indent=1))
    _fsync_tree(staging)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    _write_atomic(final.parent / LATEST, final.name)
    _prune(final.parent, keep)
    return final


def latest(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint, or None."""
    pointer = Path(run_dir) / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{pointer} names {path.name}, which has no {STATE_FILE}: the checkpoint is damaged")
    return path


def read_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE_FILE).read_text())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())


def _prune(checkpoints: Path, keep: int) -> None:
    steps = sorted(p for p in checkpoints.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
