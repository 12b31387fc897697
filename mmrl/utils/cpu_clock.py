"""CPU seconds used by this run's processes, for "how much of the machine did each phase use".

With a local Ray instance (mmrl's default) every process of a run descends from the driver: Ray's
own servers, the engine actors and their vLLM engine cores, the trainer ranks, the rollout and
reward workers. Their summed user + system CPU time, sampled at the start and end of a span,
gives `cores = CPU seconds / wall seconds` for that span (2.0: both cores of a 2-core machine busy
the whole time). Against a remote Ray cluster the actors are not the driver's children, so the
clock is not used there (`Runtime.cpu_clock` is None).
"""
from __future__ import annotations

import os
import time

import psutil


class ProcessTreeClock:
    """Call it for the CPU seconds used so far by a process and all its descendants.

    The process list is re-read at most every `refresh_s` seconds (walking /proc costs
    milliseconds; reading a known process's times costs microseconds). A process that exits
    takes its seconds with it, so a difference between two readings can be negative across an
    exit: callers clamp at 0."""

    def __init__(self, pid: int | None = None, refresh_s: float = 10.0):
        self.root = psutil.Process(pid if pid is not None else os.getpid())
        self.refresh_s = refresh_s
        self._procs: list[psutil.Process] = []
        self._listed_at = float("-inf")

    def _processes(self) -> list[psutil.Process]:
        now = time.monotonic()
        if now - self._listed_at >= self.refresh_s:
            self._procs = [self.root, *self._children()] if self.root.is_running() else []
            self._listed_at = now
        return self._procs

    def __call__(self) -> float:
        total = 0.0
        for p in self._processes():
            try:
                t = p.cpu_times()
            except psutil.Error:  # exited since it was listed
                continue
            total += t.user + t.system
        return total

    def by_process(self) -> dict[str, float]:
        """CPU seconds so far per kind of process in the tree: Ray actors and vLLM processes by
        their class ("TrainerWorker", "RolloutEngine", "EngineCore", "Worker", ...), summed over
        instances; "driver" for the root; "ray" for Ray's own servers and agents. Where a run's
        start-up goes on a small machine: each process pays its imports."""
        out: dict[str, float] = {}
        for p in [self.root, *self._children()]:
            try:
                title = (p.cmdline() or [p.name()])[0]
                t = p.cpu_times()
            except psutil.Error:
                continue
            if p.pid == self.root.pid:
                kind = "driver"
            elif title.startswith(("ray::", "VLLM::")):
                kind = title.split("::", 1)[1].split(".", 1)[0] or "ray"
            else:
                kind = "ray"  # gcs_server, raylet, dashboard, log monitor, agents
            out[kind] = out.get(kind, 0.0) + t.user + t.system
        return out

    def _children(self) -> list[psutil.Process]:
        try:
            return self.root.children(recursive=True)
        except psutil.Error:  # the root itself is gone: nothing to count
            return []
