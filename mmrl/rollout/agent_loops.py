"""Agent-loop plugins: how prompts become trajectories.

The contract of an agent loop (kind "agent_loop"; tests/test_plugin_contracts.py checks it):

    @register("agent_loop", "my_loop")
    def my_loop(ctx: RolloutContext, prompts: Sequence[ProcessedPrompt]) -> list[list[Trajectory]]

  * It returns one group (list of trajectories) per prompt, in prompt order, with
    `Trajectory.prompt_index` = the prompt's position in `prompts`.
  * `ctx` carries the engine handles (Ray actors of RolloutEngine), the sampling settings, the
    current weight version and `chunks_per_engine` (how finely to split the work per engine).
  * As soon as a group is final, the loop should report it: `ctx.report(indices, groups)`.
    The controller submits reported groups to the reward workers at once, so scoring overlaps
    the rest of the rollout. Report each group at most once, and only in its final form (the
    groups returned must hold the same responses). A group that is never reported is scored
    after the loop returns, so a loop that never reports is correct, only slower.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import ray

from mmrl.processors.base import ProcessedPrompt
from mmrl.registry import register
from mmrl.rollout.types import Completion, SamplingConfig, Trajectory
from mmrl.utils import split_even

# on_groups(prompt indices, their final groups)
GroupsCallback = Callable[[list[int], list[list[Trajectory]]], None]


@dataclass
class RolloutContext:
    engines: Sequence[Any]  # Ray actor handles of RolloutEngine
    sampling: SamplingConfig
    weight_version: int
    # Called with finished groups while the rollout goes on (reward scoring); None: nobody listens.
    on_groups: GroupsCallback | None = None
    # Generate calls per engine per rollout: more, smaller calls let scoring start earlier.
    chunks_per_engine: int = 1

    def report(self, indices: Sequence[int], groups: Sequence[list[Trajectory]]) -> None:
        """Hand final groups to whoever listens (see the module docstring)."""
        if self.on_groups is not None and len(indices):
            self.on_groups(list(indices), list(groups))


def _trajectories(index: int, completions: list[Completion], ctx: RolloutContext,
                  seconds: float, engine: int = 0) -> list[Trajectory]:
    return [Trajectory(prompt_index=index, response_ids=c.token_ids, behaviour_logprobs=c.logprobs,
                       loss_mask=[1] * len(c.token_ids), text=c.text, finish_reason=c.finish_reason,
                       weight_version=ctx.weight_version, timings={"generate_s": seconds, "engine": engine})
            for c in completions]


@register("agent_loop", "single_turn")
def single_turn(ctx: RolloutContext, prompts: Sequence[ProcessedPrompt]) -> list[list[Trajectory]]:
    """One generation per prompt: `sampling.n` responses each. The prompts are cut into
    `chunks_per_engine` generate calls per engine, all queued at once (an engine actor runs its
    calls back to back, so it never waits for the driver); each chunk's groups are reported
    as soon as it returns."""
    t0 = time.time()
    n_engines = len(ctx.engines)
    chunks = [c for c in split_even(list(range(len(prompts))), n_engines * max(1, ctx.chunks_per_engine)) if c]
    # Chunk k goes to engine k % n_engines: every engine starts on its first chunk at once.
    pending = {ctx.engines[k % n_engines].generate.remote([prompts[i].vllm_input for i in chunk],
                                                          ctx.sampling.for_requests_from(chunk[0])): (k % n_engines, chunk)
               for k, chunk in enumerate(chunks)}
    groups: list[list[Trajectory] | None] = [None] * len(prompts)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        for future in ready:
            engine, chunk = pending.pop(future)
            seconds = time.time() - t0
            done = [_trajectories(i, completions, ctx, seconds, engine)
                    for i, completions in zip(chunk, ray.get(future))]
            for i, group in zip(chunk, done):
                groups[i] = group
            ctx.report(chunk, done)
    return [g for g in groups if g is not None]
