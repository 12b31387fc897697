"""The rollout engine as a server (vLLM AsyncLLM in a Ray actor), with the real ZeRO-3 trainer
(2 ranks, gloo) and a real weight sync, fp32, image prompts:

  * a weight update in the middle of a generation: the request is frozen (partial=keep),
    the weights change, it continues. With the KV cache recomputed, every token after the update
    carries the new version and matches the NEW weights (logprob parity <= 1e-4); with the old
    KV kept, the mismatch it causes is measured (and the same numbers feed mismatch/* and the
    TIS/MIS correction in training).
  * partial=abort: the request is aborted and resubmitted with its tokens as a prefix; the
    trajectory comes back whole, its later tokens exactly the new policy's.
  * back-pressure: one router never has more than max_requests_per_engine requests on an engine.

No clock decides an outcome: the engine is paused once it reports that the request has generated
tokens, and the update happens while it is paused.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import ray

from _engine import demo_runtime

from mmrl.controller.learn import logprob_pass, make_sequences, update_policy
from mmrl.controller.loop import Runtime
from mmrl.controller.rollout import run_rollout
from mmrl import registry
from mmrl.rollout.types import SamplingConfig
from mmrl.trainer.batch import TrainSequence
from mmrl.utils.timing import StepSpans

pytestmark = pytest.mark.slow
LONG = 400  # tokens: a request this long is still running when the update comes


@pytest.fixture(scope="module")
def runtime(tiny_model_dir: Path, colors_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with demo_runtime(tiny_model_dir, colors_dir, tmp_path_factory.mktemp("engine_run"),
                      "rollout.max_requests_per_engine=3", "trainer.lr=0.02", "rollout.max_new_tokens=8") as rt:
        yield rt


def _train_without_sync(rt: Runtime, samples: list) -> None:
    """One real update on the trainer ranks; the engines keep the old weights until a sync."""
    sampling = SamplingConfig(n=4, max_new_tokens=4, forbidden_token_ids=rt.sampling.forbidden_token_ids)
    rollout = run_rollout(rt.workers, samples, sampling)
    rt.rewards.score(rollout.samples, rollout.groups, decode=rt.processor.decode)
    update_policy(rt.trainers, rt.cfg, rollout.prompts, rollout.groups,
                  registry.resolve("advantage", rt.cfg.algorithm.advantage), StepSpans(), step=1)


def _wait_for_tokens(engine, minimum: int) -> None:
    deadline = time.monotonic() + 600  # a bound against a hang, not a timing condition
    while not any(n >= minimum for n in ray.get(engine.progress.remote()).values()):
        assert time.monotonic() < deadline, "the engine generated nothing"
        time.sleep(0.01)


def _sync(rt: Runtime) -> None:
    rt.weight_version += 1
    ray.get([t.sync_weights.remote(rt.engines, rt.weight_version, rt.cfg.weight_sync.bucket_mb) for t in rt.trainers])


def _trainer_diffs(rt: Runtime, prompt, traj) -> np.ndarray:
    # one sequence per trainer rank (every rank takes part in the ZeRO-3 forward)
    seq, *_ = seqs = [TrainSequence.from_prompt(prompt, traj.response_ids, traj.behaviour_logprobs, traj.loss_mask)
                      for _ in rt.trainers]
    logprob_pass(rt.trainers, seqs, rt.cfg, old=True, reference=False)
    return np.abs(np.asarray(seq.old_logprobs) - np.asarray(traj.behaviour_logprobs))


def _update_mid_generation(rt: Runtime, sample, partial: str, recompute_kv: bool):
    """Start one long trajectory, update the weights once it has tokens, return (prompt, trajectory)."""
    engine = rt.engines[0]
    ray.get(engine.configure.remote(partial="keep", recompute_kv=recompute_kv))
    sampling = SamplingConfig(n=1, max_new_tokens=LONG, ignore_eos=True, seed=11,
                              forbidden_token_ids=rt.sampling.forbidden_token_ids)
    ref = rt.workers.submit(sample, 0, sampling)
    _wait_for_tokens(engine, 8)
    ray.get(engine.pause.remote())  # frozen mid-generation; the update below resumes it
    ray.get(engine.configure.remote(partial=partial))  # what the update does to it: continue or abort
    before = rt.weight_version
    _sync(rt)
    out = rt.workers.take(ref)
    traj = out.trajectories[0]
    assert len(traj.response_ids) == LONG and traj.weight_version == before
    versions = np.asarray(traj.token_versions)
    assert set(versions.tolist()) == {before, rt.weight_version}, "tokens on both sides of the update"
    assert np.all(np.diff(versions) >= 0), "one switch, old to new"
    return out.prompt, traj, versions == rt.weight_version


def test_pause_keep_update_resume_matches_the_new_weights(runtime: Runtime, colors_samples: list) -> None:
    rt = runtime
    _train_without_sync(rt, colors_samples[:4])
    prompt, traj, new = _update_mid_generation(rt, colors_samples[5], "keep", recompute_kv=True)
    diffs = _trainer_diffs(rt, prompt, traj)  # trainer = new weights
    assert diffs[new].max() <= 1e-4, diffs[new].max()
    assert diffs[~new].mean() > 1e-2, "control: tokens before the update are the old policy's"
    stats = ray.get(rt.engines[0].stats.remote())
    assert stats["pauses"] >= 1


def test_keeping_the_old_kv_cache_gives_a_measured_mismatch(runtime: Runtime, colors_samples: list) -> None:
    rt = runtime
    _train_without_sync(rt, colors_samples[6:10])
    prompt, traj, new = _update_mid_generation(rt, colors_samples[11], "keep", recompute_kv=False)
    diffs = _trainer_diffs(rt, prompt, traj)
    # the new weights read KV computed by the old ones: the new tokens differ from the trainer's
    # recompute, which is what mismatch/* reports and what TIS/MIS weight (the update path's
    # metrics are tested in test_algorithms_correction.py)
    assert diffs[new].mean() > 1e-3, diffs[new].mean()
    seqs = make_sequences([prompt], [[traj]])
    assert seqs[0].response_ids == traj.response_ids


def test_abort_and_resubmit_with_the_prefix(runtime: Runtime, colors_samples: list) -> None:
    rt = runtime
    _train_without_sync(rt, colors_samples[12:16])
    before = ray.get(rt.workers.actors[0].router_stats.remote())[0]["resubmitted"]
    prompt, traj, new = _update_mid_generation(rt, colors_samples[17], "abort", recompute_kv=True)
    assert ray.get(rt.workers.actors[0].router_stats.remote())[0]["resubmitted"] == before + 1
    diffs = _trainer_diffs(rt, prompt, traj)
    assert diffs[new].max() <= 1e-4, diffs[new].max()  # the prefix was recomputed under the new weights
    ray.get(rt.engines[0].configure.remote(partial="keep"))


def test_router_back_pressure(runtime: Runtime, colors_samples: list) -> None:
    rt = runtime
    sampling = SamplingConfig(n=4, max_new_tokens=4, forbidden_token_ids=rt.sampling.forbidden_token_ids)
    rollout = run_rollout(rt.workers, colors_samples[20:26], sampling)
    assert len(rollout.groups) == 6 and all(len(g) == 4 for g in rollout.groups)
    stats = ray.get(rt.engines[0].stats.remote())
    assert 1 <= stats["max_in_flight"] <= 3  # rollout.max_requests_per_engine=3, 24 requests asked at once


def test_on_cpu_the_model_worker_runs_in_the_engine_core(runtime: Runtime) -> None:
    """cpu_engine_defaults: vLLM's model worker is not a third interpreter beside the engine
    core (one vLLM import fewer on the start's critical path), and the tests above ran on it."""
    import psutil

    pid = ray.get(runtime.engines[0].ready.remote())["pid"]
    names = [p.name() for p in psutil.Process(pid).children(recursive=True)]
    assert any("EngineCore" in n for n in names), names
    assert not any("Worker" in n for n in names), names


def test_the_engines_model_class_record_is_shared_with_later_runs(runtime: Runtime) -> None:
    """rollout/model_info_cache.py: what vLLM recorded about the model class in this run's cache
    is in the shared folder, byte for byte, for the next run's engine to skip the inspection."""
    from mmrl.rollout.model_info_cache import FOLDER, shared_dir

    run_records = sorted((runtime.run_dir / ".cache" / "vllm" / FOLDER).glob("*Qwen2_5_VL*.json"))
    assert run_records, "vLLM recorded no model-class info in the run"
    for record in run_records:
        assert (shared_dir() / record.name).read_bytes() == record.read_bytes()


def test_cpu_engine_defaults_keep_the_users_choice() -> None:
    from mmrl.rollout.engine import CPU_IN_PROCESS_EXECUTOR, cpu_engine_defaults

    assert cpu_engine_defaults({}) == {"enforce_eager": True, "distributed_executor_backend": CPU_IN_PROCESS_EXECUTOR}
    assert cpu_engine_defaults({"distributed_executor_backend": "mp", "enforce_eager": False}) == {
        "distributed_executor_backend": "mp", "enforce_eager": False}
    # several workers: vLLM's own executor, which starts one process per worker
    assert "distributed_executor_backend" not in cpu_engine_defaults({"tensor_parallel_size": 2})
