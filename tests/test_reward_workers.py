"""Reward workers (real Ray actors) on real `colors` shards, and `mmrl rewards check`."""
from __future__ import annotations

import json
import logging
import os
import textwrap

import numpy as np
import pytest
import ray

from mmrl.cli import main
from mmrl.rewards import RewardSet
from mmrl.rollout.types import Trajectory
from mmrl.utils.env import init_local_ray

# A user's reward file: in tmp_path, not importable as a module from any worker's cwd or sys.path.
USER_REWARDS = textwrap.dedent("""
    import os
    import re
    import time

    import numpy as np

    def mean_pixel(images, **_):
        return float(np.asarray(images[0], dtype=np.float64).mean())

    def flaky(response, sample, **_):
        if sample.metadata["index"] % 4 == 1:
            raise ValueError(f"flaky cannot score {sample.key}")
        return {"score": 1.0 if response else 0.5, "length": len(response)}

    def hang(response, sample, bad_keys=(), calls_dir=None, **_):
        if calls_dir:  # one file line per call, so the test counts calls instead of timing them
            with open(os.path.join(calls_dir, sample.key), "a") as f:
                f.write("call\\n")
        if sample.key in bad_keys:
            time.sleep(1e6)
        return 1.0

    def crash(sample, bad_keys=(), **_):
        if sample.key in bad_keys:
            os._exit(3)
        return 1.0

    def held_once(response, sample, calls_dir, hold_key, **_):
        # one line per call; the first call for hold_key waits (for the test's kill) until released
        path = os.path.join(calls_dir, sample.key)
        with open(path, "a") as f:
            f.write("call\\n")
        if sample.key == hold_key and open(path).read().count("call") == 1:
            while not os.path.exists(os.path.join(calls_dir, "release")):
                time.sleep(0.05)
        return {"score": 1.0 if response == sample.answer else 0.0}

    def gil_hog(sample, bad_keys=(), **_):
        if sample.key in bad_keys:  # catastrophic backtracking: holds the GIL for ages
            re.match(r"(a+)+$", "a" * 64 + "b")
        return 1.0
""")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from mmrl.plugins.data.recipes.colors import build
    from mmrl.data.stream import load_all

    root = tmp_path_factory.mktemp("reward_workers")
    shards = root / "colors"
    build(shards, train_size=16, heldout_size=8, shard_size=8)
    plugin = root / "user_plugins" / "my_rewards_for_workers.py"
    plugin.parent.mkdir()
    plugin.write_text(USER_REWARDS)
    init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield {"shards": shards, "plugin": str(plugin),
           "samples": load_all(str(shards / "train-{000000..000001}.tar"))}
    ray.shutdown()


def _decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8")


def _groups(samples, responses_of) -> list[list[Trajectory]]:
    groups = []
    for i, s in enumerate(samples):
        groups.append([Trajectory(prompt_index=i, response_ids=list(r.encode()), behaviour_logprobs=[],
                                  loss_mask=[], text="(not used: decode)", finish_reason="stop",
                                  weight_version=0) for r in responses_of(s)])
    return groups


def _wrong(colour: str) -> str:
    return "green" if colour != "green" else "red"


def test_scores_match_in_process_and_image_reaches_worker(env):
    from mmrl.rewards.workers import RewardPool

    entries = [{"name": "shape_colour", "weight": 1.0},
               {"name": "answer_match", "weight": 0.5, "args": {"first_word": True}},
               {"name": f"{env['plugin']}:mean_pixel", "weight": 0.0}]
    samples = env["samples"]
    groups = _groups(samples, lambda s: [s.answer, _wrong(s.answer), f"{s.answer.upper()}!", ""])
    with RewardPool(entries, num_workers=2, timeout_s=30) as pool:
        report = pool.score(samples, groups, decode=_decode)
    local = RewardSet(entries)
    for s, group in zip(samples, groups):
        for t in group:
            expected = local.score(s, _decode(t.response_ids), t.response_ids)
            assert t.reward_components == expected
            assert t.reward == expected["score"]
        # the image reached the reward inside the worker
        assert group[0].reward_components["mean_pixel/score"] == pytest.approx(
            float(np.asarray(s.images[0], dtype=np.float64).mean()))
        assert [t.reward_components["shape_colour/score"] for t in group] == [1.0, 0.0, 1.0, 0.0]
    assert report.keep == [True] * len(samples)
    assert (report.errors, report.timeouts, report.dropped_groups) == (0, 0, 0)
    assert report.metrics()["reward/shape_colour/score"] == 0.5
    assert report.metrics()["reward/mean"] == pytest.approx(0.75)


