"""Which actor gets which Ray resources (`mmrl train --dry-run` prints the same plan; pure planning:
no GPU is needed to check the CUDA plan), and the process environment the actors start with."""
from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import pytest

from mmrl.config import load_config
from mmrl.config.load import ConfigError
from mmrl.controller.placement import format_plan, placement_bundles, placement_plan
from mmrl.utils.env import remove_stale_build_locks, torch_extensions_dir

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "colors_demo.yaml")


def test_cpu_plan_of_the_demo() -> None:
    plan = placement_plan(load_config(DEMO, [], check_files=False), "cpu")
    assert [p.role for p in plan] == ["driver", "rollout", "rollout_worker", "reward", "trainer", "trainer"]
    assert all("GPU" not in p.resources for p in plan)
    assert "total Ray resources requested: CPU=2" in format_plan(plan)


@pytest.mark.parametrize("args, gpus", [([], 1), (["rollout.engine_args.tensor_parallel_size=2"], 2),
                                         (["rollout.engine_args.tensor_parallel_size=2",
                                           "rollout.engine_args.pipeline_parallel_size=2"], 4),
                                         (["rollout.engine_args.tensor_parallel_size=2",
                                           "rollout.engine_args.data_parallel_size=3"], 6)])
def test_an_engine_reserves_every_gpu_vllm_will_use(args: list[str], gpus: int, tiny_model_dir: Path) -> None:
    """tensor x pipeline parallel split one model over GPUs, data parallel runs copies of it: the
    engine actor's reservation (and the memory plan's device count) covers them all."""
    from mmrl.controller.memory_plan import memory_plan

    cfg = load_config(DEMO, [f"model.path={tiny_model_dir}", "rollout.num_engines=2", *args], check_files=False)
    engines = [p for p in placement_plan(cfg, "cuda") if p.role == "rollout"]
    assert [p.ray_options()["num_gpus"] for p in engines] == [float(gpus)] * 2
    assert f"GPU x{gpus}" in engines[0].work
    plan = memory_plan(cfg, "cuda", 80.0)
    assert plan.devices_needed == 2 * gpus + cfg.trainer.world_size


def test_data_parallel_copies_hold_the_whole_split_and_share_the_prompts(tiny_model_dir: Path) -> None:
    from mmrl.controller.memory_plan import memory_plan

    def engine_terms(*args: str) -> dict[str, float]:
        cfg = load_config(DEMO, [f"model.path={tiny_model_dir}", "rollout.prompts_per_step=4", *args],
                          check_files=False)
        return {t.key: t.bytes for t in memory_plan(cfg, "cuda").loads[0].terms}

    one, tp2, dp2 = engine_terms(), engine_terms("rollout.engine_args.tensor_parallel_size=2"), \
        engine_terms("rollout.engine_args.data_parallel_size=2")
    assert tp2["engine_weights"] == one["engine_weights"] / 2 and dp2["engine_weights"] == one["engine_weights"]
    # half the sequences in flight per copy (unknown GPU memory: the KV cache is what the rollout needs)
    assert dp2["kv_cache"] == one["kv_cache"] / 2 and tp2["kv_cache"] == one["kv_cache"] / 2


def test_reward_workers_can_take_a_gpu_share_on_cuda() -> None:
    cfg = load_config(DEMO, ["reward_execution.num_workers=2", "reward_execution.num_gpus=0.25",
                             "reward_execution.num_cpus=1"], check_files=False)
    rewards = [p for p in placement_plan(cfg, "cuda") if p.role == "reward"]
    assert [p.ray_options() for p in rewards] == [{"num_cpus": 1.0, "num_gpus": 0.25}] * 2
    with pytest.raises(ConfigError, match="reward_execution.num_gpus' is 0.25 but this run has no GPU"):
        placement_plan(cfg, "cpu")


def test_stale_torch_extension_build_locks_are_removed(tmp_path: Path) -> None:
    """A build killed mid-way leaves a lock that torch waits on forever (every later DeepSpeed
    init would hang); a fresh lock (a build in progress) is left alone."""
    stale, fresh = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "other_op" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.touch()
    old = time.time() - 3600
    os.utime(stale, (old, old))
    with pytest.warns(UserWarning, match="stale torch extension build lock"):
        assert remove_stale_build_locks(tmp_path) == [str(stale)]
    assert not stale.exists() and fresh.exists()


def test_torch_extensions_dir_is_per_python_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    expected = tmp_path / ".cache" / "mmrl" / "torch_extensions" / hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]
    assert torch_extensions_dir() == str(expected)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))  # the user's choice wins
    assert torch_extensions_dir() == str(tmp_path / "mine")


def test_trainer_backend_plan_has_no_vllm_engine() -> None:
    """rollout.backend=trainer: one sampler actor on the trainer ranks (no CPU of its own), no engines."""
    plan = placement_plan(load_config(DEMO, ["rollout.backend=trainer", "rollout.num_engines=2"], check_files=False), "cpu")
    rollout = [p for p in plan if p.role == "rollout"]
    assert len(rollout) == 1 and rollout[0].resources == {"CPU": 0.0} and "trainer ranks" in rollout[0].work
    assert "weight buckets" not in format_plan(plan)


