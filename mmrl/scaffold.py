"""`mmrl new KIND NAME [--dir DIR]`: a working plugin file from a commented template, a test that
runs it against its kind's contract (`mmrl.testing`), and the config lines that use it.

Each template is a small plugin that does something real (so its test means something), meant
to be edited: the comments say what the contract asks and what can change freely.
"""
from __future__ import annotations

import keyword
from dataclasses import dataclass
from pathlib import Path

KINDS = ("reward", "agent_loop", "tool", "processor")


@dataclass
class Scaffold:
    plugin: Path
    test: Path
    usage: str


def camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_") if part)


def new_plugin(kind: str, name: str, directory: str | Path = ".", force: bool = False) -> Scaffold:
    """Write DIR/NAME.py and DIR/test_NAME.py for a plugin of `kind`; refuse to overwrite
    unless `force`. Returns the paths and the config lines that use the plugin."""
    if kind not in KINDS:
        raise ValueError(f"unknown plugin kind {kind!r}; `mmrl new` writes: {', '.join(KINDS)}")
    if not name.isidentifier() or keyword.iskeyword(name) or name != name.lower():
        raise ValueError(f"plugin name {name!r} must be a lower-case Python identifier (e.g. my_{kind})")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    plugin, test = out / f"{name}.py", out / f"test_{name}.py"
    existing = [str(p) for p in (plugin, test) if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(existing)} already exist(s); pick another name or pass --force")
    plugin_text, test_text, usage = _TEMPLATES[kind]
    fill = {"__NAME__": name, "__CLASS__": camel(name), "__ATTR__": _attr(kind, name),
            "__PLUGIN__": f"{_shown(plugin)}:{_attr(kind, name)}"}
    for key, value in fill.items():
        plugin_text, test_text, usage = (plugin_text.replace(key, value), test_text.replace(key, value),
                                         usage.replace(key, value))
    plugin.write_text(plugin_text.lstrip())
    test.write_text(test_text.lstrip())
    return Scaffold(plugin, test, usage.strip())


def _shown(path: Path) -> str:
    """The path as a config in the current directory would name it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path.resolve())


def _attr(kind: str, name: str) -> str:
    return camel(name) if kind in ("tool", "processor") else name


REWARD = '''
"""__NAME__: an mmrl reward. Scores one response; sees the sample's images and answer.

