"""Colocated mode (`cluster.colocate`, mmrl/controller/colocate.py): the placement (engine i and
trainer rank i in one GPU bundle), the engine arguments (sleep mode, a gpu_memory_utilization that
leaves the rank its memory), the refusals at load, the colocated memory plan against split mode,
the controller's sleep/wake order around the update and the weight sync, and the engine's sleep
state machine on a real vLLM CPU engine. No GPU here: the CUDA plan is planned for absent GPUs."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mmrl.cli import main
from mmrl.config import load_config
from mmrl.config.load import ConfigError
from mmrl.controller.memory_plan import GIB, MemoryPlanError, check_memory_plan, memory_plan, trainer_hold, trainer_load
from mmrl.controller.placement import placement_bundles, placement_plan
from test_memory_plan import QWEN2_5_VL_7B

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "configs" / "colors_demo.yaml")
GEO3K_1X8 = str(REPO / "configs" / "qwen2_5_vl_7b_geo3k_1x8.yaml")
COLO = ["cluster.device=cuda", "cluster.colocate=true"]


@pytest.fixture(scope="module")
def qwen7b_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2_5_vl_7b")
    (folder / "config.json").write_text(json.dumps(QWEN2_5_VL_7B))
    return folder


def _7b(qwen7b_dir: Path, *overrides: str) -> Any:
    """The shipped 1x8 config (4 ranks, 4 engines, 80 GB) on the local 7B config.json."""
    return load_config(GEO3K_1X8, [f"model.path={qwen7b_dir}", *overrides], check_files=False)


# ---- placement --------------------------------------------------------------------------------
def test_colocated_engine_and_rank_share_one_gpu_bundle() -> None:
    cfg = load_config(DEMO, COLO + ["rollout.num_engines=2"], check_files=False)
    plan = placement_plan(cfg, "cuda")
    assert [(p.role, p.index, p.bundle) for p in plan if p.bundle is not None] == [
        ("rollout", 0, 0), ("rollout", 1, 1), ("trainer", 0, 0), ("trainer", 1, 1)]
    bundles, _ = placement_bundles(plan)
    assert bundles == [{"CPU": 1.5, "GPU": 1.0}, {"CPU": 1.5, "GPU": 1.0}]  # one GPU each: both on it
    group = object()
    for p in plan:
        if p.bundle is not None:
            p.group = group
    engine1, rank1 = (next(p for p in plan if (p.role, p.index) == (role, 1)).ray_options() for role in ("rollout", "trainer"))
    assert engine1["num_gpus"] == rank1["num_gpus"] == 0.5
    assert engine1["scheduling_strategy"].placement_group_bundle_index == \
        rank1["scheduling_strategy"].placement_group_bundle_index == 1


def test_colocation_reserves_with_pack_unless_a_strategy_is_given() -> None:
    from mmrl.controller.placement import placement_strategy

    cfg = load_config(DEMO, COLO, check_files=False)
    assert placement_strategy(cfg, "cuda") == "PACK"
    spread = load_config(DEMO, COLO + ["cluster.placement_strategy=SPREAD"], check_files=False)
    assert placement_strategy(spread, "cuda") == "SPREAD"
    split = load_config(DEMO, ["cluster.device=cuda"], check_files=False)  # split mode: as before
    assert placement_strategy(split, "cuda") is None
    assert all(p.bundle is None for p in placement_plan(split, "cuda"))
    assert [p.resources.get("GPU") for p in placement_plan(split, "cuda") if p.role in ("rollout", "trainer")] == [1.0] * 3


def test_fewer_engines_than_ranks_leave_the_other_ranks_a_whole_gpu() -> None:
    plan = placement_plan(load_config(DEMO, COLO, check_files=False), "cuda")  # 1 engine, 2 ranks
    assert [(p.role, p.index, p.resources["GPU"], p.bundle) for p in plan if "GPU" in p.resources] == [
        ("rollout", 0, 0.5, 0), ("trainer", 0, 0.5, 0), ("trainer", 1, 1.0, 1)]


# ---- engine arguments ---------------------------------------------------------------------------
def test_colocated_engine_args_turn_on_sleep_mode_and_leave_the_rank_its_memory(qwen7b_dir: Path) -> None:
    """gpu_memory_utilization unset (or null): 1 - the rank's hold / memory - 2%, rounded down;
    the 7B rank peaks at ~48.7 GiB and holds ~35 GiB between updates (its activations and logits
    go back after each update) of 80 -> 0.54. A value in rollout.engine_args is kept."""
    from mmrl.controller.colocate import colocated_engine_args
    from mmrl.controller.memory_plan import read_model_shape
    from mmrl.rollout.engine import engine_kwargs

    cfg = _7b(qwen7b_dir, *COLO, "rollout.engine_args.gpu_memory_utilization=null")
    kwargs = colocated_engine_args(cfg, "cuda", engine_kwargs(cfg.model.path, "bfloat16", 0, cfg.rollout.engine_args))
    hold = trainer_hold(trainer_load(cfg, read_model_shape(str(qwen7b_dir)), "cuda"))
    assert kwargs["enable_sleep_mode"] is True
    assert kwargs["gpu_memory_utilization"] == 0.54 == int((1 - hold / (80 * GIB) - 0.02) * 100) / 100
    explicit = _7b(qwen7b_dir, *COLO, "rollout.engine_args.gpu_memory_utilization=0.3")
    kept = colocated_engine_args(explicit, "cuda", engine_kwargs(explicit.model.path, "bfloat16", 0,
                                                                 explicit.rollout.engine_args))
    assert kept["gpu_memory_utilization"] == 0.3 and kept["enable_sleep_mode"] is True
    unknown = _7b(qwen7b_dir, *COLO, "cluster.gpu_memory_gb=null", "rollout.engine_args.gpu_memory_utilization=null")
    with pytest.raises(ConfigError, match="set cluster.gpu_memory_gb, or rollout.engine_args.gpu_memory_utilization"):
        colocated_engine_args(unknown, "cuda", {"gpu_memory_utilization": None})


def test_vllm_takes_the_arguments_and_refuses_sleep_mode_off_cuda(tiny_model_dir: Path) -> None:
    """The reason colocation is refused on CPU, from vLLM 0.32 itself: its ModelConfig rejects
    enable_sleep_mode unless the platform has sleep mode (CUDA, ROCm, XPU)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from mmrl.rollout.engine import cpu_engine_defaults, engine_kwargs

    kwargs = cpu_engine_defaults(engine_kwargs(str(tiny_model_dir), "float32", 0, {}))
    args = AsyncEngineArgs(**{**kwargs, "enable_sleep_mode": True, "gpu_memory_utilization": 0.37})
    with pytest.raises(Exception, match="Sleep mode is not supported on current platform"):
        args.create_engine_config()


