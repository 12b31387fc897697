"""Routing replay (R3) in the trainer's forward, on the tiny Qwen3-VL-MoE in transformers (no
engine, no DeepSpeed): the replayed top-k wins over the trainer's own router, the gate weights
come from the trainer's router at the replayed experts (gradients reach it), positions without a
record keep their own routing, and the agreement count compares the two choices."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.data.sample import Sample, messages_from_prompt
from mmrl.models.tiny_vlm import MOE_EXPERTS, MOE_TOP_K, build_tiny_vlm
from mmrl.processors import build_processor
from mmrl.trainer.batch import TrainSequence, collate
from mmrl.trainer.routing_replay import RoutingReplay, moe_routers, replay_rows


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm("qwen3_vl_moe", tmp_path_factory.mktemp("moe") / "tiny-moe", seed=0)


def _model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def _sequences(path: Path, padding_free: bool = False) -> tuple[list[TrainSequence], object]:
    proc = build_processor("auto", str(path))
    image = Image.new("RGB", (56, 56), (200, 30, 30))
    seqs = []
    for n, response in ((1, [40, 41, 42, 43, 44]), (2, [50, 51, 52])):
        prompt = proc(Sample(key=f"s{n}", messages=messages_from_prompt("What colour is this?", n_images=n),
                             images=[image] * n))
        seqs.append(TrainSequence.from_prompt(prompt, response, [0.0] * len(response), [1] * len(response)))
    return seqs, collate(seqs, proc.pad_token_id, padding_free)


class _ExpertCalls:
    """What each MoE layer's experts were called with: (top-k indices, gate weights) per forward."""

    def __init__(self, model: torch.nn.Module):
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.handles = [r_block.experts.register_forward_hook(self._hook)
                        for r_block in (m for n, m in model.named_modules() if n.endswith("mlp") and hasattr(m, "experts"))]

    def _hook(self, module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        self.calls.append((inputs[1].detach().clone(), inputs[2].detach().clone()))


def _forward(model: torch.nn.Module, mb: object) -> torch.Tensor:
    out = model(**mb.model_inputs())
    return torch.log_softmax(out.logits.float(), dim=-1)


def _record(model: torch.nn.Module, seqs: list[TrainSequence], mb: object) -> list[np.ndarray]:
    """The model's own top-k at the positions that predict each response token: what the engine
    would record (row t: the input before token t)."""
    calls = _ExpertCalls(model)
    with torch.no_grad():
        _forward(model, mb)
    for h in calls.handles:
        h.remove()
    B, L = mb.input_ids_BL.shape
    per_layer = [idx for idx, _ in calls.calls]  # (B * L, k) each
    packed = mb.attention_mask_BL is None
    P = max(len(s.prompt_ids) for s in seqs)
    records, start = [], 0
    for i, s in enumerate(seqs):
        n_p, n_r = len(s.prompt_ids), len(s.response_ids)
        # the input before response token t: prompts end at column P (left-padded) or, packed,
        # each sequence follows the previous one
        before = [start + n_p - 1 + t if packed else i * L + P - 1 + t for t in range(n_r)]
        records.append(np.stack([np.stack([layer[r].numpy() for layer in per_layer]) for r in before]).astype(np.int16))
        start += n_p + n_r
    return records


def test_the_tiny_moe_model_routes_top_2_of_4_in_every_text_layer(moe_dir: Path) -> None:
    model = _model(moe_dir)
    routers = moe_routers(model)
    assert len(routers) == model.config.text_config.num_hidden_layers == 2
    assert all(r.top_k == MOE_TOP_K and r.num_experts == MOE_EXPERTS for r in routers)
    assert all(float(r.weight.detach().abs().sum()) > 0 for r in routers), "random router weights, not zeros"


@pytest.mark.parametrize("padding_free", [False, True])
def test_the_replayed_choice_wins_over_a_different_trainer_router(moe_dir: Path, padding_free: bool) -> None:
    model = _model(moe_dir)
    seqs, mb = _sequences(moe_dir, padding_free)
    recorded = _record(model, seqs, mb)
    for s, r in zip(seqs, recorded):
        s.routed_experts = r
    rows = replay_rows(seqs, mb)
    assert rows is not None and rows.shape == (mb.input_ids_BL.numel(), 2, MOE_TOP_K)
    assert int((rows[:, 0, 0] >= 0).sum()) == sum(len(s.response_ids) for s in seqs)

    # force a different router: the trainer's own choice now differs from the recorded one
    with torch.no_grad():
        for r in moe_routers(model):
            r.weight.copy_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(7)) * 5)
    replay = RoutingReplay(model, "rollout")
    replay.use(rows, measure=True)
    calls = _ExpertCalls(model)
    with torch.no_grad():
        _forward(model, mb)
    for h in calls.handles:
        h.remove()
    counts = replay.take_counts()
    valid = rows[:, 0, 0] >= 0
    differs = 0
    for layer, (index, weights) in enumerate(calls.calls):
        assert torch.equal(index[valid], rows[valid, layer]), "the replayed experts must be the ones used"
        # the gate weights: the trainer's router probabilities at the replayed experts, renormalised
        assert torch.allclose(weights.sum(-1), torch.ones(weights.shape[0]), atol=1e-6)
        router = replay.routers[layer]  # its own choice, computed beside the hook
        own = torch.topk(torch.softmax(_router_input(model, mb, layer) @ router.weight.T, dim=-1), MOE_TOP_K).indices
        differs += int((own[valid].sort(-1).values != rows[valid, layer].sort(-1).values).any(-1).sum())
        assert torch.equal(index[~valid], own[~valid]), "positions without a record keep their own routing"
    assert differs > 0, "the forced router must disagree somewhere, or the test shows nothing"
    assert counts["router_pairs"] == float(valid.sum()) * 2
    assert counts["router_agree"] == counts["router_pairs"] - differs
    replay.remove()


