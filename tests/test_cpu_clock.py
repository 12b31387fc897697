"""cores/<phase> and startup/<phase>: the CPU clock of the run's process tree, the spans that read it,
and the start-up milestones. No timing is asserted: CPU seconds of a fixed amount of work, and fake clocks."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from mmrl.utils import timing
from mmrl.utils.cpu_clock import ProcessTreeClock

BURN = """
import sys, time
t0 = time.process_time()
while time.process_time() - t0 < 0.4:  # 0.4 s of this process's own CPU, whatever the load
    pass
print(time.process_time() - t0, flush=True)
sys.stdin.read()  # stay alive until told to go, so the clock can still read its times
"""


def test_the_clock_counts_a_child_process_cpu_time() -> None:
    clock = ProcessTreeClock(refresh_s=0.0)
    before = clock()
    child = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        burnt = float(child.stdout.readline())
        after = clock()
    finally:
        child.communicate("")
    assert burnt >= 0.4 and after - before >= burnt


def test_a_root_that_exits_counts_nothing() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, text=True)
    clock = ProcessTreeClock(child.pid, refresh_s=0.0)
    child.communicate("")
    assert clock() == 0.0


def test_spans_report_cores_for_metered_phases_only(monkeypatch: pytest.MonkeyPatch) -> None:
    wall, cpu = iter([100.0, 102.0, 200.0, 201.0, 300.0, 304.0]), iter([10.0, 13.0, 20.0, 19.0])
    monkeypatch.setattr(timing.time, "time", lambda: next(wall))
    spans = timing.StepSpans(cpu_clock=lambda: next(cpu))
    with spans("train"):  # 3 CPU seconds in 2 wall seconds
        pass
    with spans("rollout"):  # a process exited mid-span: the clock went back, counted as 0
        pass
    with spans("data_wait"):  # not metered: the clock is not read
        pass
    assert spans.metrics() == {"time/train_s": 2.0, "time/rollout_s": 1.0, "time/data_wait_s": 4.0,
                               "cores/train": 1.5, "cores/rollout": 0.0}


def test_without_a_clock_only_seconds() -> None:
    spans = timing.StepSpans()
    with spans("train"):
        time.sleep(0)
    assert set(spans.metrics()) == {"time/train_s"}


def test_milestones_split_the_time_since_the_process_started(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([110.0, 114.5, 115.0])
    monkeypatch.setattr(timing.time, "time", lambda: next(clock))
    marks = timing.Milestones()
    marks.t0 = marks.last = 100.0  # the process started at 100
    marks.mark("imports")
    marks.mark("ray")
    marks.mark("imports")  # a phase met twice adds up
    assert marks.metrics() == {"startup/imports_s": 10.5, "startup/ray_s": 4.5, "startup/total_s": 15.0}


def test_cpu_seconds_by_kind_of_process() -> None:
    """by_process: the root is "driver", a process titled like a Ray actor or a vLLM process counts
    under its class (summed over instances), anything else under "ray" (Ray's own servers)."""
    clock = ProcessTreeClock(refresh_s=0.0)
    titles = ["ray::FakeActor.setup", "ray::FakeActor.train_step", "VLLM::EngineCore", "gcs_server"]
    children = [subprocess.Popen([title, "-c", BURN], executable=sys.executable, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True) for title in titles]
    try:
        burnt = [float(c.stdout.readline()) for c in children]
        kinds = clock.by_process()
    finally:
        for c in children:
            c.communicate("")
    assert kinds["FakeActor"] >= burnt[0] + burnt[1] and kinds["EngineCore"] >= burnt[2]
    assert kinds["ray"] >= burnt[3] and kinds["driver"] > 0