def test_failures_are_isolated_counted_and_follow_the_policy(env, caplog):
    from mmrl.rewards.workers import RewardFailure, RewardPool

    samples = env["samples"][:8]
    failing = [s.metadata["index"] % 4 == 1 for s in samples]
    assert 0 < sum(failing) < len(samples)
    entries = [{"name": "shape_colour"}, {"name": f"{env['plugin']}:flaky", "weight": 2.0}]
    with RewardPool(entries, num_workers=1, timeout_s=30, on_error="zero") as pool:
        groups = _groups(samples, lambda s: [s.answer, ""])
        with caplog.at_level(logging.WARNING, logger="mmrl.rewards.workers"):
            report = pool.score(samples, groups, decode=_decode)
        # zero: the failing reward scores 0 for those samples only; shape_colour still counts
        assert report.errors == 2 * sum(failing) and report.timeouts == 0
        assert report.errors_by_reward == {"flaky": 2 * sum(failing)}
        assert report.keep == [True] * len(samples) and report.dropped_groups == 0
        for s, g, bad in zip(samples, groups, failing):
            assert g[0].reward_components["shape_colour/score"] == 1.0
            if bad:
                assert g[0].reward == 1.0 and g[0].reward_components["flaky/score"] == 0.0
                assert "flaky/length" not in g[0].reward_components
            else:
                assert g[0].reward == 3.0 and g[1].reward == 1.0
                assert g[0].reward_components["flaky/length"] == len(s.answer)
        bad_keys = {s.key for s, b in zip(samples, failing) if b}
        assert {f.key for f in report.failures} == bad_keys
        assert all(f.reward == "flaky" and "ValueError: flaky cannot score" in f.traceback
                   for f in report.failures)
        assert any(r.levelno == logging.WARNING and "flaky" in r.getMessage()
                   and next(iter(bad_keys)) in r.getMessage() for r in caplog.records)

        # drop_group: the whole group gets no gradient
        report = pool.score(samples, _groups(samples, lambda s: [s.answer, ""]), decode=_decode,
                            on_error="drop_group")
        assert report.keep == [not b for b in failing]
        assert report.dropped_groups == sum(failing)

        # stop: raise, naming the reward, the key and the traceback
        with pytest.raises(RewardFailure) as info:
            pool.score(samples, _groups(samples, lambda s: [s.answer]), decode=_decode, on_error="stop")
        msg = str(info.value)
        assert "flaky" in msg and info.value.record.key in bad_keys and info.value.record.key in msg
        assert "Traceback" in msg and "ValueError" in msg


@pytest.mark.timeout(300)  # the hang sleeps 1e6 s: only the timeout ends it
def test_hanging_reward_times_out_and_pool_recovers(env, tmp_path):
    from mmrl.rewards.workers import RewardPool

    samples = env["samples"][:4]
    bad = samples[1].key
    entries = [{"name": f"{env['plugin']}:hang", "args": {"bad_keys": [bad], "calls_dir": str(tmp_path)}},
               {"name": "shape_colour"}]
    with RewardPool(entries, num_workers=1, timeout_s=2.0) as pool:
        groups = _groups(samples, lambda s: [s.answer, s.answer])
        report = pool.score(samples, groups, decode=_decode)
        # one call timed out; the group's second response was not sent into the hang again
        assert (tmp_path / bad).read_text().splitlines() == ["call"]
        assert report.timeouts == 2 and report.timeouts_by_reward == {"hang": 2} and report.errors == 0
        assert {f.key for f in report.failures} == {bad}
        assert "time.sleep" in report.failures[0].traceback or "sleep" in report.failures[0].traceback
        assert groups[1][0].reward_components["shape_colour/score"] == 1.0  # the other reward counted
        assert groups[1][0].reward == 1.0 and groups[0][0].reward == 2.0
        assert pool.replaced == 1  # the worker with the abandoned thread was replaced
        # the pool keeps working: a second batch on the fresh worker
        ok = [s for s in env["samples"][4:8]]
        groups = _groups(ok, lambda s: [s.answer])
        report = pool.score(ok, groups, decode=_decode)
        assert (report.errors, report.timeouts) == (0, 0)
        assert [g[0].reward for g in groups] == [2.0] * len(ok)


