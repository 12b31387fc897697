"""The whole loop through the real CLI: shards -> vLLM (Ray) -> rewards -> ZeRO-3 (2 ranks) ->
weight sync, on the default demo config, seeded and shortened. It must clearly learn."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.mark.timeout(3000)  # a busy machine can triple the run; the bound is for hangs only
def test_demo_config_learns(tiny_model_dir: Path, colors_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "mmrl.cli", "train", str(REPO / "configs" / "colors_demo.yaml"),
           f"model.path={tiny_model_dir}", f"data.train_shards={colors_dir}/train-{{000000..000001}}.tar",
           f"data.heldout_shards={colors_dir}/heldout-000000.tar", f"run.output_dir={run_dir}",
           "run.seed=0", "run.max_steps=160", "run.stop_at_heldout_accuracy=0.6", "run.time_limit_s=null",
           "logging.progress_bar=false"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=2900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]

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
    assert "held-out accuracy by step" in proc.stdout
