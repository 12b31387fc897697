"""Async rollout (rollout.mode=async):

  * the window: staleness accounting (a group whose oldest token is more than max_staleness
    versions behind is dropped and counted), the bounded window (never more groups drawn but
    untrained than its capacity), DAPO's informative-groups filter on the buffer, exact resume
    state. Real Ray rollout workers, real shard stream, real reward workers; the agent loop is a
    file plugin that needs no engine and stamps each trajectory with a weight version chosen by
    its slot, so the test decides which groups are stale.
  * the real CLI run, killed with SIGKILL mid-run and rerun with the same command: no sample is
    lost or trained twice (the samples in flight at the checkpoint are regenerated).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]

VERSIONED_LOOP = """
from mmrl.rollout.agent_loops import make_trajectory
from mmrl.rollout.types import Completion


async def versioned(ctx, sample, prompt):
    slot = int(ctx.sampling.request_key.split(".")[0])
    version = ctx.args["old"] if slot % 3 == 0 else ctx.args["new"]  # every third group is old
    word = ctx.args["words"][(slot + ctx.group_index) % 2 if slot % 2 else 0]  # odd slots: mixed rewards
    ids = ctx.processor.tokenizer.encode(word, add_special_tokens=False)
    return make_trajectory([Completion(ids, [-1.0] * len(ids), word, "stop", [version] * len(ids))])