# ---- refusals at load ---------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["cluster.device=cpu", "cluster.colocate=true"], r"'cluster.colocate' is true but this run's device is cpu.*needs CUDA"),
    (COLO + ["rollout.mode=async"], r"'cluster.colocate' is true with rollout.mode=async.*rollout.mode=sync"),
    (COLO + ["rollout.backend=trainer"], r"'cluster.colocate' is true with rollout.backend=trainer"),
    (COLO + ["rollout.engine_args.tensor_parallel_size=2"], r"tensor_parallel_size x pipeline_parallel_size x data_parallel_size = 2"),
    (COLO + ["rollout.num_engines=3"], r"'rollout.num_engines' is 3 with cluster.colocate=true.*<= 2"),
    (COLO + ["rollout.engine_args.enable_sleep_mode=false"], r"'rollout.engine_args.enable_sleep_mode' is false"),
    (COLO + ["rollout.engine_args.gpu_memory_utilization=1.0"], r"give a fraction below 1"),
    (COLO + ["cluster.ray_address=auto", "cluster.role_labels.trainer.pool=train"],
     r"'cluster.role_labels.rollout' \(\{\}\) and 'cluster.role_labels.trainer'.*differ"),
])
def test_colocation_is_refused_where_it_cannot_work(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO, overrides, check_files=False)


