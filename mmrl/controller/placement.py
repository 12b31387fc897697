"""Which process does what, and with which resources. Printed by `mmrl train --dry-run`."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from mmrl.config.schema import Config

# The roles cluster.role_resources and cluster.role_labels may name (the driver is not an actor:
# it runs where `mmrl train` runs).
PLACED_ROLES = ("rollout", "rollout_worker", "reward", "trainer")
# Their pools start (and the reward pool restarts) every worker from one option set, so a
# placement group gives each of these roles one bundle for all its workers.
SHARED_BUNDLE_ROLES = ("rollout_worker", "reward")
# cluster.colocate: engine i and trainer rank i share one GPU (one bundle of GPU=1). Ray's GPU
# share is a scheduling token, not a memory limit: it only makes both land on the same device.
# Memory is split by the engine's gpu_memory_utilization (mmrl/controller/colocate.py).
COLOCATED_ENGINE_GPU = 0.5
# The strategy colocation reserves its bundles with when cluster.placement_strategy is null: a
# shared GPU needs a bundle (without one, Ray may pack two engines' shares onto one device).
COLOCATED_DEFAULT_STRATEGY = "PACK"


@dataclass
class Placement:
    role: str
    index: int
    resources: dict[str, float]
    work: str
    labels: dict[str, str] = field(default_factory=dict)  # node labels the actor must run on
    bundle: int | None = None  # its bundle in the run's placement group (cluster.placement_strategy)
    group: Any = None  # that placement group once reserve_placement() has reserved it

    def ray_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.resources.get("CPU", 0.0)}
        if self.resources.get("GPU"):
            opts["num_gpus"] = self.resources["GPU"]
        custom = {k: v for k, v in self.resources.items() if k not in ("CPU", "GPU")}
        if custom:
            opts["resources"] = custom
        if self.group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            # the bundle already carries the node labels (bundle_label_selector)
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=self.bundle)
        elif self.labels:
            opts["label_selector"] = dict(self.labels)
        return opts


def engine_devices(engine_args: dict[str, Any]) -> tuple[int, int]:
    """(devices one engine's model is split over, devices one engine uses): vLLM splits the model
    over tensor_parallel_size x pipeline_parallel_size GPUs and runs data_parallel_size copies of
    that, so an engine actor reserves all of them."""
    def size(key: str) -> int:
        value = engine_args.get(key)
        return int(value) if value is not None else 1

    split = size("tensor_parallel_size") * size("pipeline_parallel_size")
    return split, split * size("data_parallel_size")


def colocated(cfg: Config, device: str) -> bool:
    """Engines share the trainer ranks' GPUs (cluster.colocate; load refuses it off CUDA)."""
    return cfg.cluster.colocate and device == "cuda" and cfg.rollout.backend.value == "vllm"


def placement_strategy(cfg: Config, device: str) -> str | None:
    """The placement group's strategy: cluster.placement_strategy, else PACK when colocated."""
    if cfg.cluster.placement_strategy is not None:
        return cfg.cluster.placement_strategy.value
    return COLOCATED_DEFAULT_STRATEGY if colocated(cfg, device) else None


def placement_plan(cfg: Config, device: str) -> list[Placement]:
    gpu = device == "cuda"
    colo = colocated(cfg, device)
    _, engine_gpus = engine_devices(cfg.rollout.engine_args)
    plan = [Placement("driver", 0, {"CPU": 0.0},
                      f"controller loop ({cfg.rollout.mode.value} rollout), shard stream "
                      f"({cfg.data.num_workers} loader workers), reward streaming, metrics")]
    if cfg.rollout.backend.value == "trainer":
        plan.append(Placement("rollout", 0, {"CPU": 0.0},
                              f"sampler on the trainer ranks (rollout.backend=trainer): batches the workers' "
                              f"requests for the {cfg.trainer.world_size} ZeRO-3 rank(s)"))
    for i in range(cfg.rollout.num_engines if cfg.rollout.backend.value == "vllm" else 0):
        res = {"CPU": cfg.cluster.rollout_cpus_per_engine}
        if gpu:
            res["GPU"] = COLOCATED_ENGINE_GPU if colo else float(engine_gpus)
        plan.append(Placement("rollout", i, res,
                              f"vLLM AsyncLLM engine ({'GPU x%d' % engine_gpus if gpu else 'CPU'}), "
                              f"~{-(-cfg.rollout.prompts_per_step // cfg.rollout.num_engines)} prompts/step "
                              f"x n={cfg.rollout.group_size}"
                              + (f"; colocated: shares trainer/{i}'s GPU, sleeps while it trains" if colo else "")))
    for w in range(cfg.rollout.num_workers):
        # asyncio actors: the processor and the agent loops, mostly waiting on the engines
        plan.append(Placement("rollout_worker", w, {"CPU": 0.0},
                              f"processor '{cfg.processor.name}', agent loop '{cfg.rollout.agent_loop}', "
                              f"router over {cfg.rollout.num_engines if cfg.rollout.backend.value == 'vllm' else 1} engine(s)"))
    for w in range(cfg.reward_execution.num_workers):
        res = {"CPU": cfg.reward_execution.num_cpus}
        if cfg.reward_execution.num_gpus:
            if not gpu:
                from mmrl.config.load import ConfigError

                raise ConfigError(f"Config key 'reward_execution.num_gpus' is {cfg.reward_execution.num_gpus:g} "
                                  f"but this run has no "
                                 f"GPU (device {device}): set reward_execution.num_gpus=0 and the rewards' device "
                                 f"args to cpu, or run with cluster.device=cuda")
            res["GPU"] = cfg.reward_execution.num_gpus
        plan.append(Placement("reward", w, res, f"reward worker: {', '.join(r.name for r in cfg.rewards)} "
                                               f"(timeout {cfg.reward_execution.timeout_s:g}s per call)"))
    for r in range(cfg.trainer.world_size):
        res = {"CPU": cfg.cluster.trainer_cpus_per_rank}
        if gpu:
            res["GPU"] = 1.0 - COLOCATED_ENGINE_GPU if colo and r < cfg.rollout.num_engines else 1.0
        plan.append(Placement("trainer", r, res,
                              f"DeepSpeed ZeRO-3 rank {r}/{cfg.trainer.world_size} "
                              f"({'nccl' if gpu else 'gloo'}), ~"
                              f"{cfg.rollout.prompts_per_step * cfg.rollout.group_size // cfg.trainer.world_size} "
                              f"sequences/step" + (", sends weight buckets to the engines" if r == 0 and cfg.rollout.backend.value == "vllm" else "")
                              + (f"; GPU shared with rollout/{r}" if colo and r < cfg.rollout.num_engines else "")))
    for p in plan:
        p.resources.update(cfg.cluster.role_resources.get(p.role, {}))
        p.labels = dict(cfg.cluster.role_labels.get(p.role, {}))
    if placement_strategy(cfg, device) is not None:
        bundles: dict[tuple[str, int], int] = {}
        for p in plan:
            if p.role != "driver" and any(p.resources.values()):  # Ray refuses a bundle of nothing
                key = (p.role, 0 if p.role in SHARED_BUNDLE_ROLES else p.index)
                if colo and p.role in ("rollout", "trainer") and p.index < cfg.rollout.num_engines:
                    key = ("gpu", p.index)  # engine i and rank i: one bundle, one GPU
                p.bundle = bundles.setdefault(key, len(bundles))
    return plan


def placement_bundles(plan: list[Placement]) -> tuple[list[dict[str, float]], list[dict[str, str]]]:
    """The placement group's bundles (the summed resources of the actors in each) and each
    bundle's node labels."""
    n = 1 + max((p.bundle for p in plan if p.bundle is not None), default=-1)
    bundles: list[dict[str, float]] = [{} for _ in range(n)]
    labels: list[dict[str, str]] = [{} for _ in range(n)]
    for p in plan:
        if p.bundle is not None:
            for k, v in p.resources.items():
                if v:
                    bundles[p.bundle][k] = bundles[p.bundle].get(k, 0.0) + v
            labels[p.bundle] = dict(p.labels)
    return bundles, labels


def reserve_placement(plan: list[Placement], strategy: str | None, name: str, timeout_s: float = 300.0) -> Any:
    """After ray.init: warn about actors no node offers a place to yet (they would wait), then,
    when a strategy is set, reserve the placement group before any actor starts and hand it to
    the placements (their ray_options() then schedule into it). Returns the group, or None."""
    import ray
    from ray.util import get_placement_group, placement_group, remove_placement_group

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    for p in {p.role: p for p in reversed(plan)}.values():  # the first actor of each role
        custom = {k: v for k, v in p.resources.items() if k not in ("CPU", "GPU") and v}
        if (custom or p.labels) and not any(
                all(n["Resources"].get(k, 0.0) >= v for k, v in custom.items())
                and all(n.get("Labels", {}).get(k) == v for k, v in p.labels.items()) for n in nodes):
            # a warning, not an error: an autoscaling cluster adds such a node when asked
            print(f"[mmrl] warning: no node of the Ray cluster offers {p.role}/{p.index} its resources {custom} "
                  f"and labels {p.labels} (cluster.role_resources / cluster.role_labels); it waits for one",
                  file=sys.stderr, flush=True)
    bundles, labels = placement_bundles(plan)
    if strategy is None or not bundles:  # no strategy, or no actor reserves anything
        return None
    try:  # this run's group from a start before a restart in this process: its actors are gone
        remove_placement_group(get_placement_group(name))
    except ValueError:
        pass
    group = placement_group(bundles, strategy=strategy, name=name, bundle_label_selector=labels)
    if not ray.wait([group.ready()], timeout=timeout_s)[0]:
        remove_placement_group(group)
        raise RuntimeError(f"cluster.placement_strategy={strategy}: the placement group's {len(bundles)} bundles "
                           f"{bundles} (node labels {labels}) found no room in the Ray cluster within {timeout_s:g} s "
                           f"(free now: {ray.available_resources()}). Add nodes, lower the per-actor resources, or "
                           f"use a looser strategy (PACK, SPREAD, or null for no placement group).")
    for p in plan:
        if p.bundle is not None:
            p.group = group
    return group


def format_plan(plan: list[Placement]) -> str:
    def fmt(res: dict[str, float]) -> str:
        return ", ".join(f"{k}={v:g}" for k, v in res.items())

    width = max([22] + [len(fmt(p.resources)) + 1 for p in plan])
    lines = [f"{'actor':<18} {'resources':<{width}} work"]
    for p in plan:
        res = fmt(p.resources)
        where = "".join([f"[bundle {p.bundle}] " if p.bundle is not None else "",
                         f"[labels {', '.join(f'{k}={v}' for k, v in p.labels.items())}] " if p.labels else ""])
        lines.append(f"{p.role + '/' + str(p.index):<18} {res:<{width}} {where}{p.work}")
    total = {}
    for p in plan:
        for k, v in p.resources.items():
            total[k] = total.get(k, 0.0) + v
    lines.append("total Ray resources requested: " + fmt(total))
    bundles, _ = placement_bundles(plan)
    if bundles:
        lines.append(f"placement group (cluster.placement_strategy): {len(bundles)} bundles, reserved before the actors "
                     f"start: " + "; ".join(f"{i}: {fmt(b)}" for i, b in enumerate(bundles)))
    return "\n".join(lines)
