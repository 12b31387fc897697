"""The Chrome/Perfetto trace writer shared by `mmrl train` and `mmrl profile-data`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmrl.utils.trace import TraceWriter, load_trace


def test_spans_on_named_tracks_in_microseconds(tmp_path: Path) -> None:
    trace = TraceWriter(tmp_path / "trace.json")
    trace.span("decode", 100.0, 0.25, process="loader", thread="worker 0", args={"key": "a"})
    trace.span("decode", 100.5, 0.5, process="loader", thread="worker 1")
    trace.span("train", 101.0, 1.0, process="train", thread="train")
    trace.counter("queue", 101.5, {"depth": 3})
    trace.flush()
    events = load_trace(tmp_path / "trace.json")
    spans = [e for e in events if e["ph"] == "X"]
    assert [(e["ts"], e["dur"]) for e in spans] == [(0.0, 250000.0), (500000.0, 500000.0), (1000000.0, 1000000.0)]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[(spans[0]["pid"], spans[0]["tid"])] == "worker 0" and names[(spans[1]["pid"], spans[1]["tid"])] == "worker 1"
    assert spans[0]["pid"] == spans[1]["pid"] != spans[2]["pid"]  # one process per name
    assert trace.num_spans == 3 and spans[0]["args"] == {"key": "a"}


def test_malformed_events_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "a", "pid": 1}]}))
    with pytest.raises(ValueError, match="malformed"):
        load_trace(path)