@pytest.mark.timeout(300)  # the GIL hog runs for ages: only the deadline kill ends it
def test_dead_or_gil_blocked_worker_loses_only_its_group(env):
    from mmrl.rewards.workers import WORKER, RewardPool

    samples = env["samples"][:3]
    entries = [{"name": f"{env['plugin']}:crash", "args": {"bad_keys": [samples[0].key]}}]
    with RewardPool(entries, num_workers=1, timeout_s=5.0) as pool:
        groups = _groups(samples, lambda s: ["x"])
        report = pool.score(samples, groups, decode=_decode, on_error="drop_group")
        # the crashing group is retried once, then lost; the groups queued behind it are rescored
        assert report.keep == [False, True, True]
        assert report.errors_by_reward == {WORKER: 1} and report.failures[0].kind == "worker_lost"
        assert [g[0].reward for g in groups] == [0.0, 1.0, 1.0]

    # a reward that never releases the GIL: the in-worker timeout cannot fire; the deadline kills it
    # (the regex runs for ages: only the kill ends the call; the test's own timeout is the bound)
    entries = [{"name": f"{env['plugin']}:gil_hog", "args": {"bad_keys": [samples[0].key]}}]
    with RewardPool(entries, num_workers=1, timeout_s=1.0, grace_s=2.0) as pool:
        groups = _groups(samples[:2], lambda s: ["x"])
        report = pool.score(samples[:2], groups, decode=_decode)
        assert report.timeouts_by_reward == {WORKER: 1} and report.failures[0].key == samples[0].key
        assert groups[1][0].reward == 1.0


@pytest.mark.timeout(600)  # a hang guard only: the steps below wait on files and actor states, not clocks
def test_a_worker_killed_from_outside_mid_group_loses_and_repeats_no_sample(env, tmp_path):
    """A reward worker killed while it scores a group (as the OOM killer or a node loss would): the
    pool replaces it, scores the group it was running again on a fresh worker and the groups queued
    behind it elsewhere; every group gets exactly one result, with the right scores, none lost."""
    import time

    from mmrl.rewards.workers import RewardPool

    samples = env["samples"][:6]
    hold = samples[1].key
    entries = [{"name": f"{env['plugin']}:held_once", "args": {"calls_dir": str(tmp_path), "hold_key": hold}}]
    with RewardPool(entries, num_workers=2, timeout_s=None) as pool:
        answers = [s.answer if i % 2 == 0 else _wrong(s.answer) for i, s in enumerate(samples)]
        handles = [pool.submit(s, [a]) for s, a in zip(samples, answers)]
        held = next(h for h in handles if h.key == hold)
        while not (tmp_path / hold).exists():  # the held group is running on its worker
            pool.poll()
            time.sleep(0.05)
        behind = [h.key for h in pool._state_of(held.actor).queue if h is not held]
        ray.kill(held.actor, no_restart=True)
        (tmp_path / "release").touch()  # nothing else waits: the retry of `hold` runs through
        results = pool.collect(handles)
        assert pool.replaced == 1
    assert [r.key for r in results] == [s.key for s in samples]  # one result per group, in order
    assert all(r.keep and not r.failures for r in results)
    assert [r.scores[0]["score"] for r in results] == [1.0 if i % 2 == 0 else 0.0 for i in range(6)]
    calls = {s.key: (tmp_path / s.key).read_text().count("call") for s in samples}
    assert calls[hold] == 2  # scored again after the kill, its one result from the second run
    # the rest were scored once, or twice where the kill found them queued behind the held group
    # (a queued group may have started; none is counted twice in the results above)
    assert all(calls[k] == 1 for k in calls if k != hold and k not in behind), (calls, behind)
    assert all(calls[k] in (1, 2) for k in behind), (calls, behind)


