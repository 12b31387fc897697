"""Batched and async rewards: the calling convention, the in-process scorer (timeouts, isolation),
real Ray reward workers, and the rollout-overlapping RewardStream."""
from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import time

import pytest
import ray
from PIL import Image

from mmrl.data.sample import Sample, messages_from_prompt
from mmrl.rewards import RewardSet, call_reward, reward, reward_kwargs, traits_of
from mmrl.rewards.scorer import GroupScorer
from mmrl.rewards.streaming import overlap_seconds
from mmrl.rollout.types import Trajectory
from mmrl.utils.env import init_local_ray

USER_REWARDS = textwrap.dedent("""
    import asyncio
    import os
    import time

    from mmrl.rewards import reward

    SETUPS = []

    def _load(scale=1.0):
        SETUPS.append(os.getpid())

    @reward(batched=True, setup=_load)
    def batch_len(response, answer, *, scale=1.0):
        # one call per group: every response sees how big its batch was
        return [{"score": scale * float(r == a), "batch": len(response), "setups": len(SETUPS)}
                for r, a in zip(response, answer)]

    @reward(batched=True)
    def batch_picky(response, **_):
        return [float("nan") if r == "nan" else 1.0 for r in response]

    @reward(batched=True)
    def batch_boom(response, **_):
        raise ValueError("batch_boom always fails")

    IN_FLIGHT = [0]

    async def async_len(response, sample, bad_keys=(), **_):
        IN_FLIGHT[0] += 1
        try:
            await asyncio.sleep(0.3)
            # calls awaited together are all still in flight when the first one wakes up
            concurrent = IN_FLIGHT[0]
            if sample.key in bad_keys:
                await asyncio.sleep(1e6)
            return {"score": float(len(response)), "pid": os.getpid(), "concurrent": concurrent}
        finally:
            IN_FLIGHT[0] -= 1

    def started(response, sample, marker_dir=None, **_):
        if marker_dir:  # tells the test, without a clock, that this sample's scoring has begun
            open(os.path.join(marker_dir, sample.key), "w").close()
        return {"score": 1.0, "t": time.time()}
""")


@pytest.fixture(scope="module")
def user_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("variants") / "my_variant_rewards.py"
    path.write_text(USER_REWARDS)
    return str(path)


def make_sample(key: str = "k0", answer: str = "red") -> Sample:
    return Sample(key=key, messages=messages_from_prompt("What colour is the shape?", n_images=1),
                  images=[Image.new("RGB", (32, 32), (200, 30, 30))], answer=answer, metadata={"index": 0})


# ------------------------------------------------------------------------- calling convention

def test_batched_reward_gets_lists_and_scalar_args() -> None:
    seen = {}

    @reward(batched=True)
    def spy(response, images, answer, *, bonus):
        seen.update(response=response, images=images, answer=answer, bonus=bonus)
        return [len(r) + bonus for r in response]

    assert traits_of(spy).batched and not traits_of(spy).is_async
    sample = make_sample()
    assert call_reward(spy, **reward_kwargs(sample, "abc", [1]), bonus=0.5) == {"score": 3.5}
    assert seen["response"] == ["abc"] and seen["answer"] == ["red"] and seen["bonus"] == 0.5
    assert seen["images"] == [sample.images]  # one entry (the sample's image list) per response


def test_async_reward_is_awaited_and_detected() -> None:
    async def later(response, **_):
        await asyncio.sleep(0)
        return {"score": 2.0, "n": len(response)}

    assert traits_of(later).is_async and not traits_of(later).batched
    assert call_reward(later, **reward_kwargs(make_sample(), "four")) == {"score": 2.0, "n": 4.0}

    @reward(batched=True)
    async def batch_async(response, **_):  # async and batched together
        return [1.0] * len(response)

    assert call_reward(batch_async, response="x") == {"score": 1.0}


