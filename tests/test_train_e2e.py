"""The whole loop through the real CLI: shards -> vLLM (Ray) -> rewards -> ZeRO-3 (2 ranks) ->
weight sync, on the default demo config, seeded and shortened. It must clearly learn, and `mmrl report`
must explain where its time went."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_run(tiny_model_dir: Path, colors_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The demo config, seeded, until held-out accuracy reaches 0.6: (run folder, its stdout)."""
    root = tmp_path_factory.mktemp("demo")
    run_dir = root / "run"
    cmd = [sys.executable, "-m", "mmrl.cli", "train", str(REPO / "configs" / "colors_demo.yaml"),
           f"model.path={tiny_model_dir}", f"data.train_shards={colors_dir}/train-{{000000..000001}}.tar",
           f"data.heldout_shards={colors_dir}/heldout-000000.tar", f"run.output_dir={run_dir}",
           "run.seed=0", "run.max_steps=160", "run.stop_at_heldout_accuracy=0.6", "run.time_limit_s=null",
           "logging.progress_bar=false"]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=2900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir, proc.stdout


@pytest.mark.timeout(3000)  # a busy machine can triple the run; the bound is for hangs only
def test_demo_config_learns(demo_run: tuple[Path, str]) -> None:
    run_dir, stdout = demo_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], r["eval/heldout_accuracy"]) for r in rows if "eval/heldout_accuracy" in r]
    start, best = curve[0][1], max(a for _, a in curve)
    assert start <= 0.35, f"an untrained random model should be near chance, got {start}"
    assert best >= 0.6, f"held-out accuracy never reached 0.6: {curve}"

    steps = [r for r in rows if r["step"] > 0]
    # every step reports the metrics researchers read, and the step-time split
    for key in ["reward/mean", "loss/pg", "actor/entropy", "actor/clip_fraction", "mismatch/mean_abs_logprob_diff",
                "time/data_wait_s", "time/rollout_s", "time/reward_s", "time/train_s", "time/weight_sync_s"]:
        assert all(key in r for r in steps), key
    # the demo's entropy bonus holds at 0.1 until its schedule starts fading it (step 150)
    assert all(r["actor/entropy_coef"] == 0.1 for r in steps if r["step"] <= 150)
    first10 = sum(r["reward/mean"] for r in steps[:10]) / 10
    last10 = sum(r["reward/mean"] for r in steps[-10:]) / 10
    # the mean reward climbs from ~0 (the run stops as soon as held-out accuracy reaches 0.6)
    assert last10 > first10 + 0.1, (first10, last10)
    # the engine and the trainer agree on what the policy is (fp32): the sync works every step
    assert max(r["mismatch/mean_abs_logprob_diff"] for r in steps) < 1e-4
    assert all("time/rollout/engine_0_s" in r for r in steps)  # the engine's own track
    # the sync's split: the engines' load is part of the step's sync time, the whole model every step
    assert all(0 < r["weight_sync/apply_s"] <= r["time/weight_sync_s"] and r["weight_sync/buckets"] >= 1
               and r["weight_sync/mb"] > 1 for r in steps)
    # rank 0's parts of it, each timed once: together no more than the whole
    parts = ("gather_s", "copy_s", "send_s", "finish_s")
    assert all(sum(r[f"weight_sync/{p}"] for p in parts) <= r["time/weight_sync_s"] for r in steps)
    # the engine's own counters (rollout/engine_<i>/*): it generated, it was busy part of the step
    assert all(r["rollout/engine_0/tokens_per_busy_s"] > 0 and 0 < r["rollout/engine_0/idle_share"] < 1
               and r["rollout/engine_0/requests_in_flight_peak"] >= 1 for r in steps)
    assert all(0 < r["rollout/engine_0/kv_cache_usage_peak"] <= 1 for r in steps)
    assert any((run_dir / "tensorboard").iterdir()) and (run_dir / "config.yaml").is_file()
    # the per-step spans also go to a Chrome/Perfetto trace, one track per span kind
    from mmrl.utils.trace import load_trace

    events = load_trace(run_dir / "trace.json")
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"data_wait", "rollout", "rollout/engine_0", "reward", "train", "weight_sync", "eval"} <= tracks, tracks
    assert sum(e["ph"] == "X" and e["name"] == "train" for e in events) == len(steps)
    assert "held-out accuracy by step" in stdout


@pytest.mark.timeout(3000)
def test_report_on_the_demo_run(demo_run: tuple[Path, str]) -> None:
    """`mmrl report` on a real run: the time split, the charts, the start-up phases and the CPU
    each kind of process spent on them."""
    run_dir, _ = demo_run
    steps = len({json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()} - {0})
    report = subprocess.run([sys.executable, "-m", "mmrl.cli", "report", str(run_dir)], cwd=run_dir.parent,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "160"})
    assert report.returncode == 0, report.stderr[-4000:]
    out = report.stdout
    assert f"steps 1-{steps} ({steps} steps" in out and "where the time goes:" in out
    for span in ["data_wait", "rollout", "reward", "train", "weight_sync", "eval", "other/unaccounted"]:
        assert span in out, span
    assert "256 per step" in out  # prompts_per_step 16 x group_size 16
    for name in ["reward", "heldout_accuracy", "entropy", "mismatch", "step_time"]:
        assert (run_dir / "report" / f"{name}.png").stat().st_size > 1000, name
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert summary["steps"]["count"] == steps
    shares = sum(s["share"] for s in summary["spans"] if not s["nested"]) + summary["other"]["share"]
    assert shares == pytest.approx(1.0)
    # the machine was used: every metered phase burnt CPU, out of the CPUs Ray was given
    cores = {s["name"]: s["cores"] for s in summary["spans"]}
    assert all(cores[name] > 0 for name in ("rollout", "train", "weight_sync", "eval")), cores
    assert cores["data_wait"] is None and summary["cores_available"] == float(os.cpu_count())
    assert f"cores (of {os.cpu_count()})" in out
    # start-up phase by phase, from the process start to the end of step 1
    startup = summary["startup"]
    assert {"imports", "ray", "processor", "engines_and_ranks", "data", "first_eval", "first_step"} <= set(startup)
    assert sum(v for k, v in startup.items() if k != "total") == pytest.approx(startup["total"])
    assert all(v >= 0 for v in startup.values()) and "start-up:" in out
    # and what each kind of process spent on it: every process pays its own imports
    assert {"driver", "TrainerWorker", "RolloutEngine", "RolloutWorker", "ray"} <= set(summary["startup_cpu"])
    assert "start-up CPU:" in out
    # when the engines and the ranks (started side by side) were up, within the start-up
    ready = summary["startup_ready"]
    assert set(ready) == {"engines", "trainer_ranks"} and all(0 < s < startup["total"] for s in ready.values())