A reward is a plain function. It asks for what it needs by keyword, and gets only those:
  response, response_ids, answer, images, videos, prompt, messages, metadata, sample,
  transcript (multi-turn: every turn), tool_state (multi-turn: the tools' final state).
It returns a float, or a dict with "score" plus any numeric components, which are logged as
reward/__NAME__/<key>. Never raise on a bad response (score it low); a reward that raises
scores 0 for that response (reward_execution.on_error) and the run goes on.
"""
from __future__ import annotations

from typing import Any

from mmrl.registry import register


@register("reward", "__NAME__")
def __NAME__(response: str, answer: Any = None, images: list | None = None) -> dict[str, float]:
    # Example: the first word must be the answer; a small credit for answering in one word.
    words = response.strip().lower().split()
    first = words[0].strip(".,;:!?") if words else ""
    correct = float(answer is not None and first == str(answer).strip().lower())
    one_word = float(len(words) == 1)
    return {"score": correct + 0.1 * one_word, "correct": correct, "one_word": one_word,
            "images_seen": float(len(images or []))}
'''

REWARD_TEST = '''
"""The reward contract (mmrl.testing.check_reward) and what __NAME__ itself promises."""
from pathlib import Path

from mmrl.rewards import call_reward, reward_kwargs
from mmrl.registry import resolve
from mmrl.testing import check_reward, contract_samples

PLUGIN = f"{Path(__file__).with_name('__NAME__.py')}:__ATTR__"  # moves with the folder


def test___NAME___passes_the_reward_contract() -> None:
    check_reward(PLUGIN)


def test___NAME___scores_the_right_answer_above_a_wrong_one() -> None:
    sample = contract_samples(1)[0]
    fn = resolve("reward", PLUGIN)
    right = call_reward(fn, **reward_kwargs(sample, str(sample.answer)))
    wrong = call_reward(fn, **reward_kwargs(sample, "no idea"))
    assert right["score"] > wrong["score"] and right["images_seen"] == len(sample.images)
'''

REWARD_USAGE = '''
rewards:
  - {name: __PLUGIN__, weight: 1.0}
# try it on real samples first: mmrl rewards check __PLUGIN__ --shards SHARDS
'''

TOOL = '''
"""__NAME__: an mmrl tool, callable by the model in a multi-turn agent loop.

Built once per trajectory as __CLASS__(sample, **args), so it may keep state across the calls of
one trajectory. `call` returns text (or a ToolResult with images); a bad call raises ToolError
with a message the model can learn from. Anything else it raises, or a call slower than the
loop's tool_timeout_s, becomes a tool error too: a tool never stops a run. `state()` is what
rewards see at the end (tool_state); `close()` frees what the tool holds.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from mmrl.registry import register
from mmrl.tools.base import Tool, ToolError


@register("tool", "__NAME__")
class __CLASS__(Tool):
    # Example: the mean colour of a box of the sample's first image.
    name = "__NAME__"
    description = "Mean RGB colour of the region [x1, y1, x2, y2] (pixels) of the image."
    parameters = {"type": "object",
                  "properties": {"bbox": {"type": "array", "items": {"type": "number"}, "minItems": 4,
                                          "maxItems": 4, "description": "x1, y1, x2, y2 in pixels"}},
                  "required": ["bbox"]}

    def __init__(self, sample: Any = None, digits: int = 0):
        super().__init__(sample)
        self.digits = digits
        self.calls = 0

    def call(self, function: str, arguments: dict[str, Any]) -> str:
        if function != self.name:
            raise ToolError(f"unknown function {function!r}; this tool has {self.name!r}")
        images = getattr(self.sample, "images", None) or []
        if not images:
            raise ToolError("this sample has no image")
        box = arguments.get("bbox")
        if not isinstance(box, (list, tuple)) or len(box) != 4:
            raise ToolError("bbox must be four numbers [x1, y1, x2, y2]")
        pixels = np.asarray(images[0].convert("RGB"))
        x1, y1, x2, y2 = (int(round(float(v))) for v in box)
        region = pixels[max(0, y1):max(0, y2), max(0, x1):max(0, x2)]
        if region.size == 0:
            raise ToolError(f"the box {list(box)} is empty inside a {pixels.shape[1]}x{pixels.shape[0]} image")
        self.calls += 1
        mean = [round(float(c), self.digits) for c in region.reshape(-1, 3).mean(0)]
        return f"mean colour: {mean}"

    def state(self) -> dict[str, Any]:
        return {"calls": self.calls}
'''

TOOL_TEST = '''
"""The tool contract (mmrl.testing.check_tool) and what __NAME__ itself promises."""
import asyncio
from pathlib import Path

from mmrl.registry import resolve
from mmrl.testing import check_tool, contract_samples
from mmrl.tools.base import run_tool

PLUGIN = f"{Path(__file__).with_name('__NAME__.py')}:__ATTR__"  # moves with the folder


def test___NAME___passes_the_tool_contract() -> None:
    check_tool(PLUGIN)


def test___NAME___answers_a_good_call_and_refuses_a_bad_one() -> None:
    tool = resolve("tool", PLUGIN)(contract_samples(1)[0])
    good, _ = asyncio.run(run_tool(tool, "__NAME__", {"bbox": [0, 0, 8, 8]}, timeout_s=30))
    bad, _ = asyncio.run(run_tool(tool, "__NAME__", {"bbox": [5]}, timeout_s=30))
    assert not good.error and good.text.startswith("mean colour")
    assert bad.error and "bbox" in bad.text
    assert tool.state() == {"calls": 1}
'''

TOOL_USAGE = '''
rollout:
  agent_loop: multi_turn
  agent_loop_args:
    tools: [{name: __PLUGIN__, args: {digits: 0}}]
# parsers, max_turns, tool_choice: docs/agents.md
'''

AGENT_LOOP = '''
"""__NAME__: an mmrl agent loop. Runs ONE trajectory: `await __NAME__(ctx, sample, prompt)`.

ctx.client.generate(engine_input, sampling) samples one completion on the engine (token ids,
logprobs, finish reason); ctx.processor has the tokenizer; ctx.sampling is the run's sampling
(seeded: keep the seed scheme for reproducible trajectories); ctx.args is
rollout.agent_loop_args. Build the trajectory with make_trajectory: the model's completions
are trained on (loss mask 1), whatever the loop inserts between them is not (mask 0). Keep
the engine's token ids as they are: decoding and re-encoding text gives other tokens.
"""
from __future__ import annotations

from dataclasses import replace

from mmrl.registry import register
from mmrl.rollout.agent_loops import make_trajectory

DEFAULT_NUDGE = " Check the image again. Final answer:"


@register("agent_loop", "__NAME__")
async def __NAME__(ctx, sample, prompt):
    # Example: answer, read a nudge the loop appends, answer again (a second try on one image).
    first = await ctx.client.generate(prompt.vllm_input, ctx.sampling)
    nudge = str(ctx.args.get("nudge", DEFAULT_NUDGE))
    nudge_ids = ctx.processor.tokenizer.encode(nudge, add_special_tokens=False)
    second_input = dict(prompt.vllm_input)
    second_input["prompt_token_ids"] = list(prompt.vllm_input["prompt_token_ids"]) + first.token_ids + nudge_ids
    seed = None if ctx.sampling.seed is None else ctx.sampling.seed + 1
    second = await ctx.client.generate(second_input, replace(ctx.sampling, seed=seed))
    return make_trajectory([first, second], between=[(nudge_ids, nudge)])
'''

AGENT_LOOP_TEST = '''
"""The agent-loop contract (mmrl.testing.check_agent_loop) on a real vLLM engine, with a tiny
random VLM built locally (no download). Point MODEL at your own model folder to try yours."""
from pathlib import Path

import pytest

from mmrl.testing import check_agent_loop, local_engine

PLUGIN = f"{Path(__file__).with_name('__NAME__.py')}:__ATTR__"  # moves with the folder
MODEL = None  # a model folder; None = build a tiny random Qwen2.5-VL for the test


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    model = MODEL
    if model is None:
        from mmrl.models.tiny_vlm import build_tiny_vlm

        model = build_tiny_vlm("qwen2_5_vl", tmp_path_factory.mktemp("model") / "tiny", seed=0)
    with local_engine(model, tmp_path_factory.mktemp("run")) as eng:
        yield eng


def test___NAME___passes_the_agent_loop_contract(engine: dict) -> None:
    rollout = check_agent_loop(PLUGIN, engine, args={"nudge": " Again:"}, n=2)
    nudge = engine["processor"].tokenizer.encode(" Again:", add_special_tokens=False)
    for t in (t for group in rollout.groups for t in group):
        assert t.timings["requests"] == 2
        assert [tok for tok, m in zip(t.response_ids, t.loss_mask) if not m] == nudge  # not trained on
'''

AGENT_LOOP_USAGE = '''
rollout:
  agent_loop: __PLUGIN__
  agent_loop_args: {nudge: " Check the image again. Final answer:"}
'''

PROCESSOR = '''
"""__NAME__: an mmrl processor adapter. Turns one sample into the engine's input and the
trainer's input from ONE processor call, so both sides see the same tokens and pixels.

Built as __CLASS__(model_path, min_pixels=..., max_pixels=..., max_prompt_tokens=...,
trust_remote_code=...) from the processor.* config keys. A new model family implements the
whole contract (mmrl/processors/base.py); this example keeps the Qwen-VL adapter and changes
the prompt: every sample gets a system message.
"""
from __future__ import annotations

from dataclasses import replace

from mmrl.plugins.processors.qwen_vl import QwenVLProcessor
from mmrl.registry import register


@register("processor", "__NAME__")
class __CLASS__(QwenVLProcessor):
    # model_types is not inherited: name this adapter in processor.name. A new family lists its
    # config.json model_type values here, e.g. model_types = ("my_vlm",), and "auto" picks it.
    SYSTEM_PROMPT = "You are a careful visual assistant. Answer briefly."

    def __call__(self, sample):
        messages = list(sample.messages)
        if not messages or messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.SYSTEM_PROMPT}] + messages
        return super().__call__(replace(sample, messages=messages))