def test_batched_reward_must_return_one_result_per_response() -> None:
    @reward(batched=True)
    def short(response, **_):
        return [1.0]

    rs = RewardSet([{"name": short}])
    scorer = GroupScorer(rs, timeout_s=None)
    out = scorer.score_group(make_sample(), ["a", "b", "c"])
    assert [f["kind"] for f in out["failures"]] == ["error"] * 3
    assert "returned 1 results" in out["failures"][0]["message"]
    assert [s["score"] for s in out["scores"]] == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="max_concurrency"):
        reward(max_concurrency=0)


def test_weights_components_and_failures_across_variants(user_file) -> None:
    entries = [{"name": f"{user_file}:batch_len", "weight": 2.0, "args": {"scale": 0.5}},
               {"name": f"{user_file}:async_len", "weight": 0.1},
               {"name": f"{user_file}:batch_picky", "weight": 1.0}]
    rs = RewardSet(entries)
    sample = make_sample()
    texts = ["red", "blue", "nan", "red"]
    scorer = GroupScorer(rs, timeout_s=10)
    out = scorer.score_group(sample, texts)
    # the four async calls ran concurrently: all four were in flight at once
    assert max(scores["async_len/concurrent"] for scores in out["scores"]) == len(texts)
    for text, scores in zip(texts, out["scores"]):
        assert scores["batch_len/batch"] == 4.0  # the whole group in one call
        assert scores["batch_len/score"] == 0.5 * (text == "red")
        assert scores["async_len/score"] == len(text)
        expected_picky = 0.0 if text == "nan" else 1.0
        assert scores["batch_picky/score"] == expected_picky
        assert scores["score"] == pytest.approx(2.0 * 0.5 * (text == "red") + 0.1 * len(text) + expected_picky)
        if text != "nan":  # per response, the scorer agrees with RewardSet.score (a batch of one)
            single = rs.score(sample, text)
            group_sized = ("batch_len/batch", "async_len/concurrent")  # differ for a group of one
            assert {k: v for k, v in single.items() if k not in group_sized} == \
                {k: v for k, v in scores.items() if k not in group_sized}
    # the non-finite value failed only its own response
    assert [(f["reward"], f["response"]) for f in out["failures"]] == [("batch_picky", 2)]
    assert "non-finite" in out["failures"][0]["message"]
    assert not out["tainted"]


@pytest.mark.timeout(120)  # the slow calls sleep 1e6 s: only the timeout ends them
def test_async_timeout_cancels_only_the_slow_call(user_file) -> None:
    rs = RewardSet([{"name": f"{user_file}:async_len", "args": {"bad_keys": ["slow"]}}])
    scorer = GroupScorer(rs, timeout_s=2.0)
    out = scorer.score_group(make_sample("slow"), ["a", "bb"])
    assert [f["kind"] for f in out["failures"]] == ["timeout", "timeout"]
    assert not scorer.tainted  # cancelled inside the event loop: no thread was abandoned
    ok = scorer.score_group(make_sample("fine"), ["a", "bb"])
    assert [s["score"] for s in ok["scores"]] == [1.0, 2.0] and not ok["failures"]


@pytest.mark.timeout(120)  # sleepy sleeps 1e6 s: only the timeout ends it
def test_batched_timeout_and_exception(user_file) -> None:
    @reward(batched=True)
    def sleepy(response, **_):
        time.sleep(1e6)

    rs = RewardSet([{"name": sleepy}, {"name": f"{user_file}:batch_boom"}, {"name": "answer_match"}])
    scorer = GroupScorer(rs, timeout_s=1.0)
    out = scorer.score_group(make_sample(), ["red", "blue"])
    kinds = sorted((f["reward"], f["kind"], f["response"]) for f in out["failures"])
    assert kinds == [("batch_boom", "error", 0), ("batch_boom", "error", 1),
                     ("sleepy", "timeout", 0), ("sleepy", "timeout", 1)]
    assert scorer.tainted
    assert [s["answer_match/score"] for s in out["scores"]] == [1.0, 0.0]  # the other reward counted
    boom = next(f for f in out["failures"] if f["reward"] == "batch_boom")
    assert "ValueError: batch_boom always fails" in boom["message"] and "Traceback" in boom["traceback"]