def test_colocation_on_an_auto_device_without_a_gpu_is_refused() -> None:
    """cluster.device=auto resolves to cpu on this machine (no GPU)."""
    with pytest.raises(ConfigError, match="device is cpu \\(cluster.device=auto\\)"):
        load_config(DEMO, ["cluster.colocate=true"], check_files=False)


# ---- memory plan --------------------------------------------------------------------------------
def test_colocated_plan_is_the_peak_of_its_phases_against_split_mode(qwen7b_dir: Path) -> None:
    split = memory_plan(_7b(qwen7b_dir), "cuda", 80.0)
    colo = memory_plan(_7b(qwen7b_dir, *COLO, "rollout.engine_args.gpu_memory_utilization=null"), "cuda", 80.0)
    trainer, engine = split.loads[1], split.loads[0]
    assert (split.devices_needed, colo.devices_needed) == (8, 4)
    (gpu,) = colo.loads  # 4 engines on the 4 ranks' GPUs: no GPU holds a rank alone
    phases = {name.split(" (")[0]: sum(t.bytes for t in terms) for name, terms in gpu.phases}
    assert phases["train"] == pytest.approx(trainer.total + 1 * GIB)  # + the sleeping engine's residue
    util, hold = 0.54, trainer_hold(trainer)
    assert hold < trainer.total  # the update's activations and logits are given back
    # rollout: the rank's hold + the engine's whole budget (weights + KV cache + runtime = util x memory)
    assert phases["rollout"] == pytest.approx(hold + util * 80 * GIB)
    weights = {t.key: t.bytes for t in engine.terms}["engine_weights"]
    assert phases["weight sync"] == pytest.approx(hold + weights + 2 * GIB + 3 * 64 * 2**20)  # 3 buckets
    assert gpu.total == max(phases.values()) == phases["rollout"] <= 80 * GIB
    check_memory_plan(colo)
    # the split plan's engine had 0.85 x 80 GiB; colocated, its KV cache shrinks to what the rank leaves
    kv = {t.key: t.bytes for t in gpu.terms}["kv_cache"]
    assert kv == pytest.approx(util * 80 * GIB - weights - 2 * GIB)
    assert kv < 0.6 * {t.key: t.bytes for t in engine.terms}["kv_cache"]  # about half the split engine's


def test_ranks_without_an_engine_are_planned_as_in_split_mode(qwen7b_dir: Path) -> None:
    plan = memory_plan(_7b(qwen7b_dir, *COLO, "rollout.num_engines=2"), "cuda", 80.0)
    shared, alone = plan.loads
    assert (shared.count, alone.count, plan.devices_needed) == (2, 2, 4)
    assert alone.total == memory_plan(_7b(qwen7b_dir), "cuda", 80.0).loads[1].total and not alone.phases


def test_colocated_plan_refuses_the_split_engine_budget_and_names_what_fits(qwen7b_dir: Path) -> None:
    plan = memory_plan(_7b(qwen7b_dir, *COLO), "cuda", 80.0)  # the config's 0.85, meant for split mode
    with pytest.raises(MemoryPlanError, match=r"biggest term is KV cache .*gpu_memory_utilization at most 0.54"):
        check_memory_plan(plan)


