"""One supervised warm start per (demo task, seed, steps), trained once and shared by the tutorials.

Several tutorials start from the same tiny fine-tuned model; training it in each costs tens of seconds per
notebook. The cache keys a warm start by its settings and by a fingerprint of the source that produces it
(the model builder, the tokenizer, the tasks, SFT), so an edit to any of them trains a new one. It lives in
``$HYBRIDFLOW_CACHE`` (default ``~/.cache/hybridflow_lab``); delete that directory to start clean.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

import hybridflow_lab
from hybridflow_lab.config.presets import resolve_config
from hybridflow_lab.demos.demo_tasks import DEMO_TASKS, DemoTask, warm_start

CACHE_ENV = "HYBRIDFLOW_CACHE"
METRICS_FILE = "sft_metrics.json"
_SOURCES = ("models", "tasks", "trainer/sft.py", "trainer/task_setup.py", "demos/demo_tasks.py", "seeds.py")


def cache_root() -> Path:
    """Where cached artefacts live: ``$HYBRIDFLOW_CACHE``, or ``~/.cache/hybridflow_lab``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hybridflow_lab")


def fingerprint(demo: DemoTask) -> str:
    """A short hash of ``demo``, its preset's task settings, the package source a warm start depends on and
    the torch version."""
    package = Path(hybridflow_lab.__file__).parent
    digest = hashlib.sha256(f"{demo!r} {resolve_config(demo.preset).task!r} {torch.__version__}".encode())
    for name in _SOURCES:
        path = package / name
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(file.relative_to(package).as_posix().encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:12]


def cached_warm_start(demo: str, seed: int = 0, max_steps: int | None = None) -> tuple[Path, dict[str, float]]:
    """The model directory and SFT metrics of ``warm_start`` on ``DEMO_TASKS[demo]``: from the cache, or trained
    now and cached. Concurrent callers each train and the first to finish is kept (the rename is atomic)."""
    if demo not in DEMO_TASKS:
        raise ValueError(f"unknown demo task {demo!r}; known: {', '.join(DEMO_TASKS)}")
    steps = "target" if max_steps is None else str(max_steps)
    entry = cache_root() / "warm_starts" / f"{demo}-seed{seed}-steps{steps}-{fingerprint(DEMO_TASKS[demo])}"
    if not (entry / METRICS_FILE).exists():
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
        metrics = warm_start(staging, DEMO_TASKS[demo], seed, max_steps)
        shutil.rmtree(staging / "base")
        (staging / METRICS_FILE).write_text(json.dumps(metrics))
        try:
            staging.rename(entry)
        except OSError:  # another process cached it first
            shutil.rmtree(staging)
    return entry / "sft", json.loads((entry / METRICS_FILE).read_text())