def test_overlap_seconds_is_the_union_inside_the_window() -> None:
    assert overlap_seconds([(0, 2), (1, 3), (5, 6)], 0.5, 5.5) == pytest.approx(2.5 + 0.5)
    assert overlap_seconds([(6, 7)], 0, 5) == 0.0
    assert overlap_seconds([], 0, 5) == 0.0


# ------------------------------------------------------------------------------- Ray workers

@pytest.fixture(scope="module")
def ray_session():
    init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _group(sample_index: int, texts: list[str]) -> list[Trajectory]:
    return [Trajectory(prompt_index=sample_index, response_ids=list(t.encode()), behaviour_logprobs=[],
                       loss_mask=[], text=t, finish_reason="stop", weight_version=0) for t in texts]


def test_variants_in_reward_workers(ray_session, user_file) -> None:
    from mmrl.rewards.workers import RewardPool

    entries = [{"name": f"{user_file}:batch_len", "args": {"scale": 1.0}},
               {"name": f"{user_file}:async_len", "weight": 0.5},
               {"name": f"{user_file}:batch_boom", "weight": 1.0}]
    samples = [make_sample(f"s{i}") for i in range(3)]
    groups = [_group(i, ["red", "no"]) for i in range(3)]
    with RewardPool(entries, num_workers=1, timeout_s=10) as pool:
        report = pool.score(samples, groups)
    for g in groups:
        for t in g:
            c = t.reward_components
            assert c["batch_len/setups"] == 1.0  # the setup hook ran once in the worker, at start
            assert c["batch_len/batch"] == 2.0 and c["async_len/score"] == len(t.text)
            assert c["async_len/pid"] != os.getpid()  # scored in the worker process
            assert t.reward == pytest.approx(float(t.text == "red") + 0.5 * len(t.text))
    # the failing batched reward counts once per response, under its own name
    assert report.errors_by_reward == {"batch_boom": 6} and report.timeouts == 0
    metrics = report.metrics()
    assert metrics["reward/batch_len/score"] == 0.5 and metrics["reward/async_len/score"] == 2.5
    assert metrics["reward/errors/batch_boom"] == 6.0


def test_reward_stream_scores_reported_groups_early(ray_session, user_file, tmp_path) -> None:
    from mmrl.rewards.workers import RewardPool, RewardStream

    samples = [make_sample(f"s{i}") for i in range(4)]
    groups = [_group(i, ["red", "blue"]) for i in range(4)]
    entries = [{"name": f"{user_file}:started", "args": {"marker_dir": str(tmp_path)}}]
    with RewardPool(entries, num_workers=1, timeout_s=10) as pool:
        stream = RewardStream(pool, samples)
        stream.submit([0, 1], groups[:2])  # the first half is final; the "rollout" goes on
        with pytest.raises(RuntimeError, match="twice"):
            stream.submit([1], groups[1:2])
        # the "rollout" lasts until the reported groups are being scored: that can only happen if
        # submit() hands them to the workers at once (no clock involved; a bound, not a measure)
        deadline = time.monotonic() + 120
        while not all((tmp_path / s.key).exists() for s in samples[:2]):
            assert time.monotonic() < deadline, "reported groups were not scored during the rollout"
            time.sleep(0.02)
        rollout_end = time.time()
        report = stream.finish(groups)
    starts = [g[0].reward_components["started/t"] for g in groups]
    assert max(starts[:2]) < rollout_end < min(starts[2:])  # reported groups were scored during it
    m = report.metrics()
    assert m["reward/groups_reported_early"] == 0.5 and m["reward/groups_started_during_rollout"] == 0.5
    assert m["reward/overlap_with_rollout_s"] > 0.0 and m["reward/wait_after_rollout_s"] >= 0.0
    assert all(t.reward == 1.0 for g in groups for t in g)

    with RewardPool([{"name": "answer_match"}], num_workers=1, timeout_s=10) as pool:
        stream = RewardStream(pool, samples[:1])
        stream.submit([0], [_group(0, ["red"])])
        with pytest.raises(RuntimeError, match="changed after it was submitted"):
            stream.finish([_group(0, ["blue"])])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
