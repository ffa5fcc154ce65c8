"""Telemetry: spans recorded by the controller and the workers, the store, and sinks."""

from hybridflow_lab.telemetry.sinks import JsonlSink, read_jsonl
from hybridflow_lab.telemetry.spans import CONTROLLER_RANK, Phase, Span, SpanRecorder
from hybridflow_lab.telemetry.store import TelemetryStore, default_store
from hybridflow_lab.telemetry.summary import format_bytes, span_table

__all__ = ["CONTROLLER_RANK", "JsonlSink", "Phase", "Span", "SpanRecorder", "TelemetryStore", "default_store",
           "format_bytes", "read_jsonl", "span_table"]
