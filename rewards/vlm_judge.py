"""A generative VLM judge: a vision-language model reads a rubric, the image(s), the question,
the reference answer and the response, and writes a score that is parsed from its text.

    rewards:
      - {name: vlm_judge, weight: 1.0, args: {model: Qwen/Qwen2.5-VL-7B-Instruct, max_score: 10}}

Batched: all responses of a group go to the engine in one `generate` call. The score is parsed
robustly (`parse_score`): `{"score": 7}`, "Score: 7/10", "**Rating:** 8 out of 10", "7/10", a
leading "7"; anything else scores 0 and counts in the `parse_failure` component.

Where the judge runs: a `vllm.LLM` loaded lazily *inside the reward worker process*, in-process
(no engine-core subprocess on CPU), rather than a separate RolloutEngine Ray actor. On a 2-core
CPU box this is the robust choice: (1) the pool kills and replaces reward workers after a
timeout or a crash; an in-process engine dies with its worker and leaves nothing behind, while
a Ray actor owned by the worker would be killed with it without a clean shutdown and leave vLLM's
shared-memory buffers in /dev/shm (and an engine actor that outlives its workers needs an owner
to stop it); (2) it claims no Ray CPUs, which the rollout engines and trainer ranks already hold
(an extra actor asking for a CPU would stay pending); (3) an in-process engine starts in
seconds, not the ~25 s of a spawned engine core. The engine is built by the worker's setup hook,
outside the per-call timeout. On a GPU cluster the reward worker then needs a GPU of its own.
"""
from __future__ import annotations

import functools
import json
import os
import re
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from mmrl.plugins.rewards._text import as_text, head, tail
from mmrl.rewards.variants import reward

__all__ = ["vlm_judge", "parse_score", "load_judge", "DEFAULT_RUBRIC"]

DEFAULT_RUBRIC = (
    "You are grading a response to a question about the image.\n"
    "Question: {question}\n"
    "Reference answer: {answer}\n"
    "Response: {response}\n"
    "How correct and helpful is the response? Reply with one line: Score: N, where N is an "
    "integer from 0 to {max_score}."
)

_NUM = r"[-+]?\d+(?:\.\d+)?"
_LABELLED = re.compile(
    rf"(?:score|rating|grade)\s*(?:\*\*)?\s*(?:[:=]|is)\s*(?:\*\*)?\s*({_NUM})"
    rf"(?:\s*(?:/|out\s+of)\s*({_NUM}))?", re.I)
_FRACTION = re.compile(rf"(?<![\w.])({_NUM})\s*(?:/|out\s+of)\s*({_NUM})(?!\w|\.\d)", re.I)
# a bare leading number ("7", "7.", "**7**"), not a list item ("1. The response ...")
_LEADING = re.compile(rf"^\W{{0,4}}({_NUM})(?!\w|\.(?!\s*$))(?:\s*(?:/|out\s+of)\s*({_NUM}))?")
_JSON_OBJECT = re.compile(r"\{[^{}]{0,500}\}")
_FIELD = re.compile(r"\{(question|answer|response|max_score)\}")
_WINDOW = 4000  # judges write a line or a paragraph; a runaway output is read at its end


def _scaled(value: float, denominator: float | None, max_score: float) -> float | None:
    if denominator is not None:
        if denominator <= 0:
            return None
        value = value / denominator * max_score
    return value if 0.0 <= value <= max_score else None  # out of range: the judge ignored the rubric


def parse_score(text: Any, max_score: float = 10.0) -> float | None:
    """The judge's score on the 0..max_score scale, or None when the text holds none.

    Tried in order: the last JSON object with a "score" key; the last "Score: N[/D]" ("rating",
    "grade"; "out of" works too); the last "N/D" fraction; a number that opens the text. A value
    with a denominator is rescaled to max_score; a value outside [0, max_score] is no score.
    """
    s = tail(as_text(text), _WINDOW)
    for m in reversed(_JSON_OBJECT.findall(s)):
        try:
            obj = json.loads(m)
        except ValueError:
            continue
        value = next((v for k, v in obj.items() if str(k).lower() == "score"), None) if isinstance(obj, dict) else None
        try:
            number = float(value) if value is not None and not isinstance(value, bool) else None
        except (TypeError, ValueError):
            number = None
        if number is not None:
            return _scaled(number, None, max_score)
    for pattern in (_LABELLED, _FRACTION):
        matches = list(pattern.finditer(s))
        if matches:
            value, denominator = matches[-1].groups()
            return _scaled(float(value), float(denominator) if denominator else None, max_score)
    m = _LEADING.match(head(s, 64).strip())
    if m:
        value, denominator = m.groups()
        return _scaled(float(value), float(denominator) if denominator else None, max_score)
    return None


# ------------------------------------------------------------------------------------ engine

@contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Judge:
    """An in-process vllm.LLM and the model's processor (for its chat template)."""

    def __init__(self, model: str, engine_args: dict[str, Any]):
        import torch
        from transformers import AutoProcessor
        from vllm import LLM

        from mmrl.utils.env import reread_vllm_env

        kwargs = {"model": model, "max_model_len": 4096, "limit_mm_per_prompt": {"image": 4, "video": 0},
                  "seed": 0, **engine_args}
        if "enforce_eager" not in kwargs and not torch.cuda.is_available():
            kwargs["enforce_eager"] = True  # CPU: torch.compile costs ~40 s of start for nothing here
        set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
        # In-process engine core (see the module docstring).
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if not torch.cuda.is_available():  # else vLLM reserves most of the RAM for its KV cache
            env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
        with _env(env):
            reread_vllm_env()  # another in-process engine may have frozen vLLM's env before
            self.llm = LLM(**kwargs)
        # vLLM's CPU worker replaces torch.set_num_threads with a warning stub to protect its
        # thread pinning, which only the multi-process executor does; in-process every request
        # would log that warning twice. Put the real function back and leave the process's
        # thread count as it was (the reward worker may run other torch rewards).
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)
        self.processor = AutoProcessor.from_pretrained(model, trust_remote_code=kwargs.get("trust_remote_code", False))
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.max_images = int((kwargs.get("limit_mm_per_prompt") or {}).get("image", 1))
        self.lock = threading.Lock()  # an abandoned (timed-out) call may still be generating

    def prompt(self, text: str, n_images: int) -> str:
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
        return self.processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                  add_generation_prompt=True)

    def cut(self, text: str, max_tokens: int) -> str:
        """The first `max_tokens` tokens of `text` (prompts must fit max_model_len)."""
        window = text[: 16 * max_tokens]  # no token is 16 characters on average: enough to cut from
        ids = self.tokenizer(window, add_special_tokens=False)["input_ids"]
        if len(ids) > max_tokens:
            return self.tokenizer.decode(ids[:max_tokens]) + " [...]"
        return window if len(window) == len(text) else window + " [...]"

    def generate(self, requests: list[dict[str, Any]], max_new_tokens: int, temperature: float) -> list[str]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=0)
        with self.lock:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        return [o.outputs[0].text if o.outputs else "" for o in outputs]


def _engine_key(engine_args: dict[str, Any] | None) -> str:
    return json.dumps(engine_args or {}, sort_keys=True, default=str)


@functools.lru_cache(maxsize=2)
def _load(model: str, engine_key: str) -> _Judge:
    return _Judge(model, json.loads(engine_key))


def load_judge(model: str, engine_args: dict[str, Any] | None = None) -> _Judge:
    """The judge engine for `model`, built once per process."""
    return _load(model, _engine_key(engine_args))


def _setup(model: str, engine_args: dict[str, Any] | None = None) -> None:
    load_judge(model, engine_args)


def _answer_text(answer: Any) -> str:
    if answer is None:
        return "(none given)"
    return answer if isinstance(answer, str) else json.dumps(answer, default=str)


@reward("vlm_judge", batched=True, setup=_setup)
def vlm_judge(response: Sequence[str], images: Sequence[Sequence[Any]], prompt: Sequence[str],
              answer: Sequence[Any], *, model: str, rubric: str = DEFAULT_RUBRIC, max_score: float = 10.0,
              max_new_tokens: int = 32, temperature: float = 0.0, max_response_tokens: int = 512,
              engine_args: dict[str, Any] | None = None) -> list[dict[str, float]]:
    """A VLM judge's rubric score of the response, from its text (batched): score / max_score.

    `parse_failure` is 1 when the judge's text held no score (the score is then 0); `raw` is the
    parsed score on the judge's own scale."""
    if max_score <= 0:
        raise ValueError(f"vlm_judge: max_score must be positive, got {max_score}")
    judge = load_judge(model, engine_args)
    requests = []
    for resp, imgs, question, ans in zip(response, images, prompt, answer):
        shown = list(imgs or [])[: judge.max_images]
        values = {"question": judge.cut(as_text(question), max_response_tokens),
                  "answer": judge.cut(_answer_text(ans), max_response_tokens),
                  "response": judge.cut(as_text(resp), max_response_tokens), "max_score": f"{max_score:g}"}
        # one pass, so a response that contains "{answer}" is not filled in
        text = _FIELD.sub(lambda m: values[m.group(1)], rubric)
        request: dict[str, Any] = {"prompt": judge.prompt(text, len(shown))}
        if shown:
            request["multi_modal_data"] = {"image": [im.convert("RGB") for im in shown]}
        requests.append(request)
    out = []
    for text in judge.generate(requests, max_new_tokens, temperature):
        value = parse_score(text, max_score)
        out.append({"score": 0.0 if value is None else value / max_score,
                    "raw": 0.0 if value is None else value, "parse_failure": float(value is None)})
    return out
