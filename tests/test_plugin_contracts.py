"""A contract test per plugin kind: every registered plugin of the kind (built-in or not) passes it.

A new plugin needs nothing here unless it takes required keyword arguments; then add example
arguments to CONTRACT_ARGS.
"""
from __future__ import annotations

import inspect
import math
from pathlib import Path

import pytest
import torch

from mmrl import registry
from mmrl.processors.base import ProcessedPrompt
from mmrl.rewards.base import call_reward, reward_kwargs

CONTRACT_ARGS: dict[tuple[str, str], dict] = {
    ("reward", "first_word_in"): {"words": ["red", "green"]},
    ("reward", "dapo_overlong"): {"max_length": 4, "cache_length": 2},
}


def _names(kind: str) -> list[str]:
    return [e.name for e in registry.entries(kind) if e.origin == "builtin" or "decorator" in e.origin]


@pytest.mark.parametrize("name", _names("reward"))
def test_reward_contract(name: str, colors_samples: list) -> None:
    fn = registry.resolve("reward", name)
    args = CONTRACT_ARGS.get(("reward", name), {})
    sample = colors_samples[0]
    for response in ["", "red", sample.answer, "@@##!!", "blue " * 20000]:
        scores = call_reward(fn, **reward_kwargs(sample, response, [1, 2, 3]), **args)
        assert "score" in scores and all(math.isfinite(v) for v in scores.values()), (name, response, scores)


@pytest.mark.parametrize("name", _names("advantage"))
def test_advantage_contract(name: str) -> None:
    fn = registry.resolve("advantage", name)
    rewards_BG = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 2.0, 1.0, 3.0]])
    adv = fn(rewards_BG)
    assert adv.shape == rewards_BG.shape and torch.isfinite(adv).all()
    assert torch.allclose(adv[1], torch.zeros(4)), "a constant-reward group carries no signal"
    assert torch.allclose(fn(rewards_BG + 7.0), adv, atol=1e-5), "advantages are shift-invariant"
    assert (adv[0, 0] > adv[0, 1]) and (adv[2, 3] > adv[2, 0]), "higher reward, higher advantage"


@pytest.mark.parametrize("name", _names("policy_loss"))
def test_policy_loss_contract(name: str) -> None:
    fn = registry.resolve("policy_loss", name)
    torch.manual_seed(0)
    logprobs_BT = (-torch.rand(3, 5)).requires_grad_()
    old_BT = logprobs_BT.detach() + 0.05 * torch.randn(3, 5)
    mask_BT = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    loss_BT, stats = fn(logprobs_BT, old_BT, torch.tensor([1.0, -0.5, 2.0]), mask_BT)
    assert loss_BT.shape == (3, 5) and "clipped_BT" in stats
    assert torch.all(loss_BT[mask_BT == 0] == 0), "masked tokens carry no loss"
    (loss_BT * mask_BT).sum().backward()
    assert torch.isfinite(logprobs_BT.grad).all() and logprobs_BT.grad.abs().sum() > 0


@pytest.mark.parametrize("name", _names("agent_loop"))
def test_agent_loop_signature(name: str) -> None:
    # Called as loop(ctx, prompts); the real engine run is in tests/test_parity.py.
    params = list(inspect.signature(registry.resolve("agent_loop", name)).parameters)
    assert len(params) >= 2


@pytest.mark.parametrize("name", _names("processor"))
def test_processor_contract(name: str, tiny_model_dir: Path, colors_samples: list) -> None:
    proc = registry.resolve("processor", name)(str(tiny_model_dir))
    out = proc(colors_samples[0])
    assert isinstance(out, ProcessedPrompt)
    assert out.position_ids_3P.shape == (3, len(out.prompt_ids))
    assert out.next_position == int(out.position_ids_3P.max()) + 1
    vllm_ids = out.vllm_input["prompt_token_ids"]
    image_pad = proc.image_token_id
    assert vllm_ids.count(image_pad) == len(colors_samples[0].images), "one pad per image for vLLM"
    n_image_tokens = out.prompt_ids.count(image_pad)
    grid = out.mm_inputs["image_grid_thw"]
    assert n_image_tokens == int(grid.prod(-1).sum()) // 4, "expanded pads match the merged patches"
    assert [t for t in out.prompt_ids if t != image_pad] == [t for t in vllm_ids if t != image_pad]
    assert all(t in proc.forbidden_token_ids for t in (proc.image_token_id, proc.video_token_id))


@pytest.mark.parametrize("name", _names("dataset"))
def test_dataset_contract(name: str, tmp_path: Path) -> None:
    from mmrl.data.stream import load_all

    info = registry.resolve("dataset", name)(tmp_path, train_size=12, heldout_size=6, shard_size=8)
    assert info["counts"] == {"train": 12, "heldout": 6}
    heldout = load_all(str(tmp_path / info["shards"]["heldout"]))
    assert len(heldout) == 6 and all(s.messages and s.answer is not None for s in heldout)
