"""The `answer_template` agent loop: the loop writes an answer's fixed syntax, the model fills its holes.

    rollout:
      agent_loop: answer_template
      agent_loop_args:
        template: "[{}, {}, {}, {}]"   # literal text, with {} for each hole the model fills
        hole_tokens: 1                 # tokens the model samples per hole
        end_with_eos: true             # the loop closes the turn with the end-of-turn token

For an answer of many tokens of exact syntax that a fresh policy never samples as a whole (a box
`[x1, y1, x2, y2]` is 12 tokens with a digit-splitting tokenizer): the loop writes the literal
parts as environment tokens (loss mask 0, as the tool loop writes a forced function's name) and
asks the engine for each hole in turn, so the policy learns only the decisions. The trajectory is
one token sequence, literals and sampled tokens in order, and the trainer scores exactly those
tokens; the reward reads the whole text (`[1, 0, 2, 1]`).

Not constrained decoding: each hole is sampled from the policy's full distribution (no token is
masked), so behaviour and trainer logprobs stay comparable with no mask to replay. Each hole is its
own seeded request with its own seed (RequestSampling.for_call), so the holes' random draws are
independent, as one request's successive tokens are.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mmrl.data.sample import Sample
from mmrl.processors.base import ProcessedPrompt
from mmrl.registry import register
from mmrl.rollout.agent_loops import AgentContext, loop_args, make_trajectory
from mmrl.rollout.types import Completion, Trajectory


@dataclass
class TemplateArgs:
    template: str = "[{}, {}, {}, {}]"
    hole_tokens: int = 1
    end_with_eos: bool = True

    @classmethod
    def from_dict(cls, args: dict[str, Any] | None) -> "TemplateArgs":
        out = loop_args(cls, args, "answer_template")
        if not isinstance(out.template, str) or "{}" not in out.template:
            raise ValueError("rollout.agent_loop_args.template must be a string with at least one {} hole, e.g. "
                             f"'[{{}}, {{}}, {{}}, {{}}]', got {out.template!r}")
        if isinstance(out.hole_tokens, bool) or not isinstance(out.hole_tokens, int) or out.hole_tokens < 1:
            raise ValueError(f"rollout.agent_loop_args.hole_tokens must be a positive integer, got {out.hole_tokens!r}")
        return out

    def literals(self) -> list[str]:
        """The text before the first hole, between holes, and after the last one."""
        return self.template.split("{}")


@register("agent_loop", "answer_template")
async def answer_template(ctx: AgentContext, sample: Sample, prompt: ProcessedPrompt) -> Trajectory:
    """The template's literals as environment tokens, each hole sampled by the model (module docstring)."""
    args = TemplateArgs.from_dict(ctx.args)
    tokenizer = ctx.processor.tokenizer
    literals = args.literals()
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] if t else [] for t in literals]
    if args.end_with_eos:  # in the tokens, not the text (engine texts skip special tokens too)
        encoded[-1] = encoded[-1] + [ctx.processor.eos_token_id]
    texts = literals[1:]
    lead = (encoded[0], literals[0])
    prompt_ids = list(prompt.vllm_input["prompt_token_ids"])
    media = prompt.vllm_input.get("multi_modal_data")
    response = list(lead[0])
    completions: list[Completion] = []
    between: list[tuple[list[int], str]] = []
    for hole, (ids, text) in enumerate(zip(encoded[1:], texts)):
        engine_prompt: dict[str, Any] = {"prompt_token_ids": prompt_ids + response}
        if media:
            engine_prompt["multi_modal_data"] = media
        sampling = dataclasses.replace(ctx.sampling.for_call(hole), max_tokens=args.hole_tokens)
        c = await ctx.client.generate(engine_prompt, sampling)
        completions.append(c)
        between.append((list(ids), text))
        response += c.token_ids + list(ids)
    trajectory = make_trajectory(completions, between, finish_reason="stop", lead=lead)
    trajectory.stats = {"holes": float(len(completions)),
                        "hole_tokens": float(sum(len(c.token_ids) for c in completions))}
    return trajectory
