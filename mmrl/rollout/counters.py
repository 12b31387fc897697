"""What an engine counts about its own requests (both rollout backends): generated tokens, busy
time (any request in flight), weight-update pauses, and the peak of requests in flight. The
controller's EngineMonitor turns differences between two reads into per-step metrics."""
from __future__ import annotations

import time


class RequestCounters:
    def __init__(self) -> None:
        self.in_flight: set[str] = set()
        self.progress: dict[str, int] = {}  # tokens so far of each request in flight
        self.generated_tokens = 0
        self.pauses, self.pause_s = 0, 0.0
        self._busy_since: float | None = None
        self._busy_s = 0.0
        self._created = time.time()
        self._max_in_flight = 0

    def enter(self, request_id: str) -> None:
        if not self.in_flight:
            self._busy_since = time.time()
        self.in_flight.add(request_id)
        self._max_in_flight = max(self._max_in_flight, len(self.in_flight))

    def leave(self, request_id: str, tokens: int = 0) -> None:
        self.in_flight.discard(request_id)
        self.progress.pop(request_id, None)
        self.generated_tokens += tokens
        if not self.in_flight and self._busy_since is not None:
            self._busy_s += time.time() - self._busy_since
            self._busy_since = None

    def paused(self, seconds: float) -> None:
        self.pauses += 1
        self.pause_s += seconds

    def stats(self, reset_peaks: bool = False) -> dict[str, float]:
        """Totals so far and the peak of requests in flight since the last reset."""
        busy = self._busy_s + (time.time() - self._busy_since if self._busy_since is not None else 0.0)
        out = {"in_flight": float(len(self.in_flight)), "max_in_flight": float(self._max_in_flight),
               "generated_tokens": float(self.generated_tokens), "busy_s": busy,
               "alive_s": time.time() - self._created, "pauses": float(self.pauses), "pause_s": self.pause_s}
        if reset_peaks:
            self._max_in_flight = len(self.in_flight)
        return out
