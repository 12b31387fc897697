"""vlm_judge: the score parser on judge-like text, and the whole path with the tiny random VLM as
the judge (its output is garbage: the run must still give finite scores in range and count the
parse failures)."""
from __future__ import annotations


import pytest

from mmrl.rewards import traits_of
from mmrl.plugins.rewards.vlm_judge import DEFAULT_RUBRIC, parse_score, vlm_judge


@pytest.mark.parametrize("text, expected", [
    ("Score: 7/10", 7.0),
    ("Score: 7", 7.0),
    ("7", 7.0),
    ("**7**", 7.0),
    ("7.", 7.0),
    ("8.5", 8.5),
    ('{"score": 8}', 8.0),
    ('The verdict: {"reason": "close", "Score": "6"} done', 6.0),
    ("The colour is right. **Score:** 9", 9.0),
    ("Rating: 4 out of 5", 8.0),            # rescaled to max_score
    ("I would give it 3.5/5.", 7.0),
    ("score = 6", 6.0),
    ("Score: 2. On reflection, Score: 8", 8.0),   # the last verdict counts
    ("10/10", 10.0),
    ("Score: 0", 0.0),
])
def test_parse_score_reads_common_verdicts(text: str, expected: float) -> None:
    assert parse_score(text, max_score=10) == pytest.approx(expected)


@pytest.mark.parametrize("text", [
    "", "garbage", "$squareurple$squareurple withyellowyellow", "Score: 15", "Score: -2", "1/0",
    "1. The response names a colour", '{"score": "high"}', '{"score": true}', "no digits at all " * 5000,
    "the 3rd option",
])
def test_parse_score_refuses_what_is_not_a_verdict(text: str) -> None:
    assert parse_score(text, max_score=10) is None


def test_parse_score_other_scales_and_runaway_text() -> None:
    assert parse_score("Score: 4", max_score=5) == 4.0
    assert parse_score("Score: 4/5", max_score=1) == pytest.approx(0.8)
    # a verdict at the end of a very long output is still found, quickly
    assert parse_score("blah " * 100_000 + "Score: 3/10") == 3.0
    assert traits_of(vlm_judge).batched and traits_of(vlm_judge).setup is not None
    assert {"{question}", "{answer}", "{response}", "{max_score}"} <= {
        f for f in ("{question}", "{answer}", "{response}", "{max_score}") if f in DEFAULT_RUBRIC}


@pytest.mark.slow
def test_tiny_vlm_judge_in_a_reward_worker(tiny_model_dir, colors_samples) -> None:
    """The real path: a Ray reward worker loads the judge at start (setup hook), scores a whole
    group in one generate call; garbage verdicts score 0 with parse_failure counted."""
    import ray

    from mmrl.rewards.workers import RewardPool
    from mmrl.rollout.types import Trajectory
    from mmrl.utils.env import init_local_ray

    init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}})
    try:
        samples = colors_samples[:3]
        texts = ["red", "", "blue " * 20000, "@@##!!"]
        groups = [[Trajectory(prompt_index=i, response_ids=[], behaviour_logprobs=[], loss_mask=[], text=t,
                              finish_reason="stop", weight_version=0) for t in texts] for i in range(len(samples))]
        entries = [{"name": "vlm_judge", "args": {"model": str(tiny_model_dir), "max_new_tokens": 12,
                                                  "engine_args": {"max_model_len": 2048}}},
                   {"name": "shape_colour", "weight": 0.5}]
        with RewardPool(entries, num_workers=1, timeout_s=60, start_timeout_s=300) as pool:
            report = pool.score(samples, groups)
        assert (report.errors, report.timeouts) == (0, 0), [f.describe() for f in report.failures]
        for g in groups:
            for t in g:
                c = t.reward_components
                assert {"vlm_judge/score", "vlm_judge/raw", "vlm_judge/parse_failure"} <= set(c)
                assert 0.0 <= c["vlm_judge/score"] <= 1.0 and c["vlm_judge/parse_failure"] in (0.0, 1.0)
                if c["vlm_judge/parse_failure"]:
                    assert c["vlm_judge/score"] == 0.0
                assert t.reward == pytest.approx(c["vlm_judge/score"] + 0.5 * c["shape_colour/score"])
        metrics = report.metrics()
        assert 0.0 <= metrics["reward/vlm_judge/parse_failure"] <= 1.0
        assert "reward/vlm_judge/score" in metrics
    finally:
        ray.shutdown()