def test_dry_run_of_the_7b_config_colocated(qwen7b_dir: Path, colors_dir: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    shards = [f"data.train_shards={colors_dir}/train-000000.tar", f"data.heldout_shards={colors_dir}/heldout-000000.tar"]
    args = ["train", GEO3K_1X8, f"model.path={qwen7b_dir}", *shards, *COLO]
    capsys.readouterr()
    assert main(args + ["rollout.engine_args.gpu_memory_utilization=null", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "trainer/3          CPU=4, GPU=0.5         [bundle 3]" in out and "GPU shared with rollout/3" in out
    assert "4 bundles" in out and "0: CPU=8, GPU=1" in out
    plan = out[out.index("# memory plan"):]
    assert "colocated placement" in plan and "devices needed: 4" in plan
    assert "phase train (engine asleep)" in plan and "phase rollout (engine awake)" in plan
    assert "gpu_memory_utilization 0.54" in plan and ": fits" in plan
    assert main(args + ["--dry-run"]) == 2  # the config's own 0.85: printed, then refused
    assert "DOES NOT FIT" in capsys.readouterr().out


# ---- the controller's order ---------------------------------------------------------------------
@pytest.fixture
def ray_local() -> Any:
    """Per test: the real-engine test between its users starts its own Ray (local_engine), with
    the engine's environment, which a running instance would not get."""
    import ray

    from mmrl.utils.env import init_local_ray

    init_local_ray(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _stand_ins() -> tuple[Any, Any]:
    """(Log, RecordingEngine) Ray actor classes, defined here so Ray ships them by value (the
    workers cannot import this test module)."""
    import ray

    class Log:
        def __init__(self) -> None:
            self.events: list[tuple] = []

        def add(self, *event: Any) -> None:
            self.events.append(event)

        def get(self) -> list[tuple]:
            return self.events

    class RecordingEngine:
        """Records its calls in a Log and keeps vLLM's sleep bookkeeping (v1/executor/abstract.py:
        sleep() marks weights and kv_cache asleep, wake_up(tags) wakes those; fully awake when none
        sleeps)."""

        def __init__(self, index: int, log: Any, wakes: bool = True) -> None:
            self.index, self.log, self.asleep, self.wakes = index, log, set(), wakes

        def sleep(self, level: int) -> None:
            ray.get(self.log.add.remote("sleep", self.index, level))
            self.asleep = {"weights", "kv_cache"}

        def wake_up(self, tags: list[str] | None) -> bool:
            ray.get(self.log.add.remote("wake", self.index, tuple(tags or ())))
            if self.wakes:
                self.asleep -= set(tags or self.asleep)
            return not self.asleep

    return ray.remote(num_cpus=0)(Log), ray.remote(num_cpus=0)(RecordingEngine)


def test_run_step_sleeps_the_engines_for_the_update_and_wakes_weights_then_kv_cache(
        ray_local: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Stand-ins for the engines (Ray actors that record their calls and keep vLLM's sleep state:
    fully awake only when no tag sleeps), because vLLM's sleep mode needs CUDA and there is no
    GPU here; the memory effect runs only on a GPU machine (scripts/gpu_smoke.sh). The real
    RolloutEngine methods are checked against a real vLLM CPU engine below. What this pins:
    every engine sleeps before the update, wakes its weights after it and before the weight
    sync, and its KV cache after the sync; the spans give time/engine_sleep_s and time/engine_wake_s;
    in split mode nothing sleeps."""
    import ray

    from mmrl.controller import loop
    from mmrl.rollout.types import SamplingConfig
    from mmrl.utils.timing import StepSpans

    Log, RecordingEngine = _stand_ins()
    def run(colocate: str) -> tuple[list[tuple], dict[str, float]]:
        log = Log.remote()
        cfg = load_config(DEMO, ["cluster.device=cuda", f"cluster.colocate={colocate}", "rollout.num_engines=2"],
                          check_files=False)
        rt = loop.Runtime(cfg=cfg, run_dir=tmp_path, device="cuda", processor=None, rewards=None,
                          sampling=SamplingConfig(n=2, max_new_tokens=4), engines=[RecordingEngine.remote(i, log)
                                                                                   for i in range(2)],
                          workers=type("Workers", (), {"restarts": 0})(), trainers=[])
        # one group: the update (a stand-in here too) only needs something to learn from
        monkeypatch.setattr(loop, "rollout_and_score", lambda *a, **k: ([None], [["trajectory"]], [], {}))
        monkeypatch.setattr(loop, "log_rollouts", lambda *a, **k: None)

        def update(*a: Any, **k: Any) -> dict[str, float]:
            ray.get(log.add.remote("update"))
            return {"loss/pg": 0.0}

        def push(new_version: bool = True) -> dict[str, float]:
            ray.get(log.add.remote("weight_sync"))
            return {"mb": 1.0}

        monkeypatch.setattr(loop, "update_policy", update)
        monkeypatch.setattr(rt, "push_weights", push)
        spans = StepSpans()
        metrics, _ = loop.run_step(rt, [], None, spans, step=1)
        assert metrics["loss/pg"] == 0.0 and metrics["weight_sync/mb"] == 1.0
        return ray.get(log.get.remote()), spans.metrics()

    events, metrics = run("true")
    kinds = [e[0] if e[0] in ("update", "weight_sync") else f"{e[0]}{e[-1]}" for e in events]
    assert kinds == ["sleep1", "sleep1", "update", "wake('weights',)", "wake('weights',)", "weight_sync",
                     "wake('kv_cache',)", "wake('kv_cache',)"]
    assert sorted(e[1] for e in events if e[0] == "sleep") == [0, 1]  # every engine, each step
    assert metrics["time/engine_sleep_s"] >= 0 and metrics["time/engine_wake_s"] >= 0
    events, metrics = run("false")
    assert events == [("update",), ("weight_sync",)] and "time/engine_sleep_s" not in metrics


@pytest.mark.slow
def test_a_real_engine_sleeps_and_schedules_again_only_when_fully_awake(tiny_model_dir: Path, tmp_path: Path) -> None:
    """vLLM's sleep state machine through RolloutEngine on a CPU engine: the memory is not freed on
    CPU (its worker's sleep/wake_up only log "not supported"), but the engine core's bookkeeping
    is vLLM's own: after wake_up(["weights"]) the engine is still asleep and does not schedule;
    after wake_up(["kv_cache"]) it is fully awake and the queued request completes. No call has
    a deadline of its own (a busy machine may take minutes): the suite's hang guard bounds it."""
    import ray

    from mmrl.rollout.types import RequestSampling
    from mmrl.testing import local_engine

    with local_engine(tiny_model_dir, tmp_path) as eng:
        engine = eng["engine"]
        assert ray.get(engine.is_sleeping.remote()) is False
        ray.get(engine.sleep.remote(1))
        assert ray.get(engine.is_sleeping.remote()) is True
        assert ray.get(engine.wake_up.remote(["weights"])) is False
        request = engine.generate.remote({"prompt_token_ids": [1, 2, 3]}, RequestSampling(max_tokens=4, ignore_eos=True))
        ready, _ = ray.wait([request], timeout=5)
        assert not ready and ray.get(engine.is_sleeping.remote()) is True  # partly awake: not scheduling
        assert ray.get(engine.wake_up.remote(["kv_cache"])) is True
        completion = ray.get(request)
        assert len(completion.token_ids) == 4 and ray.get(engine.is_sleeping.remote()) is False


def test_a_dead_engine_is_left_to_the_replacement_and_one_still_asleep_stops_the_step(ray_local: Any) -> None:
    """Stand-ins again (no CUDA here): an engine that died while asleep is skipped (the weight sync
    replaces it: Runtime.push_weights); one that is not fully awake after both wakes raises,
    naming it, instead of leaving a paused scheduler to the rollout."""
    import ray

    from mmrl.controller.colocate import EngineColocation
    from mmrl.utils.timing import StepSpans

    Log, engine = _stand_ins()
    log = Log.remote()
    alive, dead, stuck = engine.remote(0, log), engine.remote(1, log), engine.remote(2, log, wakes=False)
    rt = type("Rt", (), {"engines": [alive, dead]})()
    colo, spans = EngineColocation(rt), StepSpans()
    colo.sleep(spans)
    ray.kill(dead)
    colo.wake_weights(spans)
    colo.wake_kv_cache(spans)
    assert ray.get(log.get.remote())[-1] == ("wake", 0, ("kv_cache",))
    rt.engines = [alive, stuck]
    colo.sleep(spans)
    colo.wake_weights(spans)
    with pytest.raises(RuntimeError, match=r"engine\(s\) \[1\] still partly asleep"):
        colo.wake_kv_cache(spans)
