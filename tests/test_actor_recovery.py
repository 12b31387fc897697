"""Dead rollout actors are replaced and their work redone, with nothing lost or duplicated:
a rollout engine killed with requests in flight (they are resubmitted to its replacement, which
has the current weights), a rollout worker killed mid-rollout (its groups, finished or not, are
rolled out again in the same slots with the same seeds), and the bound on replacements.

The first tests drive real RolloutWorkers (real Ray actors, the real processor and agent loop)
over stand-in engine actors that answer from the request's seed: they show the routing and the
bookkeeping in seconds. The last ones (slow) kill a real vLLM engine and a real rollout worker
inside the demo's runtime (2 ZeRO-3 ranks) and compare the rollout with one nobody killed.

Nothing waits on a clock to decide an outcome: engines are held (or paused) until every request
has reached them, and the kill happens then.
"""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import ray

from mmrl.controller.rollout import run_rollout
from mmrl.rollout.types import Completion, SamplingConfig
from mmrl.rollout.workers import ActorRestartsExhausted, RolloutWorkers

N = 3  # samples per rollout
SAMPLING = SamplingConfig(n=2, max_new_tokens=4, seed=1234)


@ray.remote(num_cpus=0)
class SeedEngine:
    """Answers each request with tokens derived from its seed (what a seeded vLLM request does:
    the same request draws the same tokens on any engine with the same weights). `hold()` keeps
    requests waiting until `release()`."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.waiting = 0
        self.served = 0

    async def ready(self) -> dict[str, Any]:
        return {}

    async def watch(self) -> None:
        await asyncio.Event().wait()

    def hold(self) -> None:
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()

    def counts(self) -> tuple[int, int]:
        return self.waiting, self.served

    async def generate_many(self, prompt: dict[str, Any], samplings: list[Any]) -> list[Completion]:
        self.waiting += len(samplings)
        await self.gate.wait()
        self.waiting -= len(samplings)
        self.served += len(samplings)
        return [Completion(token_ids=[s.seed % 997, s.seed % 991, len(prompt["prompt_token_ids"])],
                           logprobs=[-0.5, -0.25, -0.125], text="", finish_reason="stop",
                           token_versions=[0, 0, 0]) for s in samplings]


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 300  # a bound against a hang, not a timing condition
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _kill_and_wait(actor: Any) -> None:
    """Kill `actor` and return once Ray reports it dead (so the driver's next look sees it)."""
    ray.kill(actor, no_restart=True)

    def dead() -> bool:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=30)
            return False
        except ray.exceptions.GetTimeoutError:  # no answer yet: ask again
            return False
        except ray.exceptions.RayActorError:
            return True

    _until(dead, "the killed actor still answers")


def _responses(rollout: Any) -> list[list[tuple[list[int], list[float]]]]:
    return [[(t.response_ids, t.behaviour_logprobs) for t in g] for g in rollout.groups]


@pytest.fixture(scope="module")
def ray_session():
    from mmrl.utils.env import init_local_ray

    init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _workers(model_dir: Path, engines: list[Any], **kwargs: Any) -> RolloutWorkers:
    workers = RolloutWorkers(1, engines, {"name": "auto", "model_path": str(model_dir)}, "single_turn", **kwargs)
    workers.ready()
    return workers


def test_a_dead_engine_is_replaced_and_its_requests_are_resubmitted(ray_session, tiny_model_dir: Path,
                                                                     colors_samples: list) -> None:
    samples = colors_samples[:N]
    doomed = SeedEngine.remote()
    replacements: list[tuple[int, Any]] = []

    def on_engine_lost(index: int, error: BaseException) -> Any:
        replacements.append((index, error))
        return SeedEngine.remote()

    engines = [doomed]
    workers = _workers(tiny_model_dir, engines, on_engine_lost=on_engine_lost, max_restarts=0)
    reference = run_rollout(workers, samples, SAMPLING)  # nobody killed

    ray.get(doomed.hold.remote())
    # every request has reached the held engine, none answered: then it dies
    killer = threading.Thread(target=lambda: (_until(lambda: ray.get(doomed.counts.remote())[0] == N * SAMPLING.n,
                                                     "the requests never reached the engine"), ray.kill(doomed)))
    killer.start()
    rollout = run_rollout(workers, samples, SAMPLING)
    killer.join()

    assert [i for i, _ in replacements] == [0] and isinstance(replacements[0][1], ray.exceptions.RayActorError)
    assert engines[0] is not doomed, "the run's engine list holds the replacement"
    assert _responses(rollout) == _responses(reference), "the same responses, none lost or duplicated"
    assert ray.get(engines[0].counts.remote()) == (0, N * SAMPLING.n), "each request resubmitted once"
    stats = ray.get(workers.actors[0].router_stats.remote())[0]
    assert stats["lost"] == N * SAMPLING.n
    workers.close()


