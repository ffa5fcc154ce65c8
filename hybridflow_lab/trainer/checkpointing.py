"""Step checkpoints written atomically: a crash while saving leaves the previous one usable.

Layout: ``<run>/checkpoints/step_000010/`` holds each role's engine checkpoint,
``trainer_state.json`` and ``manifest.json`` (every file's size and SHA-256);
``<run>/checkpoints/latest`` names the newest complete one. A checkpoint is written into
``step_000010.tmp`` and renamed when every part is on disk; ``verify`` checks a checkpoint
against its manifest before it is loaded, so a truncated or altered file is named, not loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete or damaged; the message names the file and the earlier checkpoints."""


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
    _write_atomic(staging / MANIFEST, json.dumps(_manifest(staging), indent=1))
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


def discard_staging(run_dir: str | os.PathLike[str], step: int) -> None:
    """Remove what a failed save of ``step`` left behind."""
    shutil.rmtree(step_dir(run_dir, step).with_suffix(".tmp"), ignore_errors=True)


def read_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE_FILE).read_text())


def verify(checkpoint: Path) -> None:
    """Raise ``CheckpointError`` unless every file the manifest lists is there with its size and SHA-256."""
    manifest_path = checkpoint / MANIFEST
    if not manifest_path.is_file():
        _damaged(checkpoint, f"it has no {MANIFEST} (it was not completely written)")
    for name, (size, digest) in json.loads(manifest_path.read_text()).items():
        path = checkpoint / name
        if not path.is_file():
            _damaged(checkpoint, f"{name} is missing")
        if path.stat().st_size != size:
            _damaged(checkpoint, f"{name} has {path.stat().st_size} bytes, {size} were written (truncated?)")
        if _sha256(path) != digest:
            _damaged(checkpoint, f"{name} is not the file that was written (its SHA-256 differs)")


def _damaged(checkpoint: Path, problem: str) -> None:
    others = sorted(p.name for p in checkpoint.parent.glob("step_*") if p.is_dir() and p != checkpoint
                    and not p.name.endswith(".tmp"))
    fallback = f"load an earlier one: {', '.join(others)}" if others else "there is no earlier checkpoint"
    raise CheckpointError(f"checkpoint {checkpoint} is damaged: {problem}; {fallback}")


def _manifest(root: Path) -> dict[str, tuple[int, str]]:
    return {str(path.relative_to(root)): (path.stat().st_size, _sha256(path))
            for path in sorted(root.rglob("*")) if path.is_file()}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


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
