"""Agent-loop plugins: how prompts become trajectories.

An agent loop is called as `loop(ctx, prompts)` and returns one list of trajectories per prompt.
`ctx` carries the engine handles, the sampling settings and the current weight version.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import ray

from mmrl.processors.base import ProcessedPrompt
from mmrl.registry import register
from mmrl.rollout.types import SamplingConfig, Trajectory


@dataclass
class RolloutContext:
    engines: Sequence[Any]  # Ray actor handles of RolloutEngine
    sampling: SamplingConfig
    weight_version: int


def _split(n_items: int, n_parts: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal slices: one per engine."""
    base, extra = divmod(n_items, n_parts)
    bounds, start = [], 0
    for i in range(n_parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


@register("agent_loop", "single_turn")
def single_turn(ctx: RolloutContext, prompts: Sequence[ProcessedPrompt]) -> list[list[Trajectory]]:
    """One generation per prompt: `sampling.n` responses each, prompts spread over the engines."""
    t0 = time.time()
    slices = [(a, b) for a, b in _split(len(prompts), len(ctx.engines)) if b > a]
    futures = [engine.generate.remote([p.vllm_input for p in prompts[a:b]], ctx.sampling)
               for engine, (a, b) in zip(ctx.engines, slices)]
    groups = [g for chunk in ray.get(futures) for g in chunk]
    seconds = time.time() - t0
    out: list[list[Trajectory]] = []
    for i, completions in enumerate(groups):
        out.append([Trajectory(prompt_index=i, response_ids=c.token_ids, behaviour_logprobs=c.logprobs,
                               loss_mask=[1] * len(c.token_ids), text=c.text, finish_reason=c.finish_reason,
                               weight_version=ctx.weight_version, timings={"generate_s": seconds})
                    for c in completions])
    return out
