"""What one stage of a run did (seconds, rows, tokens, bytes moved, which ranks ran), from its spans: what a
notebook shows above the batch a stage returns."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.telemetry.samples import sample_rows
from hybridflow_lab.telemetry.spans import Phase, Span
from hybridflow_lab.telemetry.summary import format_bytes

MOVED_PHASES = (Phase.DISPATCH, Phase.COLLECT, Phase.TRANSFER)
ENVIRONMENT_ROLE = "environment"  # the spans of a multi-turn rollout's environment steps (tool calls named "tool")


@dataclass
class StageSummary:
    """Filled while the stage runs (``spans``) and when it ends (``seconds``); rendered by notebooks."""

    stage: str
    step: int
    seconds: float = 0.0
    spans: list[Span] = field(default_factory=list)
    rows: int = 0
    tokens: int = 0
    samples: list[dict[str, Any]] = field(default_factory=list)
    concurrent: list[str] = field(default_factory=list)  # stages that ran at the same time (an overlapped step)
    columns: dict[str, dict[str, Any]] = field(default_factory=dict)  # what it produced: name -> shape, dtype, bytes

    @property
    def bytes_moved(self) -> int:
        """Bytes sent to and received from the worker ranks (and between groups) during the stage."""
        return sum(s.bytes_moved for s in self.spans if s.phase in MOVED_PHASES)

    @property
    def environment(self) -> dict[str, float]:
        """A multi-turn rollout's environment steps (role ``environment`` spans): how many, how many were tool
        calls, and their seconds; empty for a stage without any."""
        steps = [s for s in self.spans if s.role == ENVIRONMENT_ROLE]
        if not steps:
            return {}
        return {"steps": len(steps), "calls": sum(s.name == "tool" for s in steps),
                "seconds": sum(s.duration for s in steps)}

    @property
    def worker_calls(self) -> dict[str, list[int]]:
        """``"<group>.<method>"`` -> the ranks that executed it."""
        calls: dict[str, list[int]] = {}
        for span in self.spans:
            if span.phase is Phase.EXECUTE:
                calls.setdefault(f"{span.group}.{span.name}", []).append(span.rank)
        return calls

    def attach(self, batch: DataBatch, samples: int = 3) -> DataBatch:
        """Describe ``batch`` as this stage's output and make it display this summary."""
        self.rows = len(batch)
        self.columns = column_sizes(batch)
        mask = batch.get("attention_mask")
        self.tokens = int(mask.sum()) if mask is not None else 0
        if "response_text" in batch:
            self.samples = sample_rows(batch, samples)
        batch.summary = self
        return batch

    def attach_metrics(self, metrics: dict[str, float]) -> StageMetrics:
        """The metrics an update stage returns, displayed with this summary."""
        result = StageMetrics(metrics)
        result.summary = self
        return result

    def headline(self) -> str:
        parts = [f"{self.stage} (step {self.step})", f"{self.seconds:.3f} s"]
        if self.rows:
            parts.append(f"{self.rows} rows")
        if self.tokens:
            parts.append(f"{self.tokens} tokens")
        parts.append(f"{format_bytes(self.bytes_moved)} moved")
        parts += [f"{call} on ranks {ranks}" for call, ranks in self.worker_calls.items()]
        if self.concurrent:
            parts.append(f"alongside {', '.join(self.concurrent)}")
        return " · ".join(parts)

    def __str__(self) -> str:
        return self.headline()

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{html.escape(r.get('prompt', ''))}</td><td>{html.escape(r.get('response', ''))}</td>"
                       f"<td>{r.get('score', '')}</td></tr>" for r in self.samples)
        table = f"<table><tr><th>prompt</th><th>response</th><th>score</th></tr>{rows}</table>" if rows else ""
        return f"<div class='hybridflow-stage'><b>{html.escape(self.headline())}</b>{table}</div>"


def column_sizes(batch: DataBatch) -> dict[str, dict[str, Any]]:
    """Each column of ``batch``: its ``shape``, ``dtype`` and ``bytes`` (what the dataflow graph labels edges with)."""
    sizes = {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                    "bytes": t.element_size() * t.numel()} for name, t in batch.tensors.items()}
    sizes.update({name: {"shape": list(a.shape), "dtype": str(a.dtype), "bytes": int(a.nbytes)}
                  for name, a in batch.non_tensors.items()})
    return sizes


class StageMetrics(dict):
    """The metrics dict an update stage returns, displayed with its stage summary."""

    summary: StageSummary | None = None

    def _repr_html_(self) -> str:
        header = self.summary._repr_html_() if self.summary is not None else ""
        items = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.4g}</td></tr>" for k, v in sorted(self.items()))
        return f"{header}<table>{items}</table>"
