"""Telemetry: spans recorded by the controller and the workers, the store, sinks, and what a stage did."""

from hybridflow_lab.telemetry.dataflow_graph import WHOLE_BATCH, DataflowGraph, GraphEdge, GraphNode, dataflow_graph
from hybridflow_lab.telemetry.samples import sample_rows
from hybridflow_lab.telemetry.sinks import JsonlSink, read_jsonl
from hybridflow_lab.telemetry.spans import CONTROLLER_RANK, Phase, Span, SpanRecorder
from hybridflow_lab.telemetry.stage_summary import StageMetrics, StageSummary
from hybridflow_lab.telemetry.store import TelemetryStore, default_store
from hybridflow_lab.telemetry.summary import format_bytes, span_table

__all__ = ["CONTROLLER_RANK", "WHOLE_BATCH", "DataflowGraph", "GraphEdge", "GraphNode", "JsonlSink", "Phase", "Span",
           "SpanRecorder", "StageMetrics", "StageSummary", "TelemetryStore", "dataflow_graph", "default_store",
           "format_bytes", "read_jsonl", "sample_rows", "span_table"]
