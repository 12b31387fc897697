"""The answer_template agent loop: literals as environment tokens, one seeded request per hole."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mmrl.registry import resolve
from mmrl.rollout.agent_loops import AgentContext, ScriptedClient
from mmrl.rollout.template_loop import TemplateArgs
from mmrl.rollout.types import CALL_SEED_STRIDE, RequestSampling


class _Processor:
    def __init__(self, tokenizer):
        self.tokenizer, self.eos_token_id = tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>")


class _Prompt:
    def __init__(self, ids):
        self.vllm_input = {"prompt_token_ids": ids, "multi_modal_data": {"image": ["an image"]}}


def _run(tokenizer, holes, args=None, seed=11):
    client = ScriptedClient(tokenizer, holes)
    ctx = AgentContext(client=client, sampling=RequestSampling(max_tokens=8, seed=seed), processor=_Processor(tokenizer),
                       args=args or {})
    trajectory = asyncio.run(resolve("agent_loop", "answer_template")(ctx, None, _Prompt([1, 2, 3])))
    return trajectory, client


def test_literals_are_environment_tokens_and_holes_the_models(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    t, client = _run(tok, ["1", "0", "2", "1"])
    assert t.text == "[1, 0, 2, 1]"
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    expected = enc("[") + enc("1") + enc(", ") + enc("0") + enc(", ") + enc("2") + enc(", ") + enc("1") + enc("]") + [eos]
    assert t.response_ids == expected
    sampled = [i for i, m in zip(t.response_ids, t.loss_mask) if m]
    assert sampled == enc("1") + enc("0") + enc("2") + enc("1")  # only the holes are trained on
    assert [lp for lp, m in zip(t.behaviour_logprobs, t.loss_mask) if not m] == [0.0] * (len(expected) - 4)
    # each hole continues the sequence so far, image included, with its own seed and the hole's budget
    assert [p["prompt_token_ids"] for p in client.prompts] == [[1, 2, 3] + expected[:k] for k in (1, 4, 7, 10)]
    assert all(p["multi_modal_data"] == {"image": ["an image"]} for p in client.prompts)
    assert [s.seed for s in client.samplings] == [11 + k * CALL_SEED_STRIDE for k in range(4)]  # for_call
    assert [s.max_tokens for s in client.samplings] == [1] * 4
    assert t.stats == {"holes": 4.0, "hole_tokens": 4.0}


def test_a_template_without_eos_and_longer_holes(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    t, client = _run(tok, ["red square", "blue"], {"template": "A: {} and {}.", "hole_tokens": 3, "end_with_eos": False},
                     seed=None)
    assert t.text.startswith("A: ") and t.text.endswith(".") and " and " in t.text
    assert t.response_ids[-1] == tok(".", add_special_tokens=False)["input_ids"][-1]
    assert [s.seed for s in client.samplings] == [None, None] and [s.max_tokens for s in client.samplings] == [3, 3]


@pytest.mark.parametrize("bad, match", [({"template": "no holes"}, "at least one"), ({"hole_tokens": 0}, "positive"),
                                        ({"holes": 4}, "unknown key")])
def test_bad_arguments_name_the_key(bad, match) -> None:
    with pytest.raises(ValueError, match=match):
        TemplateArgs.from_dict(bad)


def test_the_grounding_reward_reads_a_filled_template() -> None:
    from mmrl.plugins.rewards.grounding import grounding_iou

    meta = {"image_size": [84, 84]}
    score = lambda text: grounding_iou(text, [28, 0, 56, 28], metadata=meta, coords="grid", grid=3)["score"]  # noqa: E731
    assert score("[1, 0, 2, 1]") == 1.0 and score("[1, 0, 2, 2]") == pytest.approx(0.5)
    assert score("[0, 0, 1, 1]") == 0.0 and score("[a, 0, 2, 1]") == 0.0
    with pytest.raises(ValueError, match="grid=N"):
        grounding_iou("[1, 0, 2, 1]", [28, 0, 56, 28], metadata=meta, coords="grid")


def test_each_call_of_a_trajectory_has_its_own_seed() -> None:
    """A seeded engine request draws from a generator seeded afresh: calls of one trajectory that
    shared a seed drew the same numbers for their first tokens (the multi-turn loop's turns did)."""
    base = RequestSampling(max_tokens=4, seed=7)
    assert base.for_call(0) is base
    seeds = [base.for_call(k).seed for k in range(4)]
    assert seeds == [7 + k * CALL_SEED_STRIDE for k in range(4)] and len(set(seeds)) == 4
    assert RequestSampling(seed=None).for_call(3).seed is None
    # no call's seed is another trajectory's (seed + slot * SEED_STRIDE + member, < CALL_SEED_STRIDE
    # apart within a step) or a resubmission's
    assert all(base.for_call(k).seed != base.continued(0, a).seed for k in range(1, 50) for a in range(1, 50))