def _router_input(model: torch.nn.Module, mb: object, layer: int) -> torch.Tensor:
    """The hidden states MoE layer `layer`'s router saw in the last forward (its pre-hook input)."""
    captured: list[torch.Tensor] = []
    router = moe_routers(model)[layer]
    h = router.register_forward_hook(lambda m, i, o: captured.append(i[0].detach()))
    try:
        with torch.no_grad():
            _forward(model, mb)
    finally:
        h.remove()
    return captured[0]


def test_replay_gate_weights_are_the_trainer_router_probabilities_and_get_gradients(moe_dir: Path) -> None:
    model = _model(moe_dir)
    seqs, mb = _sequences(moe_dir)
    recorded = _record(model, seqs, mb)
    for s, r in zip(seqs, recorded):
        s.routed_experts = r
    rows = replay_rows(seqs, mb)
    replay = RoutingReplay(model, "rollout")
    replay.use(rows, measure=False)
    calls = _ExpertCalls(model)
    logprobs = _forward(model, mb)
    for h in calls.handles:
        h.remove()
    valid = rows[:, 0, 0] >= 0
    x = _router_input(model, mb, 0)
    probs = torch.softmax(x @ moe_routers(model)[0].weight.detach().T, dim=-1)
    expect = probs.gather(1, rows[:, 0].clamp(min=0))
    expect = expect / expect.sum(-1, keepdim=True)
    assert torch.allclose(calls.calls[0][1][valid], expect[valid], atol=1e-6)

    model.zero_grad()
    logprobs[..., 40].sum().backward()
    for r in moe_routers(model):
        assert r.weight.grad is not None and float(r.weight.grad.abs().sum()) > 0, "gradients must reach the router"
    replay.remove()


def test_replaying_the_models_own_routing_changes_nothing_and_off_only_measures(moe_dir: Path) -> None:
    model = _model(moe_dir)
    seqs, mb = _sequences(moe_dir)
    with torch.no_grad():
        plain = _forward(model, mb)
    for s, r in zip(seqs, _record(model, seqs, mb)):
        s.routed_experts = r
    rows = replay_rows(seqs, mb)
    for mode in ("rollout", "off"):
        replay = RoutingReplay(model, mode)
        replay.use(rows, measure=True)
        with torch.no_grad():
            again = _forward(model, mb)
        assert torch.allclose(again, plain, atol=1e-5), mode
        counts = replay.take_counts()
        assert counts["router_agree"] == counts["router_pairs"] > 0, "the same router agrees with itself"
        replay.remove()
    with pytest.raises(ValueError, match="routing_replay"):
        RoutingReplay(model, "sometimes")


def test_a_trajectorys_routing_follows_its_tokens_and_inserted_tokens_get_none() -> None:
    """Two model turns with tool tokens between (and a lead): one row per response token, the
    engine's rows on sampled tokens, -1 rows (trainer routes itself) on the loop's own tokens."""
    from mmrl.rollout.agent_loops import make_trajectory
    from mmrl.rollout.types import Completion

    turn1 = np.arange(3 * 2 * 2, dtype=np.int16).reshape(3, 2, 2) % 4
    turn2 = np.ones((2, 2, 2), dtype=np.int16)
    completions = [Completion([5, 6, 7], [-1.0] * 3, "a", "stop", [0] * 3, routed_experts=turn1),
                   Completion([8, 9], [-1.0] * 2, "b", "stop", [0] * 2, routed_experts=turn2)]
    t = make_trajectory(completions, between=[([1, 2], "tool")], lead=([3], "x"))
    assert t.routed_experts.shape == (len(t.response_ids), 2, 2) == (8, 2, 2)
    rows = t.routed_experts
    assert (rows[0] == -1).all() and (rows[4:6] == -1).all()  # lead and tool tokens
    assert np.array_equal(rows[1:4], turn1) and np.array_equal(rows[6:8], turn2)
    assert [m for m in t.loss_mask] == [0, 1, 1, 1, 0, 0, 1, 1]
    # a dense model's completions carry none: no record at all
    assert make_trajectory([Completion([5], [-1.0], "a", "stop", [0])]).routed_experts is None