"""


@pytest.fixture(scope="module")
def parts(tiny_model_dir: Path, colors_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    import ray

    from mmrl.config import load_config
    from mmrl.processors import build_processor
    from mmrl.rewards.workers import RewardPool
    from mmrl.rollout.workers import RolloutWorkers
    from mmrl.utils.env import init_local_ray

    plugin = tmp_path_factory.mktemp("loops") / "versioned.py"
    plugin.write_text(VERSIONED_LOOP)
    # the config first: a clean clone has no demo shards, so they come from the test's own data set
    cfg = load_config(str(REPO / "configs" / "colors_demo.yaml"),
                      [f"model.path={tiny_model_dir}", f"data.train_shards={colors_dir}/train-000000.tar",
                       f"data.heldout_shards={colors_dir}/heldout-000000.tar"])
    init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    workers = RolloutWorkers(1, [], {"name": "auto", "model_path": str(tiny_model_dir)}, f"{plugin}:versioned",
                             {"old": 0, "new": 5, "words": ["red", "blue"]})
    workers.ready()
    rewards = RewardPool([{"name": "first_word_in", "args": {"words": ["red"]}}], num_workers=1, timeout_s=30)
    processor = build_processor("auto", str(tiny_model_dir))
    from mmrl.rollout.types import SamplingConfig

    rt = SimpleNamespace(workers=workers, rewards=rewards, processor=processor, cfg=cfg,
                         sampling=SamplingConfig(n=2, max_new_tokens=2))
    yield rt, colors_dir
    rewards.close()
    workers.close()
    ray.shutdown()


def _batches(colors_dir: Path, size: int, resume=None):
    from mmrl.controller.prompts import SampleBatches
    from mmrl.data.stream import ShardStream

    stream = ShardStream(f"{colors_dir}/train-000000.tar", shuffle_buffer=0, max_bad_ratio=None, resume=resume)
    return SampleBatches(stream, size)


def test_stale_groups_are_dropped_and_counted_and_the_window_stays_bounded(parts) -> None:
    from mmrl.controller.async_rollout import AsyncRollout

    rt, colors_dir = parts
    window = AsyncRollout(rt, _batches(colors_dir, 4), batch_size=4, capacity=8, max_staleness=2, informative_only=False, version=6)
    taken: list[int] = []
    dropped = 0.0
    for _ in range(3):  # at one trainer version, k=2 admits 3 batches: (k + 1) * B groups
        batch, metrics = window.take(4, version=6)  # slot % 3 == 0 is version 0: 6 versions old
        assert len(window._draws) <= 8  # bounded: drawn but not trained
        taken += [d.index for d in batch]
        dropped += metrics["async/dropped_stale_groups"]
        assert metrics["async/staleness_max"] == 1 and metrics["async/staleness_share/1"] == 1.0
    assert all(i % 3 for i in taken) and len(taken) == len(set(taken)) == 12
    assert window._admissible() <= 0  # nothing more until the engines run a newer version
    window.on_new_version(7)
    assert 0 < len(window._draws) <= 8
    stale_drawn = [i for i in range(window._next_index) if i % 3 == 0]
    stale_open = [i for i in window._draws if i % 3 == 0]
    assert dropped == len(stale_drawn) - len(stale_open) >= 3  # each stale group dropped, and counted, once
    window.close()


def test_dynamic_sampling_keeps_drawing_until_enough_informative_groups(parts) -> None:
    from mmrl.controller.async_rollout import AsyncRollout

    rt, colors_dir = parts
    window = AsyncRollout(rt, _batches(colors_dir, 4), batch_size=4, capacity=6, max_staleness=8, informative_only=True, version=5)
    batch, metrics = window.take(4, version=5)
    assert all(d.index % 2 for d in batch)  # only odd slots have differing rewards
    assert all(len({t.reward for t in d.group}) == 2 for d in batch)
    assert metrics["async/dropped_uninformative_groups"] >= 3
    window.close()


def test_resume_state_regenerates_exactly_the_open_samples(parts) -> None:
    """The state names the cursor before the oldest unconsumed sample plus what was consumed after
    it; a window built from it draws the open samples again and skips the consumed ones."""
    from mmrl.controller.async_rollout import AsyncRollout

    rt, colors_dir = parts
    batches = _batches(colors_dir, 4)
    window = AsyncRollout(rt, batches, batch_size=4, capacity=8, max_staleness=8, informative_only=False, version=5)
    consumed = []
    for _ in range(3):
        consumed += [d.sample.key for d in window.take(4, version=5)[0]]
    state = json.loads(json.dumps(window.state_dict()))  # what a checkpoint stores
    open_keys = [d.sample.key for _, d in sorted(window._draws.items())]  # in draw order
    window.close()

    resumed = AsyncRollout(rt, _batches(colors_dir, 4, resume=state["cursor"]), batch_size=4, capacity=8,
                           max_staleness=8, informative_only=False, resume=state, version=5)
    resumed._fill()
    redrawn = [d.sample.key for _, d in sorted(resumed._draws.items())]
    assert open_keys and redrawn[:len(open_keys)] == open_keys  # the samples that were in flight come first
    assert not set(redrawn) & set(consumed)
    later = [d.sample.key for _ in range(4) for d in resumed.take(4, version=5)[0]]
    assert not set(later) & set(consumed) and len(later) == len(set(later))
    resumed.close()


def _cmd(run_dir: Path, model: Path, data: Path) -> list[str]:
    return [sys.executable, "-m", "mmrl.cli", "train", str(REPO / "configs" / "colors_demo.yaml"),
            f"model.path={model}", f"data.train_shards={data}/train-000000.tar", "data.heldout_shards=null",
            f"run.output_dir={run_dir}", "run.max_steps=8", "run.time_limit_s=null", "rollout.mode=async",
            "rollout.max_staleness=8", "rollout.max_buffered_groups=12", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "checkpoint.every_steps=2", "logging.progress_bar=false"]


@pytest.mark.slow
def test_kill_9_during_an_async_run_loses_and_duplicates_no_sample(tiny_model_dir: Path, colors_dir: Path,
                                                                    tmp_path: Path) -> None:
    from mmrl.data.stream import ShardStream

    run = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    log = open(tmp_path / "victim.log", "w")
    victim = subprocess.Popen(_cmd(run, tiny_model_dir, colors_dir), cwd=tmp_path, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    marker = run / "checkpoints" / "step_000004" / "meta.json"
    deadline = time.time() + 900
    while not marker.exists() and victim.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert marker.exists() and victim.poll() is None, (tmp_path / "victim.log").read_text()[-4000:]
    os.killpg(victim.pid, signal.SIGKILL)  # samples are in flight in the rollout workers now
    victim.wait()
    proc = subprocess.run(_cmd(run, tiny_model_dir, colors_dir), cwd=tmp_path, capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]

    steps = [json.loads(line) for line in (run / "batches.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, 9))
    trained = [k for s in steps for k in s["keys"]]
    assert len(trained) == len(set(trained)) == 32  # nothing trained twice
    # nothing lost: every sample the stream gave before the final checkpoint's oldest open one
    # was trained, and so were the ones after it that the state lists as consumed
    import torch

    data = torch.load(run / "checkpoints" / "step_000008" / "controller.pt", weights_only=False)["data"]
    assert data["mode"] == "async"
    order = [s.key for s in ShardStream(f"{colors_dir}/train-000000.tar", shuffle_buffer=512, seed=0,
                                        max_bad_ratio=None).take(200)]
    before = data["cursor"]["delivered"]
    expected = set(order[:before]) | {order[before + i] for i in data["skip"]}
    assert set(trained) == expected


def test_which_runs_recompute_old_logprobs(tiny_model_dir: Path) -> None:
    """algorithm.old_logprobs: auto recomputes π_old when it differs from the policy the update
    starts from (several updates per batch); with one update, also in async runs, π_old (π_prox)
    is the update's own forward; behaviour never recomputes."""
    from mmrl.config import load_config
    from mmrl.controller.learn import needs_old_logprobs

    def needs(*overrides: str) -> bool:
        return needs_old_logprobs(load_config(str(REPO / "configs" / "colors_demo.yaml"),
                                              [f"model.path={tiny_model_dir}", *overrides], check_files=False))

    assert not needs() and needs("algorithm.ppo_epochs=2") and not needs("rollout.mode=async")
    assert needs("rollout.mode=async", "algorithm.mini_batches=2")
    assert needs("algorithm.old_logprobs=recompute")
    assert not needs("rollout.mode=async", "algorithm.old_logprobs=behaviour")
