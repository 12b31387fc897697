"""Per-step timing spans: `with spans("rollout"): ...` accumulates seconds under time/rollout_s."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class StepSpans:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.events: list[tuple[str, float, float]] = []  # (name, start, duration) for trace files

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            duration = time.time() - start
            self.seconds[name] = self.seconds.get(name, 0.0) + duration
            self.events.append((name, start, duration))

    def add(self, name: str, start: float, duration: float) -> None:
        """A span measured elsewhere (e.g. one engine's share of the rollout)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + duration
        self.events.append((name, start, duration))

    def metrics(self) -> dict[str, float]:
        return {f"time/{name}_s": value for name, value in self.seconds.items()}
