"""Telemetry: the span store, listeners, stages, JSONL round trips and clock alignment."""

from __future__ import annotations

import json

from hybridflow_lab.controller import ResourcePool, Role, WorkerGroup
from hybridflow_lab.controller.ray_backend import clock_offset
from hybridflow_lab.telemetry import JsonlSink, Phase, Span, TelemetryStore, read_jsonl, span_table
from tests.workers import Echo


def test_store_stamps_the_current_step_and_notifies_listeners():
    store = TelemetryStore()
    seen = []
    unsubscribe = store.subscribe(seen.extend)
    store.step = 3
    store.record([Span("gen", Phase.STAGE, 1.0, 2.0), Span("x", Phase.STAGE, 2.0, 3.0, step=1)])
    assert [s.step for s in store.spans()] == [3, 1]
    assert len(seen) == 2
    unsubscribe()
    store.record([Span("late", Phase.STAGE, 3.0, 4.0)])
    assert len(seen) == 2 and len(store) == 3


def test_store_keeps_only_the_newest_spans_in_memory():
    store = TelemetryStore(max_spans=5)
    store.record([Span(str(i), Phase.STAGE, i, i + 1) for i in range(8)])
    assert [s.name for s in store.spans()] == ["3", "4", "5", "6", "7"]


def test_store_bound_holds_over_many_calls_while_the_jsonl_keeps_every_span(tmp_path):
    store = TelemetryStore(max_spans=10)
    sink = JsonlSink(tmp_path / "spans.jsonl").attach(store)
    group = WorkerGroup(Role(Echo), ResourcePool(2), backend="local", telemetry=store)
    try:
        for step in range(6):
            store.step = step
            group.where()
    finally:
        group.shutdown()
        sink.close()
    on_disk = list(read_jsonl(tmp_path / "spans.jsonl"))
    assert len(store) == store.max_spans == 10
    assert store.recorded == len(on_disk) > 10
    assert [s.step for s in on_disk if s.phase is Phase.CALL] == list(range(6))  # every call's spans on disk
    assert store.spans() == on_disk[-10:]  # memory holds the newest


def test_stage_context_records_duration_and_attrs():
    store = TelemetryStore()
    with store.stage("reward", prompts=4) as attrs:
        attrs["bytes_moved"] = 64
    (span,) = store.spans(phase=Phase.STAGE)
    assert span.name == "reward" and span.bytes_moved == 64 and span.attrs == {"prompts": 4}
    assert span.t_end >= span.t_start


def test_jsonl_sink_round_trip_and_torn_last_line(tmp_path):
    store = TelemetryStore()
    path = tmp_path / "run" / "spans.jsonl"
    sink = JsonlSink(path).attach(store)
    original = Span("update_actor", Phase.EXECUTE, 10.0, 12.5, group="actor", role="actor", rank=2, step=7,
                    bytes_moved=1024, call_id=9, attrs={"bytes_in": 512})
    store.record([original])
    sink.close()
    with path.open("a") as handle:
        handle.write(json.dumps(original.to_dict())[:20])  # a writer that stopped mid-line
    assert list(read_jsonl(path)) == [original]


def test_span_table_is_relative_to_the_first_span():
    table = span_table([Span("b", Phase.EXECUTE, 11.0, 11.5, rank=1), Span("a", Phase.DISPATCH, 10.0, 10.25)])
    assert table["name"].tolist() == ["a", "b"]
    assert table["start_ms"].tolist() == [0.0, 1000.0] and table["duration_ms"].tolist() == [250.0, 500.0]


def test_clock_offset_uses_the_tightest_ping():
    # remote clock runs 5 s ahead; the second ping has the shortest round trip
    pings = [(100.0, 105.4, 100.6), (200.0, 205.05, 200.1), (300.0, 305.9, 301.0)]
    assert abs(clock_offset(pings) - 5.0) < 1e-9
    assert clock_offset([]) == 0.0
