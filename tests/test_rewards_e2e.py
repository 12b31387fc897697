"""Rewards through the real CLI (`mmrl train`), on the default demo config, shortened.

One run covers what a user's reward file needs to work in training:
  * the rewards live in a .py file outside the package (tmp_path), named by path in the config;
  * the correctness reward is batched and the format reward async (the new variants);
  * the policy learns from them (rewards and held-out accuracy rise over 40 steps);
  * a reward that raises on some samples and one that hangs past reward_execution.timeout_s do
    not stop training, and their failure/timeout counts reach metrics.jsonl;
  * groups are scored as they finish (each group goes to the reward workers when the rollout
    worker returns it) and the overlap is logged.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

USER_REWARDS = textwrap.dedent('''
    """A user's rewards for the colour task, outside the mmrl package."""
    import asyncio
    import time

    from mmrl.rewards import reward

    COLOURS = ("red", "green", "blue", "yellow", "purple", "orange")


    def _first_word(text):
        words = text.strip().lower().split()
        return words[0].strip(".,!*") if words else ""


    @reward(batched=True)
    def colour_match(response, answer, **_):
        """1 if the first word is the sample's colour; the whole group per call."""
        return [{"score": float(_first_word(r) == a), "group_size": len(response)}
                for r, a in zip(response, answer)]


    async def colour_format(response, **_):
        """Format credit: the first word is some colour (awaited, concurrently per group)."""
        await asyncio.sleep(0)
        return float(_first_word(response) in COLOURS)


    def flaky(sample, **_):
        if sample.metadata["index"] % 8 == 1:
            raise ValueError(f"flaky cannot score {sample.key}")
        return 0.0


    def hang(sample, **_):
        if sample.metadata["index"] % 97 == 5:
            time.sleep(1e6)
        return 0.0
''')


def test_user_reward_file_trains_and_failures_do_not_stop_it(tiny_model_dir: Path, colors_dir: Path,
                                                             tmp_path: Path) -> None:
    plugin = tmp_path / "user_rewards" / "colour_rewards.py"
    plugin.parent.mkdir()
    plugin.write_text(USER_REWARDS)
    config = yaml.safe_load((REPO / "configs" / "colors_demo.yaml").read_text())
    config["rewards"] = [
        {"name": f"{plugin}:colour_match", "weight": 1.0},
        {"name": f"{plugin}:colour_format", "weight": 0.1},
        {"name": f"{plugin}:flaky", "weight": 0.0},
        {"name": f"{plugin}:hang", "weight": 0.0},
    ]
    config_path = tmp_path / "user_rewards.yaml"
    config_path.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "mmrl.cli", "train", str(config_path),
           f"model.path={tiny_model_dir}", f"data.train_shards={colors_dir}/train-{{000000..000001}}.tar",
           f"data.heldout_shards={colors_dir}/heldout-000000.tar", f"run.output_dir={run_dir}",
           "run.seed=0", "run.max_steps=40", "run.time_limit_s=null", "eval.every_steps=20", "eval.num_prompts=32",
           "trainer.lr=2e-3",
           "reward_execution.timeout_s=2", "logging.progress_bar=false"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 40, "every step ran despite the failing and hanging rewards"

    # the user's batched and async rewards ran in the reward workers, with their components
    assert all(r["reward/colour_match/group_size"] == 16 for r in steps)  # one call per group
    first = sum(r["reward/colour_format/score"] for r in steps[:5]) / 5
    last = sum(r["reward/colour_format/score"] for r in steps[-5:]) / 5
    assert last > first + 0.3, (first, last)
    match_first = sum(r["reward/colour_match/score"] for r in steps[:5]) / 5
    match_last = sum(r["reward/colour_match/score"] for r in steps[-5:]) / 5
    assert match_last > match_first + 0.03, (match_first, match_last)
    # greedy held-out answers went from never a right colour to some (the demo test asserts more,
    # over more steps; 40 steps with lr 2e-3 measured 0.0 -> 0.25 here)
    curve = [(r["step"], r["eval/heldout_accuracy"]) for r in rows if "eval/heldout_accuracy" in r]
    assert curve[0][1] <= 0.1 and max(a for _, a in curve) >= curve[0][1] + 0.1, curve

    # failures: counted per reward, every step; training went on
    assert sum(r.get("reward/errors/flaky", 0.0) for r in steps) > 0
    assert all(r["reward/errors"] == r.get("reward/errors/flaky", 0.0) for r in steps)
    assert sum(r.get("reward/timeouts/hang", 0.0) for r in steps) > 0
    assert all(r["reward/dropped_groups"] == 0 for r in steps)  # on_error: zero

    # every group went to the reward workers as it came back from the rollout worker;
    # how much scoring then overlapped depends on the machine's load, so it is logged, not asserted
    # here (tests/test_reward_overlap.py proves the overlap without a clock)
    assert all(r["reward/groups_reported_early"] == 1.0 for r in steps)
    assert all("reward/overlap_with_rollout_s" in r and "reward/groups_started_during_rollout" in r for r in steps)
    assert "reward 'flaky' error on sample" in proc.stderr + proc.stdout
