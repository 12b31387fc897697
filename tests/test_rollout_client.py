"""The router's choices (no engine needed: `pick` only reads the router's own load numbers) and
the per-trajectory sampling settings."""
from __future__ import annotations

from mmrl.rollout.agent_loops import make_trajectory
from mmrl.rollout.client import Router
from mmrl.rollout.types import SEED_STRIDE, Completion, SamplingConfig


def test_new_trajectories_go_to_the_least_loaded_engine_and_stay_there() -> None:
    router = Router(["engine-a", "engine-b", "engine-c"])
    router.load[0].in_flight_tokens = 100
    router.load[1].in_flight_tokens = 10
    router.load[2].in_flight_tokens = 50
    assert router.pick("traj-1") == 1
    router.load[1].in_flight_tokens = 500  # engine 1 is now the busiest ...
    assert router.pick("traj-1") == 1  # ... but a trajectory's later turns stick to its engine
    assert router.pick("traj-2") == 2
    router.release("traj-1")
    assert router.pick("traj-1") == 2  # a finished trajectory's key is free again


def test_ties_break_on_request_count_then_index() -> None:
    router = Router(["a", "b"])
    router.load[0].in_flight_requests = 2
    assert router.pick("x") == 1
    router.load[1].in_flight_requests = 2
    assert router.pick("y") == 0


def test_trajectory_seeds_match_an_n_sample_request() -> None:
    """Member j of slot i draws with seed + i * SEED_STRIDE + j: what vLLM gives the j-th sample of
    an n-sample request seeded seed + i * SEED_STRIDE (the seeds of today's steps stay)."""
    sampling = SamplingConfig(n=4, max_new_tokens=7, seed=1000, forbidden_token_ids=[5])
    r = sampling.for_trajectory(3, 2)
    assert r.seed == 1000 + 3 * SEED_STRIDE + 2 and r.max_tokens == 7 and r.forbidden_token_ids == [5]
    assert SamplingConfig(seed=None).for_trajectory(3, 2).seed is None
    resumed = r.continued(done_tokens=3, attempt=1)
    assert resumed.max_tokens == 4 and resumed.seed != r.seed


def test_make_trajectory_masks_inserted_tokens_and_keeps_the_oldest_version() -> None:
    first = Completion([1, 2], [-0.1, -0.2], "ab", "stop", token_versions=[3, 4])
    second = Completion([7], [-0.3], "c", "length", token_versions=[4])
    t = make_trajectory([first, second], between=[([9, 9], "<tool>")])
    assert t.response_ids == [1, 2, 9, 9, 7] and t.loss_mask == [1, 1, 0, 0, 1]
    assert t.behaviour_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert t.token_versions == [3, 4, -1, -1, 4] and t.weight_version == 3
    assert t.text == "ab<tool>c" and t.finish_reason == "length"
