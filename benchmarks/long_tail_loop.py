"""A long-tail rollout for benchmarks: each trajectory gets a token budget from a heavy-tailed
(Pareto, alpha = 1) distribution, 4 to 256 tokens, and generates exactly that many (EOS ignored).
A few responses are 30-60x longer than the median, as in reasoning or counting tasks, so a
synchronous step waits for its longest response while the engine idles on everything else.

    rollout: {agent_loop: benchmarks/long_tail_loop.py:long_tail, agent_loop_args: {min: 4, max: 256}}

The budget is a function of (sample key, group member), so every mode and run sees the same lengths.
"""
from __future__ import annotations

import hashlib
from dataclasses import replace

from mmrl.rollout.agent_loops import AgentContext, make_trajectory


def budget(key: str, member: int, low: int = 4, high: int = 256, alpha: float = 1.0) -> int:
    digest = hashlib.sha256(f"{key}/{member}".encode()).digest()
    u = (int.from_bytes(digest[:8], "big") + 1) / 2.0**64  # uniform in (0, 1]
    return int(min(high, max(low, low * u ** (-1.0 / alpha))))


async def long_tail(ctx: AgentContext, sample, prompt):
    tokens = budget(sample.key, ctx.group_index, ctx.args.get("min", 4), ctx.args.get("max", 256))
    completion = await ctx.client.generate(prompt.vllm_input, replace(ctx.sampling, max_tokens=tokens, ignore_eos=True))
    return make_trajectory([completion])
