"""A few rows of a step's batch as plain dicts: what ``lab.show``, the dashboards and wandb display."""

from __future__ import annotations

from typing import Any

from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.telemetry.trajectory_view import trajectory_parts

TEXT_COLUMNS = {"prompt_text": "prompt", "response_text": "response", "ground_truth": "ground_truth"}
SCALAR_COLUMNS = {"scores": "score", "costs": "cost"}


def sample_rows(batch: DataBatch, rows: int = 8) -> list[dict[str, Any]]:
    """The first ``rows`` sequences: prompt, response, ground truth, score (cost) and mean advantage; for
    multi-turn rollouts also the ``trajectory`` turn by turn (``trajectory_parts``), its turns and its ending."""
    head = batch[: min(rows, len(batch))]
    table: list[dict[str, Any]] = [{} for _ in range(len(head))]
    for key, name in TEXT_COLUMNS.items():
        if key in head:
            for row, value in zip(table, head[key], strict=True):
                row[name] = str(value)
    for key, name in SCALAR_COLUMNS.items():
        if key in head:
            for row, value in zip(table, head[key].tolist(), strict=True):
                row[name] = float(value)
    if "advantages" in head:
        mask = head["response_mask"].float()
        means = (head["advantages"] * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        for row, value in zip(table, means.tolist(), strict=True):
            row["advantage"] = value
    if "segments" in head:
        for row, segments, rewards, turns, ended in zip(table, head["segments"], head["turn_rewards"],
                                                        head["turns"], head["ended"], strict=True):
            row.update(trajectory=trajectory_parts(segments, rewards), turns=int(turns), ended=str(ended))
    return table
