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
from mmrl.utils import split_even


@dataclass
class RolloutContext:
    engines: Sequence[Any]  # Ray actor handles of RolloutEngine
    sampling: SamplingConfig
    weight_version: int



@register("agent_loop", "single_turn")
def single_turn(ctx: RolloutContext, prompts: Sequence[ProcessedPrompt]) -> list[list[Trajectory]]:
    """One generation per prompt: `sampling.n` responses each, prompts spread over the engines."""
    t0 = time.time()
    chunks = split_even(prompts, len(ctx.engines))
    futures = [engine.generate.remote([p.vllm_input for p in chunk], ctx.sampling)
               for engine, chunk in zip(ctx.engines, chunks) if chunk]
    groups = [g for chunk in ray.get(futures) for g in chunk]
    seconds = time.time() - t0
    out: list[list[Trajectory]] = []
    for i, completions in enumerate(groups):
        out.append([Trajectory(prompt_index=i, response_ids=c.token_ids, behaviour_logprobs=c.logprobs,
                               loss_mask=[1] * len(c.token_ids), text=c.text, finish_reason=c.finish_reason,
                               weight_version=ctx.weight_version, timings={"generate_s": seconds})
                    for c in completions])
    return out
