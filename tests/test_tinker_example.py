"""examples/tinker_colors_rl.py in short form: the official SDK's RL loop (sample groups with image
prompts, score, importance_sampling step, new sampling client, greedy held-out evaluation) against
`mmrl serve` with the transformers sampler. The full run to 0.95 is benchmarks/tinker_colors.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker")
from _tinker_server import KEY_A, serve_in_thread  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    yield from serve_in_thread(tiny_model_dir, tmp_path_factory.mktemp("serve-example"), sampler="trainer")


def test_the_example_runs_its_rl_loop_through_the_sdk(server, tiny_model_dir: Path, colors_dir: Path,
                                                       tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "tinker_colors_rl.py"), "--model", str(tiny_model_dir),
         "--data", str(colors_dir), "--steps", "2", "--prompts", "2", "--group", "4", "--eval-every", "2",
         "--eval-prompts", "4"],
        env={**os.environ, "TINKER_BASE_URL": server, "TINKER_API_KEY": KEY_A, "HF_HUB_OFFLINE": "1"},
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]  # one per step
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0.0 <= r["reward_mean"] <= 1.1 for r in rows)
    assert 0.0 <= rows[-1]["heldout_accuracy"] <= 1.0  # 4 greedy answers scored against their labels
    assert "FutureWarning" not in proc.stderr  # the example uses the SDK as its current API asks
