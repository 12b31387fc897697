"""The multi-turn tool loop (agent loop "multi_turn"): generate, run the tool calls, show the
results as a tool turn, generate again, until an answer, `max_turns`, or the token budget.

Token fidelity is by construction: the trajectory is ONE token sequence that only ever grows.
Each model turn appends the engine's own token ids (loss mask 1, with their logprobs and weight
versions); each tool turn appends the token ids of its rendered text (loss mask 0). Nothing is
decoded and re-encoded, so what the trainer sees is exactly what the engine produced, however
the tokenizer would merge the text today. A tool turn's text comes from the model's own chat
template (`render_after_turn`), and images a tool returns go into the next engine prompt as
`multi_modal_data` with one vision pad each, like the prompt's own images; the rollout worker
expands them for the trainer afterwards (workers.py, `trainer_view`).

`rollout.agent_loop_args` (all optional but `tools`):
    tools: [{name: image_zoom, args: {...}}, ...]   tool plugins (kind "tool"), built per trajectory
    parser: hermes            tool-call parser (kind "tool_parser": hermes, compact, bare, or your own)
    max_turns: 4              model turns at most
    max_total_tokens: 1024    tokens after the prompt at most (model + tool turns)
    tool_timeout_s: 30        a slower call is answered with a tool error
    max_calls_per_turn: 4     calls beyond this in one turn are answered with an error
    tool_role: tool           the chat role of tool turns ("user" for templates without "tool")
    thumbnail_px: 96          tool images enter the transcript as PNG thumbnails this big (0 = none),
                              so logs and rollouts.html show the crops and screenshots the model saw
    tool_choice: auto         or a function name: a forced call (OpenAI's tool_choice={"function":
                              ...}). The model turn starts with the name, written by the loop as
                              environment tokens (loss mask 0); the model writes the arguments.
                              With the `bare` parser that is what lets a tiny random policy find
                              a valid call by sampling (one token to guess, not two)
                              A list names one per model turn ([open, click]: turn 1 calls open,
                              turn 2 click; "auto" or turns past the list: not forced), so each
                              step of an environment task gets its own verb
    tool_choice_turns: null   how many first model turns a single tool_choice forces (null: every turn)
    last_turn_calls: drop     what happens to calls in the turn that reaches max_turns: "drop" (a
                              question-answering loop: nothing would read the result) or "run"
                              (an environment: the action takes effect, and its state is what
                              the reward reads; the result enters the transcript, not the tokens)
    max_tool_errors: null     end the episode (finish reason "tool_error") once this many calls
                              were refused; the refusals stay in the transcript. An environment
                              with few turns needs it: otherwise a refused first action is free,
                              and the policy can learn to spend turn 1 on junk and act from turn 2
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mmrl import registry
from mmrl.data.sample import Sample
from mmrl.processors.base import ProcessedPrompt
from mmrl.registry import register
from mmrl.rollout.agent_loops import AgentContext, loop_args, make_trajectory
from mmrl.rollout.types import Completion, Trajectory
from mmrl.tools.base import ToolResult, run_tool
from mmrl.utils.thumbnails import thumbnail


@dataclass
class ToolLoopArgs:
    tools: list[dict[str, Any]] = field(default_factory=list)
    parser: str = "hermes"
    max_turns: int = 4
    max_total_tokens: int = 1024
    tool_timeout_s: float | None = 30.0
    max_calls_per_turn: int = 4
    tool_role: str = "tool"
    thumbnail_px: int = 96
    tool_choice: str | list[str] = "auto"
    tool_choice_turns: int | None = None
    last_turn_calls: str = "drop"
    max_tool_errors: int | None = None

    def forced_function(self, turn: int) -> str | None:
        """The function model turn `turn` (0-based) must call, or None."""
        if isinstance(self.tool_choice, list):
            choice = self.tool_choice[turn] if turn < len(self.tool_choice) else "auto"
            return None if choice == "auto" else choice
        if self.tool_choice == "auto" or (self.tool_choice_turns is not None and turn >= self.tool_choice_turns):
            return None
        return self.tool_choice

    def forced_names(self) -> set[str]:
        """Every function some turn is forced to call."""
        names = self.tool_choice if isinstance(self.tool_choice, list) else [self.tool_choice]
        return {n for n in names if n != "auto"}

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> "ToolLoopArgs":
        out = loop_args(cls, args, "multi_turn")
        if out.max_turns < 1 or out.max_total_tokens < 1:
            raise ValueError("rollout.agent_loop_args: max_turns and max_total_tokens must be >= 1")
        for i, spec in enumerate(out.tools):
            if not isinstance(spec, dict) or "name" not in spec or set(spec) - {"name", "args"}:
                raise ValueError(f"rollout.agent_loop_args.tools[{i}] must be {{name: ..., args: {{...}}}}, got {spec!r}")
        if isinstance(out.tool_choice, (list, tuple)):
            out.tool_choice = list(out.tool_choice)  # a tuple: a plain list
            if not out.tool_choice or not all(isinstance(n, str) and n.strip() for n in out.tool_choice):
                raise ValueError("rollout.agent_loop_args.tool_choice as a list names a function (or 'auto') per "
                                 f"model turn, got {out.tool_choice!r}")
            if out.tool_choice_turns is not None:
                raise ValueError("rollout.agent_loop_args.tool_choice_turns goes with a single tool_choice; a list "
                                 "already says which turns are forced (use 'auto' for a free turn)")
        elif not isinstance(out.tool_choice, str) or not out.tool_choice.strip():
            raise ValueError("rollout.agent_loop_args.tool_choice must be 'auto', a function name or a list of them "
                             f"(one per model turn), got {out.tool_choice!r}")
        if out.last_turn_calls not in ("drop", "run"):
            raise ValueError(f"rollout.agent_loop_args.last_turn_calls must be 'drop' or 'run', got {out.last_turn_calls!r}")
        if out.tool_choice_turns is not None and (isinstance(out.tool_choice_turns, bool)
                                                  or not isinstance(out.tool_choice_turns, int)
                                                  or out.tool_choice_turns < 0):
            raise ValueError("rollout.agent_loop_args.tool_choice_turns must be a non-negative integer or null, "
                             f"got {out.tool_choice_turns!r}")
        if out.max_tool_errors is not None and (isinstance(out.max_tool_errors, bool)
                                                or not isinstance(out.max_tool_errors, int) or out.max_tool_errors < 1):
            raise ValueError("rollout.agent_loop_args.max_tool_errors must be a positive integer or null, "
                             f"got {out.max_tool_errors!r}")
        return out


def build_tools(specs: list[dict[str, Any]], sample: Sample) -> list[Any]:
    """One instance of each configured tool for this trajectory."""
    return [registry.resolve("tool", spec["name"])(sample, **dict(spec.get("args") or {})) for spec in specs]


def render_after_turn(processor: Any, messages: list[dict[str, Any]]) -> str:
    """The text that follows a model turn's end-of-turn token to show `messages` (tool or user
    turns, images as {"type": "image"} parts) and open the next assistant turn, taken from the
    model's own chat template as the difference of two renderings."""
    hf = getattr(processor, "hf", None) or processor.tokenizer
    eos = processor.tokenizer.decode([processor.eos_token_id])
    base = [{"role": "user", "content": [{"type": "text", "text": "q"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a"}]}]
    before = hf.apply_chat_template(base, tokenize=False)
    after = hf.apply_chat_template(base + messages, tokenize=False, add_generation_prompt=True)
    if not after.startswith(before) or eos not in before:
        raise ValueError("the chat template does not render a conversation as a prefix of its continuation; "
                         "tool turns cannot be appended token-exactly with this template")
    return before[before.rindex(eos) + len(eos):] + after[len(before):]


def _tool_message(role: str, result: ToolResult) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "image"} for _ in result.images]
    content.append({"type": "text", "text": result.text})
    return {"role": role, "content": content}


@register("agent_loop", "multi_turn")
async def multi_turn(ctx: AgentContext, sample: Sample, prompt: ProcessedPrompt) -> Trajectory:
    """Model turns and tool turns in one token sequence (see the module docstring)."""
    args = ToolLoopArgs.from_dict(ctx.args)
    parser = registry.resolve("tool_parser", args.parser)
    tools = build_tools(args.tools, sample)
    owner = {name: tool for tool in tools for name in (f["function"]["name"] for f in tool.functions())}
    functions = [f for tool in tools for f in tool.functions()]
    unknown = sorted(args.forced_names() - set(owner))
    if unknown:
        raise ValueError(f"rollout.agent_loop_args.tool_choice names {', '.join(map(repr, unknown))}, not a function "
                         f"of the configured tools ({sorted(owner) or 'none'}); name one of them, or set "
                         f"tool_choice=auto (as you must when the tools are disabled with tools=[])")
    tokenizer, eos = ctx.processor.tokenizer, ctx.processor.eos_token_id
    choice_ids = {name: tokenizer(name, add_special_tokens=False)["input_ids"] for name in args.forced_names()}
    prompt_ids = list(prompt.vllm_input["prompt_token_ids"])
    media = {k: list(v) if isinstance(v, (list, tuple)) else [v]
             for k, v in (prompt.vllm_input.get("multi_modal_data") or {}).items()}
    new_images: list[Any] = []
    completions: list[Completion] = []
    between: list[tuple[list[int], str]] = []
    lead: tuple[list[int], str] = ([], "")  # environment tokens before the first model turn
    transcript: list[dict[str, Any]] = []
    stats = {"turns": 0.0, "tool_calls": 0.0, "tool_errors": 0.0, "tool_seconds": 0.0, "tool_images": 0.0}
    response: list[int] = []
    finish: str | None = None
    try:
        for turn in range(args.max_turns):
            forced = args.forced_function(turn)
            forced_ids = choice_ids[forced] if forced else []
            budget = min(ctx.sampling.max_tokens, args.max_total_tokens - len(response) - len(forced_ids))
            if budget < 1:
                finish = "length"
                break
            if forced:  # the loop writes the name; it is context, not the model's (mask 0)
                if turn == 0:
                    lead = (forced_ids, forced)
                else:
                    between[-1] = (between[-1][0] + forced_ids, between[-1][1] + forced)
                response += forced_ids
            engine_prompt: dict[str, Any] = {"prompt_token_ids": prompt_ids + response}
            if media:
                engine_prompt["multi_modal_data"] = media
            # each turn its own seed: turns sharing one would draw the same numbers (for_call)
            c = await ctx.client.generate(engine_prompt, dataclasses.replace(ctx.sampling.for_call(turn),
                                                                             max_tokens=budget))
            completions.append(c)
            response += c.token_ids
            stats["turns"] += 1
            # the parser reads the turn as the model wrote it (special tokens kept), forced name first
            text = (forced or "") + tokenizer.decode(c.token_ids, skip_special_tokens=False)
            calls = parser(text, functions)
            transcript.append({"role": "assistant", "content": (forced or "") + c.text,
                               "tool_calls": [{"name": k.name, "arguments": k.arguments} for k in calls]})
            finish = c.finish_reason
            # a turn cut by its token limit still counts its complete calls
            last = turn == args.max_turns - 1
            if not calls or (last and args.last_turn_calls == "drop"):
                break
            results: list[ToolResult] = []
            for i, call in enumerate(calls):
                if call.error is not None or i >= args.max_calls_per_turn:
                    why = call.error or f"at most {args.max_calls_per_turn} tool calls per turn"
                    result, seconds = ToolResult(text=f"error: {why}", error=True), 0.0
                else:
                    result, seconds = await run_tool(owner[call.name], call.name, call.arguments, args.tool_timeout_s)
                stats["tool_calls"] += 1
                stats["tool_errors"] += float(result.error)
                stats["tool_seconds"] += seconds
                results.append(result)
                transcript.append({"role": "tool", "name": call.name, "content": result.text,
                                   "images": len(result.images), "error": result.error,
                                   "thumbnails": [thumbnail(i, args.thumbnail_px) for i in result.images]
                                   if args.thumbnail_px > 0 else []})
            if any(r.done for r in results):
                finish = "done"
                break
            if args.max_tool_errors is not None and stats["tool_errors"] >= args.max_tool_errors:
                finish = "tool_error"
                break
            if last:  # the calls took effect; no model turn follows to read their results
                break
            text_after = render_after_turn(ctx.processor, [_tool_message(args.tool_role, r) for r in results])
            # a turn that ended on a stop string instead of end-of-turn gets its end-of-turn token
            closing = [] if c.token_ids and c.token_ids[-1] == eos else [eos]
            env_ids = closing + tokenizer(text_after, add_special_tokens=False)["input_ids"]
            if len(response) + len(env_ids) >= args.max_total_tokens:
                finish = "length"
                break
            between.append((env_ids, tokenizer.decode(closing) + text_after))
            response += env_ids
            images = [img for r in results for img in r.images]
            if images:
                media.setdefault("image", []).extend(images)
                new_images += images
                stats["tool_images"] += len(images)
    finally:
        tool_state = {}
        for tool in tools:
            try:
                tool_state.update(tool.state())
            finally:
                tool.close()
    trajectory = make_trajectory(completions, between, finish_reason=finish, lead=lead)
    trajectory.transcript, trajectory.tool_state, trajectory.stats = transcript, tool_state, stats
    if new_images:
        trajectory.new_media = {"image": new_images}
    return trajectory
