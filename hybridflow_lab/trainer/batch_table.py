"""A batch as a table to read: prompts as the model read them, responses, scores, advantages."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.tasks.prompts import rendered_prompts
from hybridflow_lab.telemetry import sample_rows
from hybridflow_lab.telemetry.trajectory_view import trajectory_html


def batch_table(tokenizer: PreTrainedTokenizerBase, batch: DataBatch, rows: int, special_tokens: bool) -> Any:
    """The first ``rows`` rows of ``batch`` as a pandas DataFrame; ``prompt`` is the text the model read (the
    prompt as rendered by the chat template, its special tokens written out with ``special_tokens``). A multi-turn
    batch's table is styled: its ``trajectory`` column shows each row turn by turn (``.data`` is the DataFrame)."""
    import pandas as pd

    table = sample_rows(batch, rows)
    for row, prompt in zip(table, rendered_prompts(tokenizer, batch[: len(table)], special_tokens), strict=True):
        row["prompt"] = prompt
    frame = pd.DataFrame(table)
    if "trajectory" not in frame:
        return frame
    return frame.drop(columns="response").style.format({"trajectory": trajectory_html})
