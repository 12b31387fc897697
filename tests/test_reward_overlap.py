"""Reward scoring overlaps the rollout: a real vLLM engine (tiny VLM, Ray actor) generates the
step's groups through a rollout worker, each group goes to the reward workers as soon as it comes
back, and the reward workers score it while the rollout still runs. No clock decides the
outcome: the rollout's last group is held until the first group's scoring has begun, which only
happens if finished groups go to the workers at once (otherwise the wait runs into its bound and
the test fails)."""
from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

from _engine import tiny_engine

pytestmark = pytest.mark.slow

STAMP_REWARD = textwrap.dedent("""
    import os
    import time

    def stamp(response, sample, marker_dir, **_):
        t = time.time()
        open(os.path.join(marker_dir, sample.key), "w").close()  # scoring of this sample has begun
        time.sleep(0.02)  # a reward with some cost, so its work has a measurable span
        return {"score": 1.0, "t": t}
""")


def test_rewards_start_before_the_rollout_ends(tiny_model_dir: Path, colors_samples: list, tmp_path: Path) -> None:
    from mmrl.controller.rollout import run_rollout
    from mmrl.rewards.workers import RewardPool, RewardStream
    from mmrl.rollout.types import SamplingConfig

    plugin = tmp_path / "stamp_reward.py"
    plugin.write_text(STAMP_REWARD)
    with tiny_engine(tiny_model_dir, tmp_path / "run") as eng:
        samples = colors_samples[:16]
        sampling = SamplingConfig(n=4, max_new_tokens=16, temperature=1.0, forbidden_token_ids=eng["forbidden"])
        markers = tmp_path / "started"
        markers.mkdir()
        with RewardPool([{"name": f"{plugin}:stamp", "args": {"marker_dir": str(markers)}}, {"name": "shape_colour"}],
                        num_workers=1, timeout_s=30) as pool:
            # warm the engine (the first request on a cold engine is slow), untimed
            run_rollout(eng["workers"], samples[:2], sampling)

            stream = RewardStream(pool, samples, decode=eng["processor"].decode)
            arrivals: list[tuple[float, int]] = []

            def on_group(slot: int, sample, group: list) -> None:
                if len(arrivals) == len(samples) - 1:  # the last group: hold it until the first is being scored
                    first = samples[arrivals[0][1]].key
                    deadline = time.monotonic() + 300
                    while not (markers / first).exists():
                        assert time.monotonic() < deadline, "the first group was not scored during the rollout"
                        time.sleep(0.02)
                arrivals.append((time.time(), slot))
                stream.submit([slot], [group])

            groups = run_rollout(eng["workers"], samples, sampling, on_group=on_group).groups
            rollout_end = time.time()
            report = stream.finish(groups)

    # every group submitted once, as it came back, and returned in slot order
    assert sorted(slot for _, slot in arrivals) == list(range(16))
    assert [t.prompt_index for g in groups for t in g] == [i for i in range(16) for _ in range(4)]

    # scoring of the first group began before the last group came back from the engine
    starts = {g[0].prompt_index: min(x.reward_components["stamp/t"] for x in g) for g in groups}
    assert starts[arrivals[0][1]] < arrivals[-1][0], (starts, arrivals)
    assert min(starts.values()) < rollout_end

    metrics = report.metrics()
    assert metrics["reward/overlap_with_rollout_s"] > 0.0
    assert metrics["reward/groups_started_during_rollout"] > 0.0
    assert metrics["reward/groups_reported_early"] == 1.0
    assert (report.errors, report.timeouts) == (0, 0)
    assert all(t.reward_components["stamp/score"] == 1.0 for g in groups for t in g)
    assert all("shape_colour/score" in t.reward_components for g in groups for t in g)
