"""Reward scoring overlaps the rollout: a real vLLM engine (tiny VLM, Ray actor) generates the
step in chunks, single_turn reports each finished chunk, and the reward workers score those
groups while the rollout still runs. No clock decides the outcome: the rollout's last chunk is
held until the first chunk's scoring has begun, which only happens if reported groups go to the
workers at once (otherwise the wait runs into its bound and the test fails)."""
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
    from mmrl.rewards.workers import RewardPool, RewardStream
    from mmrl.rollout.agent_loops import RolloutContext, single_turn
    from mmrl.rollout.types import SamplingConfig

    plugin = tmp_path / "stamp_reward.py"
    plugin.write_text(STAMP_REWARD)
    with tiny_engine(tiny_model_dir, tmp_path / "run") as eng:
        samples = colors_samples[:16]
        prompts = [eng["processor"](s) for s in samples]
        sampling = SamplingConfig(n=4, max_new_tokens=16, temperature=1.0, forbidden_token_ids=eng["forbidden"])
        markers = tmp_path / "started"
        markers.mkdir()
        with RewardPool([{"name": f"{plugin}:stamp", "args": {"marker_dir": str(markers)}}, {"name": "shape_colour"}],
                        num_workers=1, timeout_s=30) as pool:
            # warm the engine (the first request on a cold engine is slow), untimed
            single_turn(RolloutContext([eng["engine"]], sampling, 0), prompts[:2])

            stream = RewardStream(pool, samples, decode=eng["processor"].decode)
            arrivals: list[tuple[float, list[int]]] = []

            def on_groups(indices: list[int], groups: list) -> None:
                if len(arrivals) == 3:  # the last chunk: hold it until the first chunk is being scored
                    first = [samples[i].key for i in arrivals[0][1]]
                    deadline = time.monotonic() + 300
                    while not any((markers / key).exists() for key in first):
                        assert time.monotonic() < deadline, "the first chunk was not scored during the rollout"
                        time.sleep(0.02)
                arrivals.append((time.time(), indices))
                stream.submit(indices, groups)

            ctx = RolloutContext([eng["engine"]], sampling, 0, on_groups=on_groups, chunks_per_engine=4)
            groups = single_turn(ctx, prompts)
            rollout_end = time.time()
            report = stream.finish(groups)

    # the agent-loop contract: every group reported once, in chunks, final and in prompt order
    reported = sorted(i for _, idx in arrivals for i in idx)
    assert reported == list(range(16)) and len(arrivals) == 4
    assert [t.prompt_index for g in groups for t in g] == [i for i in range(16) for _ in range(4)]

    # scoring of the first chunk began before the last chunk came back from the engine
    starts = {t.prompt_index: min(x.reward_components["stamp/t"] for x in g) for g in groups for t in g[:1]}
    last_arrival = arrivals[-1][0]
    early = [i for i in arrivals[0][1] if starts[i] < last_arrival]
    assert early, (starts, arrivals)
    assert min(starts.values()) < rollout_end

    metrics = report.metrics()
    assert metrics["reward/overlap_with_rollout_s"] > 0.0
    assert metrics["reward/groups_started_during_rollout"] > 0.0
    assert metrics["reward/groups_reported_early"] == 1.0
    assert (report.errors, report.timeouts) == (0, 0)
    assert all(t.reward_components["stamp/score"] == 1.0 for g in groups for t in g)
    assert all("shape_colour/score" in t.reward_components for g in groups for t in g)
