"""Each step's batches kept at stage boundaries (``trainer.capture``), on disk as safetensors and JSON.

A capture of stage S at step n is the step's batch as it stood after S: every column written by the stages
that started up to S (a column a later stage rewrote, like DAPO's shaped scores, holds its final value). They
live in ``<run_dir>/captures/step_<n>/<S>.safetensors`` (tensor columns) and ``<S>.json`` (non-tensor
columns, meta, and the step's stages in order); no pickles. ``lab.replay`` reads them back.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import load_file, save_file

from hybridflow_lab.config import ConfigError, LabConfig
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.telemetry import DataflowGraph
from hybridflow_lab.telemetry.dataflow_graph import NOT_DATAFLOW
from hybridflow_lab.trainer.stages import Stage

CAPTURES = "captures"
ALL = "all"


def captured_stages(config: LabConfig) -> list[str]:
    """The stages ``trainer.capture`` names (``all``: every stage of the dataflow); a ``ConfigError`` naming the
    key for a name that is no stage."""
    names = [name.strip() for name in config.trainer.capture.split(",") if name.strip()]
    if names == [ALL]:
        return [stage.value for stage in Stage if stage.value not in NOT_DATAFLOW]
    known = [stage.value for stage in Stage]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ConfigError("trainer.capture", f"{unknown[0]!r} is not a stage; name stages of the dataflow "
                          f"({', '.join(known)}) separated by commas, or 'all'")
    return names


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CAPTURES / f"step_{step:06d}"


def capture_step(run_dir: Path, step: int, batch: DataBatch, graph: DataflowGraph, stages: list[str],
                 keep: int) -> list[str]:
    """Write step ``step``'s batch after each of ``stages`` that ran in it (``graph``: its stages, in order, and
    the columns each wrote); keep the newest ``keep`` steps' captures (0: all). Returns the stages written."""
    directory = step_dir(run_dir, step)
    directory.mkdir(parents=True, exist_ok=True)
    done = [node for node in graph.nodes if node.status == "done"]
    written = []
    columns = set(batch.columns()) - {c for node in done for c in node.writes}  # made before the step (ahead)
    for node in done:
        columns |= set(node.writes)
        if node.key in stages:
            present = sorted(columns & set(batch.columns()))
            _write(directory / node.key, batch.select(*present), {"step": step, "stage": node.key,
                                                                      "stages": [n.key for n in done]})
            written.append(node.key)
    if keep:
        for old in sorted((run_dir / CAPTURES).glob("step_*"))[:-keep]:
            shutil.rmtree(old)
    return written


def _write(stem: Path, batch: DataBatch, info: dict[str, Any]) -> None:
    save_file({name: tensor.detach().cpu().contiguous().clone() for name, tensor in batch.tensors.items()},
              str(stem.with_suffix(".safetensors")))
    columns = {name: {"dtype": str(array.dtype), "values": array.tolist()} for name, array in batch.non_tensors.items()}
    record = {**info, "rows": len(batch), "non_tensors": columns, "meta": batch.meta}
    stem.with_suffix(".json").write_text(json.dumps(record, default=str))


def captures(run_dir: Path) -> dict[int, list[str]]:
    """Step -> the stages captured in it, for every capture on disk."""
    found: dict[int, list[str]] = {}
    for path in sorted((run_dir / CAPTURES).glob("step_*/*.json")):
        found.setdefault(int(path.parent.name.removeprefix("step_")), []).append(path.stem)
    return found


def read_capture(run_dir: Path, step: int, stage: str) -> tuple[DataBatch, dict[str, Any]]:
    """The batch captured after ``stage`` at ``step``, and its record (the step's stages in order); an error
    listing the captures there are when it is not on disk."""
    stem = step_dir(run_dir, step) / stage
    if not stem.with_suffix(".json").exists():
        have = "; ".join(f"step {s}: {', '.join(names)}" for s, names in captures(run_dir).items()) or "none"
        raise FileNotFoundError(f"no capture of stage {stage!r} at step {step} under {run_dir / CAPTURES} (captures "
                                f"there: {have}); set trainer.capture={stage} and run the step")
    record = json.loads(stem.with_suffix(".json").read_text())
    non_tensors = {name: _column(column) for name, column in record.pop("non_tensors").items()}
    tensors = load_file(str(stem.with_suffix(".safetensors")))
    return DataBatch(tensors, non_tensors, record.pop("meta"), batch_size=record["rows"]), record


def _column(column: dict[str, Any]) -> np.ndarray:
    if column["dtype"] != "object":
        return np.asarray(column["values"], dtype=column["dtype"])
    array = np.empty(len(column["values"]), dtype=object)  # one object per row, even rows that are lists
    for row, value in enumerate(column["values"]):
        array[row] = value
    return array