def test_reward_file_that_does_not_import_in_workers_fails_clearly(env, tmp_path):
    from mmrl.registry import PluginError
    from mmrl.rewards.workers import RewardPool

    bad = tmp_path / "imports_only_here.py"
    bad.write_text("import os\nif os.environ.get('MMRL_TEST_DRIVER') != '1':\n"
                   "    raise ImportError('needs the driver environment')\n"
                   "def r(**_):\n    return 1.0\n")
    os.environ["MMRL_TEST_DRIVER"] = "1"
    try:
        with pytest.raises(PluginError, match="inside the reward workers"):
            RewardPool([{"name": f"{bad}:r"}], num_workers=1)
    finally:
        del os.environ["MMRL_TEST_DRIVER"]


def test_rewards_check_cli(env, tmp_path, capsys):
    shards = str(env["shards"] / "heldout-000000.tar")
    assert main(["rewards", "check", "shape_colour", "--shards", shards, "--limit", "4"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("heldout-")]
    assert len(rows) == 8
    assert [r[3:] for r in rows[0::2]] == [["1", "format=1"]] * 4  # the reference answers score 1
    assert [r[2:] for r in rows[1::2]] == [["0", "format=0"]] * 4  # the empty responses 0
    assert "mean score of 'shape_colour': 0.5000" in out

    # responses by key, with reward args
    responses = tmp_path / "responses.jsonl"
    from mmrl.data.stream import load_all

    answers = {s.key: s.answer for s in load_all(shards)}
    keys = list(answers)[:3]
    responses.write_text("\n".join(json.dumps({"key": k, "response": f"{answers[k]} it is"}) for k in keys))
    assert main(["rewards", "check", "answer_match", "--shards", shards, "--responses", str(responses),
                 "--args", '{"first_word": true}']) == 0
    out = capsys.readouterr().out
    assert "mean score of 'answer_match': 1.0000 over 3" in out

    # a reward that does not resolve: exit 2, one clear message
    assert main(["rewards", "check", "no_such_reward", "--shards", shards]) == 2
    err = capsys.readouterr().err
    assert "unknown reward plugin 'no_such_reward'" in err


def test_workers_run_at_normal_priority(env):
    """Ray starts workers at niceness 15 unless told otherwise; mmrl's engines, trainer ranks and
    reward workers are all Ray workers, and at 15 any ordinary process on the machine starves them.
    Workers run at the driver's own priority (0 normally; the driver's, when the user starts it
    under `nice`)."""
    @ray.remote
    def niceness() -> int:
        return os.nice(0)

    assert ray.get(niceness.remote()) == os.nice(0)


def test_score_passes_multi_turn_episodes_to_the_rewards(env):
    """`score` (what held-out evaluation calls) hands each trajectory's transcript and tool state
    to the rewards, as the streaming path of training does: a GUI episode that succeeded scores
    1 by its tool state, a last turn that names the colour after a call scores by final_answer."""
    from mmrl.rewards.workers import RewardPool

    samples = env["samples"][:2]
    groups = _groups(samples, lambda s: ["click0", "click1"])
    for s, (won, lost) in zip(samples, groups):
        won.transcript = [{"role": "assistant", "content": "click0", "tool_calls": [{"name": "click"}]},
                          {"role": "tool", "content": "ok", "error": False},
                          {"role": "assistant", "content": s.answer, "tool_calls": []}]
        won.tool_state = {"success": True, "progress": 1.0}
        lost.transcript = won.transcript[:2] + [{"role": "assistant", "content": _wrong(s.answer), "tool_calls": []}]
        lost.tool_state = {"success": False, "progress": 0.5}
    entries = [{"name": "tool_success", "weight": 1.0}, {"name": "final_answer", "weight": 1.0}]
    with RewardPool(entries, num_workers=1, timeout_s=30) as pool:
        pool.score(samples, groups, decode=_decode)
    for won, lost in groups:
        assert won.reward_components["tool_success/score"] == 1.0 and won.reward_components["final_answer/correct"] == 1.0
        assert lost.reward_components["tool_success/score"] == 0.0 and lost.reward_components["final_answer/correct"] == 0.0
