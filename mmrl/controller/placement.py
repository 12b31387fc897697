"""Which process does what, and with which resources. Printed by `mmrl train --dry-run`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmrl.config.schema import Config


@dataclass
class Placement:
    role: str
    index: int
    resources: dict[str, float]
    work: str

    def ray_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.resources.get("CPU", 0.0)}
        if self.resources.get("GPU"):
            opts["num_gpus"] = self.resources["GPU"]
        return opts


def placement_plan(cfg: Config, device: str) -> list[Placement]:
    gpu = device == "cuda"
    tp = int(cfg.rollout.engine_args.get("tensor_parallel_size", 1))
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
            res["GPU"] = float(tp)
        plan.append(Placement("rollout", i, res,
                              f"vLLM AsyncLLM engine ({'GPU x%d' % tp if gpu else 'CPU'}), "
                              f"~{-(-cfg.rollout.prompts_per_step // cfg.rollout.num_engines)} prompts/step "
                              f"x n={cfg.rollout.group_size}"))
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
            res["GPU"] = 1.0
        plan.append(Placement("trainer", r, res,
                              f"DeepSpeed ZeRO-3 rank {r}/{cfg.trainer.world_size} "
                              f"({'nccl' if gpu else 'gloo'}), ~"
                              f"{cfg.rollout.prompts_per_step * cfg.rollout.group_size // cfg.trainer.world_size} "
                              f"sequences/step" + (", sends weight buckets to the engines" if r == 0 and cfg.rollout.backend.value == "vllm" else "")))
    return plan


def format_plan(plan: list[Placement]) -> str:
    lines = [f"{'actor':<18} {'resources':<22} work"]
    for p in plan:
        res = ", ".join(f"{k}={v:g}" for k, v in p.resources.items())
        lines.append(f"{p.role + '/' + str(p.index):<18} {res:<22} {p.work}")
    total = {}
    for p in plan:
        for k, v in p.resources.items():
            total[k] = total.get(k, 0.0) + v
    lines.append("total Ray resources requested: " + ", ".join(f"{k}={v:g}" for k, v in total.items()))
    return "\n".join(lines)
