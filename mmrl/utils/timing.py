"""Per-step timing spans: `with spans("rollout"): ...` accumulates seconds under time/rollout_s.

Given a CPU clock (mmrl/utils/cpu_clock.py), the phases in `METERED` also record the CPU seconds
the run's processes used during them, reported as cores/<span> = CPU seconds / wall seconds: how
much of the machine the phase kept busy."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

METERED = frozenset({"rollout", "reward", "logprob", "train", "weight_sync", "eval"})


class Milestones:
    """Seconds between named points, counted from the process's own start (imports included):
    the start-up of a run, phase by phase (`startup/<phase>_s`, `startup/total_s`)."""

    def __init__(self) -> None:
        import psutil

        self.t0 = psutil.Process().create_time()
        self.last = self.t0
        self.seconds: dict[str, float] = {}
        self.ready_at: dict[str, float] = {}

    def ready(self, name: str) -> None:
        """`name` (e.g. the engines) is ready now: seconds since the process start, kept beside
        the phases (`startup_ready/<name>_s`); of several processes that start side by side, the
        latest to come up shows the critical path."""
        self.ready_at[name] = time.time() - self.t0

    def mark(self, name: str) -> None:
        """The time since the previous mark (or the process start) is phase `name`."""
        now = time.time()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.last = now

    def metrics(self) -> dict[str, float]:
        out = {f"startup/{name}_s": s for name, s in self.seconds.items()}
        out["startup/total_s"] = self.last - self.t0
        out.update({f"startup_ready/{name}_s": s for name, s in self.ready_at.items()})
        return out


class StepSpans:
    def __init__(self, cpu_clock: Callable[[], float] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        self.events: list[tuple[str, float, float]] = []  # (name, start, duration) for trace files
        self.cpu_clock = cpu_clock

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        clock = self.cpu_clock if name in METERED else None
        cpu_start = clock() if clock else 0.0
        start = time.time()
        try:
            yield
        finally:
            duration = time.time() - start
            self.seconds[name] = self.seconds.get(name, 0.0) + duration
            self.events.append((name, start, duration))
            if clock:  # a process that exited mid-span takes its seconds along: never below 0
                self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + max(0.0, clock() - cpu_start)

    def add(self, name: str, start: float, duration: float) -> None:
        """A span measured elsewhere (e.g. one engine's share of the rollout)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + duration
        self.events.append((name, start, duration))

    def metrics(self) -> dict[str, float]:
        out = {f"time/{name}_s": value for name, value in self.seconds.items()}
        out.update({f"cores/{name}": cpu / self.seconds[name]
                    for name, cpu in self.cpu_seconds.items() if self.seconds[name] > 0})
        return out
