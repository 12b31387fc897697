"""Stability guard: rules on hand-made metric streams, then a real run (2 ZeRO-3 ranks, vLLM)
where a learning-rate spike is injected; the guard must detect the collapse, roll back to the
last checkpoint before it, lower the learning rate and train on."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mmrl.config.schema import StabilityConfig
from mmrl.controller.guard import StabilityGuard

REPO = Path(__file__).resolve().parents[1]


def test_reward_drop_needs_patience_and_reports_the_streak_start() -> None:
    guard = StabilityGuard(StabilityConfig(enabled=True, warmup_steps=2, window=2, patience=2, reward_drop=0.3))
    rewards = [0.1, 0.5, 0.9, 0.9, 0.9, 0.2, 0.1, 0.1]
    verdicts = [guard.observe(step, {"reward/mean": r}) for step, r in enumerate(rewards, start=1)]
    # window means: .., .9 (best) at step 5; (.9+.2)/2=.55 at 6 -> alarm; .15 at 7 -> 2nd alarm = collapse
    assert [bool(v.reasons) for v in verdicts] == [False] * 5 + [True, True, True]
    assert [v.collapse for v in verdicts] == [False] * 6 + [True, True]
    assert verdicts[6].first_alarm_step == 6 and "below its best 0.900" in verdicts[6].reasons[0]


def test_threshold_rules_warmup_and_nan() -> None:
    cfg = StabilityConfig(enabled=True, warmup_steps=1, patience=1, reward_drop=None, min_entropy=0.5,
                          max_grad_norm=100.0, max_mismatch=1e-2)
    guard = StabilityGuard(cfg)
    assert not guard.observe(1, {"actor/entropy": 0.1}).collapse  # warm-up: no verdict yet
    assert not guard.observe(2, {"actor/entropy": 2.0, "actor/grad_norm_max": 5.0}).collapse
    v = guard.observe(3, {"actor/entropy": 0.2, "actor/grad_norm_max": float("nan"),
                          "mismatch/mean_abs_logprob_diff": 1e-7})
    assert v.collapse and len(v.reasons) == 2 and v.first_alarm_step == 3
    assert any("actor/entropy" in r for r in v.reasons) and any("grad_norm" in r for r in v.reasons)
    guard.after_rollback()
    assert guard.rollbacks == 1 and not guard.observe(4, {"actor/entropy": 1.0}).collapse
    restored = StabilityGuard(cfg)
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == guard.state_dict()
    assert not StabilityGuard(StabilityConfig(enabled=False)).observe(50, {"actor/entropy": 0.0}).collapse


def test_heldout_drop_rolls_back_to_the_last_healthy_evaluation() -> None:
    """Eval every 5 steps; the alarm of a bad evaluation stands until the next one, and the
    rollback target is at or before the last healthy evaluation, not just the alarm's start."""
    guard = StabilityGuard(StabilityConfig(enabled=True, warmup_steps=4, patience=3, reward_drop=None,
                                           heldout_drop=0.15))
    evals = {5: 0.5, 10: 0.97, 15: 0.90, 20: 0.75}  # 0.90 is within 0.15 of the best; 0.75 is not
    verdicts = {step: guard.observe(step, {"eval/heldout_accuracy": evals[step]} if step in evals else {})
                for step in range(1, 23)}
    assert not any(v.reasons for s, v in verdicts.items() if s < 20)
    assert [verdicts[s].collapse for s in (20, 21, 22)] == [False, False, True]
    assert "0.750 is more than 0.15 below its best 0.970" in verdicts[22].reasons[0]
    assert verdicts[22].first_alarm_step == 16  # last healthy evaluation: step 15
    restored = StabilityGuard(guard.cfg)
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == guard.state_dict()
    guard.after_rollback()  # the restored weights were healthy: the alarm is gone until the next evaluation
    assert not guard.observe(23, {}).reasons
    assert guard.observe(25, {"eval/heldout_accuracy": 0.80}).reasons  # the best (0.97) is remembered
    assert not guard.observe(30, {"eval/heldout_accuracy": 0.96}).reasons


