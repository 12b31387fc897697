"""Colocated mode (`cluster.colocate: true`): engine i shares trainer rank i's GPU.

Placement puts both in one bundle (controller/placement.py); here are the engine arguments and
the step's order. vLLM's sleep mode (CUDA only) frees the engine's GPU memory while the ranks
train: level 1 moves the weights to host memory and drops the KV cache. The step is

  rollout -> sleep(1) -> update -> wake_up(["weights"]) -> weight sync -> wake_up(["kv_cache"]) -> next rollout

The weights wake first because the sync loads the new weights into them in place (vLLM's
layerwise reload copies into the existing tensors); the KV cache wakes only after the sync, so
the sync's buffers (a staged model with the object store) never sit beside a full KV cache.
After the first wake the engine is not fully awake and vLLM keeps its scheduler paused, but the
sync's own pause/resume (RolloutEngine.apply_weights / finish_weight_update) resumes it before
the KV cache is back: harmless in sync mode, where no request is sent until the step has woken
the KV cache (the config refuses colocation with rollout.mode=async).

Metrics: time/engine_sleep_s, time/engine_wake_s (both wakes), as step spans.
"""
from __future__ import annotations

from typing import Any

import ray

from mmrl.config.load import ConfigError
from mmrl.config.schema import Config
from mmrl.controller.placement import colocated
from mmrl.utils.timing import StepSpans

SLEEP_LEVEL = 1  # weights to host memory, KV cache freed (level 2 would drop the weights too)
WEIGHTS = ["weights"]
KV_CACHE = ["kv_cache"]
# Offloading a 7B model's 15 GiB to pinned host memory takes seconds; a bound that names the wait.
SLEEP_WAKE_TIMEOUT_S = 600.0


def default_gpu_memory_utilization(cfg: Config, device: str) -> float:
    """The memory plan's share for a colocated engine: what its trainer rank's hold leaves
    (memory_plan.colocated_gpu_memory_utilization). Needs the GPU's memory."""
    from mmrl.controller.memory_plan import (GIB, MemoryPlanError, colocated_gpu_memory_utilization,
                                             device_memory_gib, read_model_shape, trainer_load)

    memory_gib = device_memory_gib(cfg, device)
    if memory_gib is None:
        raise ConfigError("Config key 'cluster.colocate' is true and rollout.engine_args.gpu_memory_utilization is "
                          "unset, but this machine cannot tell the GPUs' memory (no GPU on the driver): set "
                          "cluster.gpu_memory_gb, or rollout.engine_args.gpu_memory_utilization.")
    lora = cfg.trainer.lora
    try:
        shape = read_model_shape(cfg.model.path, cfg.model.trust_remote_code,
                                 list(lora.target_modules) if lora.enabled else None, lora.rank)
    except (OSError, ValueError) as e:  # e.g. a hub id offline: no config.json to plan from
        raise ConfigError(f"Config key 'cluster.colocate': cannot read {cfg.model.path!r}'s config to derive the "
                          f"engines' gpu_memory_utilization ({type(e).__name__}: {e}); set "
                          f"rollout.engine_args.gpu_memory_utilization.") from None
    trainer = trainer_load(cfg, shape, device)
    util = colocated_gpu_memory_utilization(trainer, memory_gib * GIB)
    if util <= 0:
        raise MemoryPlanError(f"cluster.colocate: a trainer rank holds {trainer.total / GIB:.1f} GiB of the GPU's "
                              f"{memory_gib:g} GiB, which leaves an engine nothing. Shrink the rank (see "
                              f"`mmrl train CONFIG --dry-run`) or set cluster.colocate=false.")
    return util


def colocated_engine_args(cfg: Config, device: str, llm_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Sleep mode on, and a gpu_memory_utilization that leaves the trainer rank its memory
    (rollout.engine_args' value when given; null or unset: the memory plan's)."""
    llm_kwargs["enable_sleep_mode"] = True
    if llm_kwargs.get("gpu_memory_utilization") is None:
        llm_kwargs["gpu_memory_utilization"] = default_gpu_memory_utilization(cfg, device)
    return llm_kwargs


class EngineColocation:
    """Puts a run's engines to sleep and wakes them (Runtime.engines at each call: a replaced
    engine is the one called)."""

    def __init__(self, rt: Any):
        self.rt = rt

    def _all(self, method: str, *args: Any) -> list[Any]:
        """`method` on every engine; None for an engine that died (the weight sync and the rollout
        replace dead engines: Runtime.push_weights, RolloutWorkers)."""
        refs = [getattr(e, method).remote(*args) for e in self.rt.engines]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=SLEEP_WAKE_TIMEOUT_S)
        if pending:
            raise RuntimeError(f"cluster.colocate: {len(pending)} engine(s) did not return from {method}{args} within "
                               f"{SLEEP_WAKE_TIMEOUT_S:g} s")
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError:
                out.append(None)
        return out

    def sleep(self, spans: StepSpans) -> None:
        """Before the update: free the engines' GPU memory for the ranks."""
        with spans("engine_sleep"):
            self._all("sleep", SLEEP_LEVEL)

    def wake_weights(self, spans: StepSpans) -> None:
        """Before the weight sync: the weights back on the GPU (the sync loads into them)."""
        with spans("engine_wake"):
            self._all("wake_up", WEIGHTS)

    def wake_kv_cache(self, spans: StepSpans) -> None:
        """After the sync: the KV cache back; every engine must be fully awake for the rollout."""
        with spans("engine_wake"):
            awake = self._all("wake_up", KV_CACHE)
        asleep = [i for i, a in enumerate(awake) if a is False]
        if asleep:
            raise RuntimeError(f"cluster.colocate: engine(s) {asleep} still partly asleep after waking the weights "
                               f"and the KV cache; their scheduler would stay paused")


def engine_colocation(rt: Any) -> EngineColocation | None:
    """The run's sleep/wake driver in colocated mode, else None."""
    return EngineColocation(rt) if colocated(rt.cfg, rt.device) else None