JOINED = ["cluster.ray_address=auto"]  # role placement needs a cluster whose nodes offer it


def test_the_default_plan_asks_for_no_placement() -> None:
    """No placement keys: the actors' options are what they were (CPU/GPU only, no group)."""
    plan = placement_plan(load_config(DEMO, [], check_files=False), "cpu")
    assert all(set(p.ray_options()) == {"num_cpus"} and p.bundle is None and not p.labels for p in plan)
    assert "placement group" not in format_plan(plan)


def test_role_resources_and_labels_reach_each_actors_options() -> None:
    cfg = load_config(DEMO, JOINED + ["cluster.role_resources.rollout.engine_node=0.01",
                                      "cluster.role_labels.trainer.pool=train"], check_files=False)
    plan = placement_plan(cfg, "cpu")
    engine = next(p for p in plan if p.role == "rollout")
    assert engine.ray_options() == {"num_cpus": 1.0, "resources": {"engine_node": 0.01}}
    trainers = [p.ray_options() for p in plan if p.role == "trainer"]
    assert trainers == [{"num_cpus": 0.5, "label_selector": {"pool": "train"}}] * 2
    assert next(p for p in plan if p.role == "reward").ray_options() == {"num_cpus": 0.0}
    text = format_plan(plan)
    assert "CPU=1, engine_node=0.01" in text and "[labels pool=train] DeepSpeed" in text
    assert "total Ray resources requested: CPU=2, engine_node=0.01" in text


def test_a_placement_strategy_gives_bundles_to_the_actors_that_reserve_something() -> None:
    """One bundle per engine and per rank, one for all the reward workers (their pool starts and
    restarts them from one option set); the rollout workers ask for nothing and get none."""
    cfg = load_config(DEMO, JOINED + ["cluster.placement_strategy=SPREAD", "reward_execution.num_workers=2",
                                      "cluster.role_resources.reward.trainer_node=0.01",
                                      "cluster.role_labels.trainer.pool=train"], check_files=False)
    plan = placement_plan(cfg, "cpu")
    assert [(p.role, p.bundle) for p in plan] == [("driver", None), ("rollout", 0), ("rollout_worker", None),
                                                 ("reward", 1), ("reward", 1), ("trainer", 2), ("trainer", 3)]
    bundles, labels = placement_bundles(plan)
    assert bundles == [{"CPU": 1.0}, {"trainer_node": 0.02}, {"CPU": 0.5}, {"CPU": 0.5}]
    assert labels == [{}, {}, {"pool": "train"}, {"pool": "train"}]
    assert "placement group (cluster.placement_strategy): 4 bundles" in format_plan(plan)
    group = object()  # stands in for the PlacementGroup reserve_placement() hands out
    for p in plan:
        if p.bundle is not None:
            p.group = group
    rank1 = plan[-1].ray_options()
    strategy = rank1.pop("scheduling_strategy")
    assert rank1 == {"num_cpus": 0.5}  # its labels are the bundle's now
    assert strategy.placement_group is group and strategy.placement_group_bundle_index == 3
    assert plan[3].ray_options()["resources"] == {"trainer_node": 0.01}


@pytest.mark.parametrize("override, message", [
    ("cluster.role_resources.rollot.engine_node=1", r"'cluster.role_resources.rollot': unknown role 'rollot'. "
                                                    r"Did you mean 'rollout'\?"),
    ("cluster.role_labels.driver.pool=a", r"'cluster.role_labels.driver': unknown role .*the driver runs where"),
    ("cluster.role_resources.trainer.CPU=2", r"'cluster.role_resources.trainer.CPU': CPU is not a custom resource"
                                             r".*cluster.trainer_cpus_per_rank"),
    ("cluster.role_resources.trainer.trainer_node=0", r"'cluster.role_resources.trainer.trainer_node': 0.0. "
                                                      r"It must be positive"),
    ("cluster.role_labels.trainer.pool=in(a,b)", r"'cluster.role_labels.trainer.pool': 'in\(a,b\)'. Give the label's "
                                                 r"exact value"),
    ("cluster.placement_strategy=PACKED", r"'cluster.placement_strategy'.*PACK, SPREAD, STRICT_PACK, STRICT_SPREAD"),
    ("cluster.role_resources.rollout=1", r"'cluster.role_resources.rollout'"),
])
def test_bad_placement_keys_are_refused_at_load(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO, JOINED + [override], check_files=False)


def test_role_placement_on_the_local_instance_is_refused() -> None:
    """The local Ray instance mmrl starts has no custom resources or labels: the actors would wait forever."""
    with pytest.raises(ConfigError, match=r"'cluster.role_resources' / 'cluster.role_labels'.*set cluster.ray_address"):
        load_config(DEMO, ["cluster.role_labels.trainer.pool=train"], check_files=False)
    plan = placement_plan(load_config(DEMO, ["cluster.placement_strategy=STRICT_PACK"], check_files=False), "cpu")
    assert [p.bundle for p in plan if p.bundle is not None] == [0, 1, 2]  # a strategy alone is fine locally