def test_heldout_rule_is_off_by_default_and_in_warmup() -> None:
    guard = StabilityGuard(StabilityConfig(enabled=True, warmup_steps=10, patience=1, reward_drop=None))
    assert not guard.observe(5, {"eval/heldout_accuracy": 1.0}).reasons
    assert not guard.observe(20, {"eval/heldout_accuracy": 0.0}).reasons  # heldout_drop null: off
    warm = StabilityGuard(StabilityConfig(enabled=True, warmup_steps=10, patience=1, reward_drop=None,
                                          heldout_drop=0.1))
    warm.observe(5, {"eval/heldout_accuracy": 1.0})
    assert not warm.observe(10, {"eval/heldout_accuracy": 0.2}).reasons  # still warming up
    assert warm.observe(15, {"eval/heldout_accuracy": 0.2}).collapse


_SCRIPT = textwrap.dedent("""
    import json, sys
    import ray

    def main():
        from mmrl.config import load_config
        from mmrl.controller.train import TrainHooks, train

        cfg = load_config(sys.argv[1], sys.argv[2:])
        lrs = {}

        def spike(rt, step):
            if step == 9:  # a learning rate 3,000x too high for one update
                ray.get([t.set_lr.remote(cfg.trainer.lr * 3000) for t in rt.trainers])

        def record(rt, step, metrics):
            lrs[step] = ray.get(rt.trainers[0].get_lr.remote())

        summary = train(cfg, TrainHooks(before_step=spike, after_step=record))
        print("RESULT " + json.dumps({"rollbacks": summary["rollbacks"], "lrs": lrs}))

    if __name__ == "__main__":
        main()
""")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_injected_lr_spike_is_detected_and_rolled_back(mode: str, tiny_model_dir: Path, colors_dir: Path,
                                                       tmp_path: Path) -> None:
    """In async mode too: the rollback abandons the rollout window (groups in flight, sampled by
    the collapsed weights) and restarts it from the checkpoint's data state."""
    run_dir = tmp_path / "run"
    overrides = [f"model.path={tiny_model_dir}", f"data.train_shards={colors_dir}/train-{{000000..000001}}.tar",
                 f"data.heldout_shards={colors_dir}/heldout-000000.tar", f"run.output_dir={run_dir}",
                 "run.max_steps=14", "run.time_limit_s=null", "rollout.prompts_per_step=8", "rollout.group_size=8", "eval.every_steps=0",
                 "checkpoint.every_steps=4", "logging.progress_bar=false", "stability.enabled=true",
                 "stability.warmup_steps=3", "stability.patience=1", "stability.reward_drop=null",
                 "stability.min_entropy=1.0", "stability.lr_scale=0.5",
                 "trainer.lr=1e-3",  # the spike (3,000x) and the lr checks below are sized for it
                 f"rollout.mode={mode}", "rollout.max_staleness=1"]
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(REPO / "configs" / "colors_demo.yaml"), *overrides],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    rows = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}

    # healthy before the spike; the spiked update at step 9 collapses the policy seen at step 10
    # (async: at step 10 or 11, the batch of step 10 may have been sampled before the spike)
    assert all(rows[s]["actor/entropy"] > 1.0 for s in range(1, 10))
    alarm = next(s for s in range(10, 15) if rows[s]["guard/alarm"] == 1.0)
    assert alarm == 10 if mode == "sync" else alarm in (10, 11)
    assert rows[alarm]["actor/entropy"] < 1.0
    (event,) = result["rollbacks"]
    assert event["at_step"] == alarm and event["to_step"] == 8 and event["lr_scale"] == 0.5
    assert any("actor/entropy" in r for r in event["reasons"])
    assert json.loads((run_dir / "guard.jsonl").read_text()) == event
    # the restored policy is healthy again, trained on at half the configured learning rate
    assert all(rows[s]["actor/entropy"] > 1.0 for s in range(alarm + 1, 15))
    assert all(rows[s]["guard/rollbacks"] == 1.0 and rows[s]["train/lr_scale"] == 0.5 for s in range(alarm + 1, 15))
    if mode == "async":  # a fresh window after the rollback: its first batch is sampled by the restored weights
        assert rows[alarm + 1]["async/staleness_mean"] == 0.0
    assert result["lrs"]["12"] == pytest.approx(0.5 * 1e-3)
