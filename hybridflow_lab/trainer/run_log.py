"""Per-step metrics and sample rows: always JSONL files in the run directory, and wandb when enabled."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hybridflow_lab.redact import redact
from hybridflow_lab.telemetry.trajectory_view import trajectory_html

CONFIG_FILE = "config.json"


class MetricsLog:
    """Appends ``{"step": k, ...}`` lines to ``<run>/metrics.jsonl`` and sample rows to ``<run>/samples.jsonl``;
    mirrors both to wandb (metrics, and a ``samples`` table) if asked. The run's config (secrets redacted) goes to
    ``<run>/config.json``, which run comparisons read."""

    def __init__(self, run_dir: str | os.PathLike[str], wandb_project: str | None = None,
                 config: dict[str, Any] | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.samples_path = Path(run_dir) / "samples.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if config is not None:
            (Path(run_dir) / CONFIG_FILE).write_text(json.dumps(redact(config), indent=1, default=str))
        self.wandb_run = start_wandb(wandb_project, Path(run_dir), config) if wandb_project else None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        _append(self.path, [{"step": step, **metrics}])
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Rows with their ``step`` (prompt, response, score, ...)."""
        _append(self.samples_path, rows)
        if self.wandb_run is not None and rows:
            import wandb

            columns = list(rows[0])
            table = wandb.Table(columns=columns, data=[[wandb_cell(row.get(c), c) for c in columns] for row in rows])
            self.wandb_run.log({"samples": table}, step=step)

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps after ``step`` (resuming from a checkpoint replays them)."""
        for path in (self.path, self.samples_path):
            if path.is_file():
                kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
                staged = path.with_suffix(".tmp")
                staged.write_text("".join(line + "\n" for line in kept))
                os.replace(staged, path)  # readers following the file see a new file, never a half-written one

    def read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines()]

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _append(path: Path, records: list[dict[str, Any]]) -> None:
    with path.open("a") as handle:
        handle.write("".join(json.dumps(record) + "\n" for record in records))


def start_wandb(project: str, run_dir: Path, config: dict[str, Any] | None) -> Any:
    """A wandb run, offline unless WANDB_MODE says otherwise; never waits long for a network. The config is
    redacted first: wandb writes it into the run directory and uploads it."""
    import wandb

    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_INIT_TIMEOUT", "30")
    return wandb.init(project=project, dir=str(run_dir), config=redact(config or {}), name=run_dir.name,
                      settings=wandb.Settings(init_timeout=float(os.environ["WANDB_INIT_TIMEOUT"]),
                                              console="off", silent=True))


def wandb_cell(value: Any, column: str) -> Any:
    """A sample's cell for a wandb table: a trajectory as HTML (turn by turn), anything else as it is."""
    if column != "trajectory":
        return value
    import wandb

    return wandb.Html(trajectory_html(value))