'''

PROCESSOR_TEST = '''
"""The processor contract (mmrl.testing.check_processor) on a tiny random Qwen2.5-VL built
locally (no download), and what __NAME__ itself promises."""
from pathlib import Path

import pytest

from mmrl.testing import check_processor, contract_samples

PLUGIN = f"{Path(__file__).with_name('__NAME__.py')}:__ATTR__"  # moves with the folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    from mmrl.models.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm("qwen2_5_vl", tmp_path_factory.mktemp("model") / "tiny", seed=0)


def test___NAME___passes_the_processor_contract(model_dir) -> None:
    check_processor(PLUGIN, model_dir)


def test___NAME___adds_the_system_prompt(model_dir) -> None:
    proc = check_processor(PLUGIN, model_dir)
    out = proc(contract_samples(1)[0])
    assert proc.SYSTEM_PROMPT in proc.decode(out.prompt_ids)
'''

PROCESSOR_USAGE = '''
processor:
  name: __PLUGIN__
'''

_TEMPLATES = {
    "reward": (REWARD, REWARD_TEST, REWARD_USAGE),
    "tool": (TOOL, TOOL_TEST, TOOL_USAGE),
    "agent_loop": (AGENT_LOOP, AGENT_LOOP_TEST, AGENT_LOOP_USAGE),
    "processor": (PROCESSOR, PROCESSOR_TEST, PROCESSOR_USAGE),
}