def test_a_dead_worker_has_its_groups_rolled_out_again_finished_ones_included(ray_session, tiny_model_dir: Path,
                                                                               colors_samples: list) -> None:
    samples = colors_samples[:N]
    engine = SeedEngine.remote()
    workers = _workers(tiny_model_dir, [engine], max_restarts=1)
    reference = run_rollout(workers, samples, SAMPLING)

    first = workers.actors[0]
    redone: list[int] = []
    finished_before_the_kill: list[int] = []

    def on_group(slot: int, sample: Any, group: Any) -> None:
        if workers.actors[0] is first:  # the first group back: its worker dies now
            finished_before_the_kill.append(slot)
            _kill_and_wait(first)

    rollout = run_rollout(workers, samples, SAMPLING, on_group=on_group, on_redo=redone.append)
    assert workers.restarts == 1 and workers.actors[0] is not first
    # the group that came back before the death held prompts in the dead worker's store: redone
    assert redone == finished_before_the_kill
    assert _responses(rollout) == _responses(reference)
    assert [s.key for s in rollout.samples] == [s.key for s in samples]
    # the prompts of the redone rollout are readable (they live in the replacement's store)
    assert all(ray.get(p.ref).num_tokens == p.num_tokens for p in rollout.prompts)

    # one more death than rollout.max_actor_restarts allows stops the run, saying so
    with pytest.raises(ActorRestartsExhausted, match="rollout.max_actor_restarts=1"):
        run_rollout(workers, samples, SAMPLING,
                    on_group=lambda *_: _kill_and_wait(workers.actors[0]))
    workers.close()


# ---- the real thing: vLLM engines, the 2 ZeRO-3 ranks, the demo's run step ---------------------

@pytest.fixture(scope="module")
def runtime(ray_session_closed, tiny_model_dir: Path, colors_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from _engine import demo_runtime

    with demo_runtime(tiny_model_dir, colors_dir, tmp_path_factory.mktemp("recovery_run"),
                      "rollout.max_new_tokens=8", "trainer.lr=0.02") as rt:
        yield rt


@pytest.fixture(scope="module")
def ray_session_closed():
    """The stand-in tests' Ray instance is gone before the runtime starts its own."""
    if ray.is_initialized():
        ray.shutdown()


def _step(rt: Any, samples: list, step: int) -> tuple[dict[str, float], list]:
    from mmrl import registry
    from mmrl.controller.loop import run_step
    from mmrl.utils.timing import StepSpans

    return run_step(rt, samples, registry.resolve("advantage", rt.cfg.algorithm.advantage), StepSpans(), step=step)


@pytest.mark.slow
def test_a_vllm_engine_killed_mid_rollout_is_replaced_with_the_current_weights(runtime: Any,
                                                                                 colors_samples: list) -> None:
    rt = runtime
    _step(rt, colors_samples[:4], step=1)  # the weights move away from the model folder's
    sampling = SamplingConfig(n=4, max_new_tokens=8, seed=77, forbidden_token_ids=rt.sampling.forbidden_token_ids)
    samples = colors_samples[4:8]
    reference = run_rollout(rt.workers, samples, sampling)
    checksum = ray.get(rt.engines[0].weights_checksum.remote())

    doomed = rt.engines[0]
    ray.get(doomed.pause.remote())  # requests reach it and wait: it dies with all of them in flight
    killer = threading.Thread(target=lambda: (
        _until(lambda: ray.get(doomed.stats.remote())["in_flight"] == len(samples) * sampling.n,
               "the requests never reached the engine"), ray.kill(doomed)))
    killer.start()
    rollout = run_rollout(rt.workers, samples, sampling)
    killer.join()

    assert rt.engines[0] is not doomed and rt.engine_restarts.count == 1
    assert ray.get(rt.engines[0].weights_checksum.remote()) == pytest.approx(checksum, rel=1e-9)
    assert ray.get(rt.engines[0].get_weight_version.remote()) == rt.weight_version
    got, want = _responses(rollout), _responses(reference)
    assert [[ids for ids, _ in g] for g in got] == [[ids for ids, _ in g] for g in want]
    for g_got, g_want in zip(got, want):
        for (_, lp_got), (_, lp_want) in zip(g_got, g_want):
            assert max(abs(a - b) for a, b in zip(lp_got, lp_want)) <= 1e-5
    assert all(v == rt.weight_version for g in rollout.groups for t in g for v in t.token_versions)

    # the next step trains, and its weight push reaches the replacement
    metrics, used = _step(rt, colors_samples[8:12], step=2)
    assert metrics["rollout/engine_restarts"] == 1.0 and len(used) == 4
    assert ray.get(rt.engines[0].get_weight_version.remote()) == rt.weight_version == 2


@pytest.mark.slow
def test_an_engine_dead_before_a_weight_push_is_replaced_and_the_push_completes(runtime: Any) -> None:
    rt = runtime
    doomed, restarts = rt.engines[0], rt.engine_restarts.count
    _kill_and_wait(doomed)
    rt.push_weights()
    assert rt.engines[0] is not doomed and rt.engine_restarts.count == restarts + 1
    assert ray.get(rt.engines[0].get_weight_version.remote()) == rt.weight_version


@pytest.mark.slow
def test_a_rollout_worker_killed_mid_step_costs_only_time(runtime: Any, colors_samples: list) -> None:
    rt = runtime
    workers, take = rt.workers, rt.workers.take
    first = workers.actors[0]

    def take_then_kill(ref: Any) -> Any:
        out = take(ref)
        if workers.actors[0] is first:  # after the first group: its worker dies
            _kill_and_wait(first)
        return out

    workers.take = take_then_kill
    try:
        samples = colors_samples[12:16]
        version = rt.weight_version
        metrics, used = _step(rt, samples, step=3)
    finally:
        del workers.take
    assert metrics["rollout/worker_restarts"] == 1.0 and workers.actors[0] is not first
    # every sample trained once, in its slot: the update read the redone groups' prompts
    assert [s.key for s in used] == [s.key for s in samples]
    assert "train/skipped_steps" not in metrics and rt.weight_version == version + 1
