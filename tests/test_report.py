"""`mmrl report`: step-time breakdown numbers, hints, plots and errors on a synthetic run (the
report on a real run is checked on the demo run in test_train_e2e.py)."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from mmrl.cli import main
from mmrl.controller.report import OTHER, ReportError, hint, load_metrics, summarize, write_report

# step -> (spans in seconds, time/step_s); rollout/engine_0 is a sub-span of rollout
STEPS = {
    1: ({"data_wait": 1.0, "rollout": 4.0, "rollout/engine_0": 3.0, "train": 3.0, "weight_sync": 1.0}, 10.0),
    2: ({"data_wait": 1.0, "rollout": 6.0, "rollout/engine_0": 3.0, "train": 2.0, "weight_sync": 1.0}, 10.0),
    3: ({"data_wait": 1.0, "rollout": 5.0, "rollout/engine_0": 3.0, "train": 2.0, "weight_sync": 1.0}, 10.0),
    4: ({"data_wait": 1.0, "rollout": 5.0, "rollout/engine_0": 3.0, "train": 3.0, "weight_sync": 1.0,
         "eval": 4.0}, 20.0),
}
CONFIG = """\
run: {max_steps: 10}
data: {num_workers: 1}
rollout: {num_engines: 1, prompts_per_step: 4, group_size: 2, max_new_tokens: 8}
trainer: {world_size: 1, micro_batch_size: 2}
"""


def _row(step: int, spans: dict[str, float], step_s: float, **extra: float) -> dict:
    return {"step": step, "reward/mean": 0.1 * step, "reward/exact/score": 0.1 * step, "reward/errors": 0.0,
            "actor/entropy": 2.0 - 0.1 * step, "mismatch/mean_abs_logprob_diff": 1e-7,
            "mismatch/max_abs_logprob_diff": 1e-6, "rollout/response_length": 8.0,
            **{f"time/{k}_s": v for k, v in spans.items()}, "time/step_s": step_s, "time/wall_s": 10.0 * step,
            **extra}


def _write_run(run_dir: Path, steps: dict = STEPS, config: str | None = CONFIG, tail: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"step": 0, "eval/heldout_accuracy": 0.2, "time/wall_s": 0.0}]
    rows += [_row(k, spans, step_s, **({"eval/heldout_accuracy": 0.5} if "eval" in spans else {}))
             for k, (spans, step_s) in steps.items()]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    if config is not None:
        (run_dir / "config.yaml").write_text(config)
    return run_dir


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=160), out


def test_breakdown_means_shares_percentiles(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run")
    summary = summarize(run, load_metrics(run))
    spans = {s["name"]: s for s in summary["spans"]}
    assert summary["steps"] == {"first": 1, "last": 4, "count": 4, "max_steps": 10}
    assert summary["step_time_s"]["total"] == pytest.approx(50.0)
    assert summary["step_time_s"]["mean"] == pytest.approx(12.5)
    rollout = spans["rollout"]
    assert (rollout["mean_s"], rollout["share"], rollout["steps"]) == (pytest.approx(5.0), pytest.approx(0.4), 4)
    assert rollout["p50_s"] == pytest.approx(5.0)
    assert rollout["p95_s"] == pytest.approx(5.85)  # linear between 5 and 6 at rank 2.85
    assert spans["train"]["share"] == pytest.approx(0.2) and spans["train"]["mean_s"] == pytest.approx(2.5)
    assert spans["data_wait"]["share"] == pytest.approx(0.08)
    # eval ran once: its mean is per step (4 s / 4 steps), its percentiles over the step it ran
    assert (spans["eval"]["mean_s"], spans["eval"]["p50_s"], spans["eval"]["steps"]) == (
        pytest.approx(1.0), pytest.approx(4.0), 1)
    # the per-engine sub-span is shown but not added: other = step - top-level spans = 1, 0, 1, 6
    assert spans["rollout/engine_0"]["nested"] and spans["rollout/engine_0"]["share"] == pytest.approx(0.24)
    other = summary["other"]
    assert other["mean_s"] == pytest.approx(2.0) and other["share"] == pytest.approx(0.16)
    assert other["p50_s"] == pytest.approx(1.0)
    top_level = [s for s in summary["spans"] if not s["nested"]]
    assert sum(s["share"] for s in top_level) + other["share"] == pytest.approx(1.0)
    # sorted by time, each sub-span right under its parent
    assert [s["name"] for s in summary["spans"]] == [
        "rollout", "rollout/engine_0", "train", "data_wait", "weight_sync", "eval"]
    assert summary["throughput"] == {"steps_per_min": pytest.approx(4.8), "samples_per_step": 8,
                                     "samples_per_min": pytest.approx(38.4)}
    top = summary["top"]
    assert top["span"] == "rollout" and top["share"] == pytest.approx(0.4)
    # responses run to rollout.max_new_tokens=8, so the cap is named as a lever
    assert "rollout.num_engines=1" in top["hint"] and "rollout.max_new_tokens=8" in top["hint"]


def test_hints_name_the_lever_that_applies(tmp_path: Path) -> None:
    config = {"rollout": {"prompts_per_step": 4, "group_size": 8, "max_new_tokens": 64, "num_engines": 2},
              "trainer": {"world_size": 2, "micro_batch_size": 4}, "weight_sync": {"bucket_mb": 64}}
    rows = [{"step": 1, "weight_sync/mb": 10.0, "rollout/response_length": 12.0}]
    # 16 sequences per rank in micro-batches of 4: a bigger micro-batch helps
    assert "raise trainer.micro_batch_size (now 4, each rank has 16 sequences)" in hint("train", config, rows, tmp_path)
    config["trainer"]["micro_batch_size"] = 16
    assert "already takes its 16 sequences in one micro-batch" in hint("train", config, rows, tmp_path)
    # 10 MB of weights fit one 64 MB bucket: a bigger bucket changes nothing
    assert "already one bucket" in hint("weight_sync", config, rows, tmp_path)
    config["weight_sync"]["bucket_mb"] = 4
    assert "raise weight_sync.bucket_mb (now 4)" in hint("weight_sync", config, rows, tmp_path)
    # responses stop far below the 64-token cap: the cap is not offered as a lever
    rollout = hint("rollout", config, rows, tmp_path)
    assert "rollout.num_engines=2" in rollout and "max_new_tokens" not in rollout
    assert "ui.perfetto.dev" not in hint(OTHER, config, rows, tmp_path)
    (tmp_path / "trace.json").write_text("{}")
    assert f"open {tmp_path / 'trace.json'} in https://ui.perfetto.dev" in hint(OTHER, config, rows, tmp_path)


def test_report_prints_table_and_writes_files(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run")
    console, out = _console()
    write_report(run, console)
    text = out.getvalue()
    assert "steps 1-4 (4 steps, 12.500 s/step)" in text
    assert "rollout" in text and "40.0%" in text and "other/unaccounted" in text and "16.0%" in text
    assert "4.80 steps/min, 38 samples/min" in text
    assert "where the time goes: rollout takes 40.0% of the step time" in text
    assert "steps: 4 of run.max_steps=10" in text
    assert "plot kl: skipped (actor/kl not in metrics.jsonl)" in text
    report = run / "report"
    for name in ["reward", "heldout_accuracy", "entropy", "mismatch", "step_time"]:
        png = report / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert not (report / "kl.png").exists()
    saved = json.loads((report / "summary.json").read_text())
    assert saved["top"]["span"] == "rollout" and saved["other"]["share"] == pytest.approx(0.16)
    assert saved["plots"]["skipped"] == {"kl": "actor/kl not in metrics.jsonl"}
    md = (report / "summary.md").read_text()
    assert "| rollout | 5.000 | 40.0% | 5.000 | 5.850 | 4/4 | - |" in md and "![step_time](step_time.png)" in md


def test_cores_per_phase_and_the_phases_that_leave_cpus_idle(tmp_path: Path) -> None:
    """cores/<span> (CPU seconds of the run's processes per wall second of the span) is averaged
    per span; phases under 3/4 of cores/available are named."""
    steps = {k: (spans, step_s) for k, (spans, step_s) in STEPS.items() if k < 4}
    run = tmp_path / "run"
    _write_run(run, steps)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r, rollout in zip(rows[1:], (1.0, 1.2, 1.4)):
        r.update({"cores/rollout": rollout, "cores/train": 1.9, "cores/weight_sync": 0.5, "cores/available": 2.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    console, out = _console()
    summary = write_report(run, console)
    cores = {s["name"]: s["cores"] for s in summary["spans"]}
    assert cores["rollout"] == pytest.approx(1.2) and cores["train"] == pytest.approx(1.9)
    assert cores["data_wait"] is None and summary["cores_available"] == 2.0
    text = out.getvalue()
    assert "cores (of 2)" in text and "1.20" in text
    assert "less than 3/4 of the 2 CPUs busy: rollout 1.2, weight_sync 0.5" in text
    assert "start-up" not in text  # none logged
    md = (run / "report" / "summary.md").read_text()
    assert "| cores (of 2) |" in md and "| train | 2.333 | 23.3% | 2.000 | 2.900 | 3/3 | 1.90 |" in md


def test_startup_phases_of_the_latest_process(tmp_path: Path) -> None:
    """startup/<phase>_s, logged with a process's first step, is printed in order; after a
    resume (a second process) the report shows the latest one."""
    run = _write_run(tmp_path / "run")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows[1].update({"startup/imports_s": 9.0, "startup/ray_s": 3.0, "startup/first_step_s": 2.0, "startup/total_s": 14.0})
    rows[3].update({"startup/imports_s": 8.0, "startup/engines_and_ranks_s": 20.0, "startup/total_s": 28.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    console, out = _console()
    summary = write_report(run, console)
    assert summary["startup"] == {"imports": 8.0, "engines_and_ranks": 20.0, "total": 28.0}
    line = "start-up: 28.0 s from the process start to the end of the first step (imports 8.0, engines_and_ranks 20.0)"
    assert line in out.getvalue() and line in (run / "report" / "summary.md").read_text()


def test_live_run_partial_last_line_is_ignored(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", tail='{"step": 5, "reward/mean": 0.5, "time/st')
    log = load_metrics(run)
    assert [r["step"] for r in log.rows] == [0, 1, 2, 3, 4] and log.notes == []


def test_appended_second_run_reports_the_last_one(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run")
    first = (run / "metrics.jsonl").read_text()
    _write_run(run, steps={1: ({"rollout": 1.0, "data_wait": 3.0}, 5.0)})
    (run / "metrics.jsonl").write_text(first + (run / "metrics.jsonl").read_text())
    summary = summarize(run, load_metrics(run))
    assert summary["steps"]["count"] == 1 and summary["step_time_s"]["total"] == pytest.approx(5.0)
    assert any("more than one run" in n for n in summary["notes"])
    top = summary["top"]
    assert top["span"] == "data_wait" and top["share"] == pytest.approx(0.6)
    assert "mmrl profile-data" in top["hint"] and "data.num_workers (now 1)" in top["hint"]


def test_without_config_no_sample_throughput(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", config=None)
    summary = summarize(run, load_metrics(run))
    assert summary["throughput"] == {"steps_per_min": pytest.approx(4.8)}
    assert summary["steps"]["max_steps"] is None


def test_overlapping_spans_are_flagged(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", steps={1: ({"rollout": 3.0, "train": 3.0}, 5.0)})
    console, out = _console()
    summary = write_report(run, console)
    assert summary["other"]["mean_s"] == pytest.approx(-1.0)
    assert "some of them overlap" in out.getvalue()


def test_missing_metrics_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ReportError, match="there is no metrics.jsonl in"):
        load_metrics(empty)
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    err = " ".join(capsys.readouterr().err.split())  # one paragraph, wrapped at spaces only
    assert err.startswith("mmrl: error: cannot report on ") and "does not exist" in err
    assert str(tmp_path / "nowhere") in err and "mmrl train CONFIG" in err and "run.output_dir" in err
    assert not (tmp_path / "nowhere").exists()  # no report folder made for a wrong path


def test_only_initial_eval_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _write_run(tmp_path / "run", steps={})
    assert main(["report", str(run)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "no finished training step yet" in err and f"mmrl report {run}" in err


def test_startup_cpu_by_kind_of_process(tmp_path: Path) -> None:
    """startup_cpu/<kind>_s (logged with the first step): the CPU seconds each kind of process
    spent to get there, largest first, and the wall time they need at least on the run's cores."""
    run = _write_run(tmp_path / "run")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows[1].update({"startup/imports_s": 9.0, "startup/total_s": 9.0, "cores/available": 2.0, "startup_cpu/driver_s": 10.0,
                    "startup_cpu/TrainerWorker_s": 30.0, "startup_cpu/EngineCore_s": 20.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    console, out = _console()
    summary = write_report(run, console)
    assert list(summary["startup_cpu"]) == ["TrainerWorker", "EngineCore", "driver"]
    line = ("start-up CPU: 60.0 s over the run's processes (>= 30.0 s of wall time on 2 cores): "
            "TrainerWorker 30.0, EngineCore 20.0, driver 10.0")
    assert line in out.getvalue() and line in (run / "report" / "summary.md").read_text()


def test_startup_ready_times_show_the_critical_path(tmp_path: Path) -> None:
    """startup_ready/<kind>_s: when the engines and the trainer ranks (started side by side) were
    each up, seconds from the process start, earliest first, on the report's start-up line."""
    run = _write_run(tmp_path / "run")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows[1].update({"startup/imports_s": 5.0, "startup/engines_and_ranks_s": 40.0, "startup/total_s": 45.0,
                    "startup_ready/engines_s": 44.5, "startup_ready/trainer_ranks_s": 30.25})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    console, out = _console()
    summary = write_report(run, console)
    assert summary["startup_ready"] == {"trainer_ranks": 30.25, "engines": 44.5}
    line = ("start-up: 45.0 s from the process start to the end of the first step (imports 5.0, engines_and_ranks 40.0); "
            "ready at trainer ranks 30.2 s, engines 44.5 s")
    assert line in out.getvalue() and line in (run / "report" / "summary.md").read_text()
