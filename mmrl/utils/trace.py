"""Chrome / Perfetto trace files ("Trace Event Format", JSON object form).

Both the data profiler (per-sample spans on per-worker tracks) and `mmrl train` (per-step spans:
data wait, rollout per engine, reward, train, weight sync, ...) write through this one class.
Open the file in https://ui.perfetto.dev or chrome://tracing.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any


class TraceWriter:
    """Collects complete ("X") events on named tracks and writes `trace.json`.

    A track is a (process, thread) pair named by strings, e.g. ("loader", "worker 1") or
    ("train", "rollout/engine 0"); numeric ids are assigned in first-seen order and named with
    metadata events so the viewer shows the names. Times are seconds (time.time() or
    perf_counter(), consistently); the file stores microseconds relative to the first event.
    """

    def __init__(self, path: str | Path, *, flush_every: int = 0):
        self.path = Path(path)
        self.flush_every = flush_every  # rewrite the file every k events (0 = only on flush/close)
        self._events: list[dict[str, Any]] = []
        self._pids: dict[str, int] = {}
        self._tids: dict[tuple[str, str], int] = {}
        self._t0: float | None = None
        self._lock = threading.Lock()
        self._since_flush = 0

    def _track(self, process: str, thread: str) -> tuple[int, int]:
        if process not in self._pids:
            self._pids[process] = len(self._pids) + 1
            self._events.append({"ph": "M", "name": "process_name", "pid": self._pids[process], "tid": 0,
                                 "args": {"name": process}})
        pid = self._pids[process]
        if (process, thread) not in self._tids:
            self._tids[(process, thread)] = len([k for k in self._tids if k[0] == process]) + 1
            self._events.append({"ph": "M", "name": "thread_name", "pid": pid,
                                 "tid": self._tids[(process, thread)], "args": {"name": thread}})
        return pid, self._tids[(process, thread)]

    def span(self, name: str, start_s: float, duration_s: float, *, process: str = "mmrl",
             thread: str = "main", category: str = "", args: dict[str, Any] | None = None) -> None:
        """Record one complete event that began at `start_s` and lasted `duration_s` seconds."""
        with self._lock:
            if self._t0 is None:
                self._t0 = start_s
            pid, tid = self._track(process, thread)
            event: dict[str, Any] = {"ph": "X", "name": name, "cat": category or process, "pid": pid, "tid": tid,
                                     "ts": round((start_s - self._t0) * 1e6, 3),
                                     "dur": round(max(duration_s, 0.0) * 1e6, 3)}
            if args:
                event["args"] = args
            self._events.append(event)
            self._since_flush += 1
            due = self.flush_every and self._since_flush >= self.flush_every
        if due:
            self.flush()

    def counter(self, name: str, time_s: float, values: dict[str, float], *, process: str = "mmrl") -> None:
        """A counter track (e.g. queue depth, reward mean) drawn as a graph under `process`."""
        with self._lock:
            if self._t0 is None:
                self._t0 = time_s
            pid, _ = self._track(process, "main")
            self._events.append({"ph": "C", "name": name, "pid": pid, "ts": round((time_s - self._t0) * 1e6, 3),
                                 "args": {k: float(v) for k, v in values.items()}})

    @property
    def num_spans(self) -> int:
        return sum(1 for e in self._events if e["ph"] == "X")

    def flush(self) -> Path:
        """Write the whole trace atomically (a reader never sees half a file)."""
        with self._lock:
            payload = {"traceEvents": list(self._events), "displayTimeUnit": "ms"}
            self._since_flush = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(payload))
        os.replace(tmp, self.path)
        return self.path


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """The events of a trace file, checked for the fields every Chrome trace event needs."""
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    for e in events:
        missing = {"ph", "name", "pid"} - set(e)
        if missing or (e["ph"] == "X" and not {"ts", "dur", "tid"} <= set(e)):
            raise ValueError(f"{path}: malformed trace event {e} (missing {sorted(missing) or 'ts/dur/tid'})")
    return events
