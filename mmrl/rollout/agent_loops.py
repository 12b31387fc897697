"""Agent-loop plugins: how one sample becomes one trajectory.

The contract of an agent loop (kind "agent_loop"; tests/test_plugin_contracts.py checks it):

    @register("agent_loop", "my_loop")
    async def my_loop(ctx: AgentContext, sample: Sample, prompt: ProcessedPrompt) -> Trajectory

  * It is called once per trajectory: a group of `rollout.group_size` trajectories of a sample is
    `group_size` concurrent calls (`ctx.group_index` tells them apart). Loops run in rollout-worker
    actors (asyncio), many at once; the engines batch their requests continuously.
  * `prompt` is the processed sample (the processor ran in the rollout worker). `prompt.vllm_input`
    is what the engine takes; a multi-turn loop builds later prompts from it (or with
    `ctx.processor`) and calls `await ctx.client.generate(prompt_dict, sampling)` as often as it
    likes, with `ctx.sampling` (this trajectory's seed and token budget) or a `replace`d copy.
  * It returns a `Trajectory` whose `response_ids` are every token after the prompt; `loss_mask`
    is 1 on the tokens the policy sampled (0 on tool outputs and templates), and
    `behaviour_logprobs` / `token_versions` line up with `response_ids` (0 / -1 where the mask
    is 0). `make_trajectory` fills the rest (prompt index, oldest weight version, timings).
  * `ctx.args` is `rollout.agent_loop_args` from the config.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mmrl.data.sample import Sample
from mmrl.processors.base import ProcessedPrompt
from mmrl.registry import register
from mmrl.rollout.client import RolloutClient
from mmrl.rollout.types import Completion, RequestSampling, Trajectory, join_routing


@dataclass
class AgentContext:
    """What an agent loop gets besides its sample (see the module docstring)."""

    client: RolloutClient
    sampling: RequestSampling
    processor: Any
    group_index: int = 0
    args: dict[str, Any] = field(default_factory=dict)


def loop_args(cls: type, args: dict[str, Any] | None, loop: str) -> Any:
    """`rollout.agent_loop_args` as the dataclass `cls` of the loop named `loop`; an unknown key
    is refused with the known ones (a typo must not fall back to a default silently)."""
    args = dict(args or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"rollout.agent_loop_args: unknown key(s) {unknown} for the {loop} loop; known: {sorted(known)}")
    return cls(**args)


def make_trajectory(completions: list[Completion], between: list[tuple[list[int], str]] | None = None,
                    finish_reason: str | None = None, lead: tuple[list[int], str] | None = None) -> Trajectory:
    """A trajectory from the model's turns and, between turn k and k+1, `between[k]` = (token
    ids, text) that the loop inserted (tool output, template); those get loss mask 0, as does
    `lead`, what the loop wrote before the first model turn (a forced call's function name)."""
    ids: list[int] = list(lead[0]) if lead else []
    logprobs: list[float] = [0.0] * len(ids)
    mask: list[int] = [0] * len(ids)
    versions: list[int] = [-1] * len(ids)
    routing: list[tuple[Any, int]] = [(None, len(ids))]
    text = lead[1] if lead else ""
    between = between or []
    for k, c in enumerate(completions):
        ids += c.token_ids
        logprobs += c.logprobs
        mask += [1] * len(c.token_ids)
        versions += c.token_versions or [-1] * len(c.token_ids)
        routing.append((c.routed_experts, len(c.token_ids)))
        text += c.text
        if k < len(between):
            extra_ids, extra_text = between[k]
            routing.append((None, len(extra_ids)))
            ids += extra_ids
            logprobs += [0.0] * len(extra_ids)
            mask += [0] * len(extra_ids)
            versions += [-1] * len(extra_ids)
            text += extra_text
    sampled = [v for v, m in zip(versions, mask) if m and v >= 0]
    return Trajectory(prompt_index=-1, response_ids=ids, behaviour_logprobs=logprobs, loss_mask=mask, text=text,
                      finish_reason=finish_reason or (completions[-1].finish_reason if completions else None),
                      weight_version=min(sampled) if sampled else -1, token_versions=versions,
                      routed_experts=join_routing(routing))


class ScriptedClient:
    """A stand-in for the rollout client that writes given turns, one per model turn, and keeps
    the engine prompts and sampling settings it was sent: to drive an agent loop without an
    engine (an expert's episode for a probe or a test of a config's loop). A turn is a text
    (tokenised) or token ids, cut to the turn's `max_tokens` as an engine would stop; logprobs
    are -1."""

    def __init__(self, tokenizer: Any, turns: list[str | list[int]], finish_reason: str = "stop"):
        self.tokenizer, self.turns, self.finish_reason = tokenizer, list(turns), finish_reason
        self.prompts: list[dict[str, Any]] = []
        self.samplings: list[RequestSampling] = []

    async def generate(self, prompt: dict[str, Any], sampling: RequestSampling) -> Completion:
        self.prompts.append(prompt)
        self.samplings.append(sampling)
        turn = self.turns.pop(0)
        ids = (self.tokenizer(turn, add_special_tokens=False)["input_ids"] if isinstance(turn, str)
               else list(turn))[:sampling.max_tokens]
        return Completion(token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason=self.finish_reason,
                          text=self.tokenizer.decode(ids, skip_special_tokens=True))


@register("agent_loop", "single_turn")
async def single_turn(ctx: AgentContext, sample: Sample, prompt: ProcessedPrompt) -> Trajectory:
    """One generation: the response to the sample's prompt."""
    completion = await ctx.client.generate(prompt.vllm_input, ctx.sampling)
    return make_trajectory([completion])


# The built-in multi-turn loops register themselves ("multi_turn", "openai_agent", "answer_template");
# imported last, they build on the above.
from mmrl.rollout import openai_loop, template_loop, tool_loop  # noqa: E402,F401
