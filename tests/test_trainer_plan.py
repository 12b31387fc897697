"""How a rollout batch becomes updates (mmrl/trainer/plan.py) and what one micro-batch's loss is
(mmrl/trainer/update.py): no engines, hand-computed expectations."""
from __future__ import annotations

import math

import pytest
import torch

from mmrl.algorithms.losses import ppo_clip
from mmrl.trainer.batch import TrainSequence
from mmrl.trainer.plan import filler_for, pack_micro_batches, padded_tokens, plan_forward_only, plan_updates, split_to_count
from mmrl.trainer.update import LossSettings, micro_batch_loss


def _seq(prompt_len: int, response_len: int, advantage: float = 0.0) -> TrainSequence:
    return TrainSequence(prompt_ids=[1] * prompt_len, positions_AP=torch.zeros(3, prompt_len, dtype=torch.long),
                         next_position=prompt_len, mm_inputs={}, response_ids=[5] * response_len,
                         behaviour_logprobs=[-1.0] * response_len, loss_mask=[1] * response_len, advantage=advantage)


def test_token_budget_packs_by_padded_size_and_counts_vision_tokens() -> None:
    # prompt lengths include the image placeholder tokens (a 64-token image prompt is long)
    seqs = [_seq(64, 4), _seq(64, 2), _seq(10, 4), _seq(10, 4), _seq(8, 1)]
    bins = pack_micro_batches(seqs, max_rows=8, max_tokens=140)
    # longest first: [64+4, 64+2] -> 2 x 68 = 136 <= 140; a third row would cost 3 x 68
    assert [[(len(s.prompt_ids), len(s.response_ids)) for s in b] for b in bins] == \
        [[(64, 4), (64, 2)], [(10, 4), (10, 4), (8, 1)]]
    assert all(padded_tokens(b) <= 140 for b in bins)
    # a single sequence over the budget still runs, alone
    assert [len(b) for b in pack_micro_batches([_seq(200, 4), _seq(2, 2)], max_rows=8, max_tokens=100)] == [1, 1]
    # without a budget only the row limit applies
    assert [len(b) for b in pack_micro_batches(seqs, max_rows=2)] == [2, 2, 1]


def test_split_to_count_halves_the_largest_and_pads_with_fillers() -> None:
    seqs = [_seq(4, 1) for _ in range(5)]
    assert [len(b) for b in split_to_count([seqs[:4], seqs[4:]], 3)] == [2, 2, 1]
    assert [len(b) for b in split_to_count([seqs[:1]], 3)] == [1, 0, 0]
    run, is_filler = filler_for([], seqs[0])
    assert is_filler and sum(run[0].loss_mask) == 0 and run[0].advantage == 0.0
    with pytest.raises(ValueError):
        split_to_count([seqs[:1], seqs[1:2]], 1)


def test_plan_updates_equal_micro_batch_counts_and_global_denominators() -> None:
    lengths = [1, 2, 3, 3, 3, 1, 2, 2, 2]  # 9 responses, 19 tokens
    seqs = [_seq(4, n, advantage=float(i)) for i, n in enumerate(lengths)]
    inputs = plan_updates(seqs, world_size=2, micro_batch_size=2, loss_agg="token_mean")
    assert len(inputs) == 2 and all(len(x.mini_batches) == 1 for x in inputs)
    counts = [len(x.mini_batches[0].micro_batches) for x in inputs]
    assert counts[0] == counts[1] == 3  # ceil(5 / 2) on both ranks, the rank with 4 splits to 3
    assert all(x.mini_batches[0].loss_denominator == 19.0 for x in inputs)
    delivered = sorted(s.advantage for x in inputs for mb in x.mini_batches[0].micro_batches for s in mb)
    assert delivered == [float(i) for i in range(9)]  # every sequence exactly once
    seq_mean = plan_updates(seqs, world_size=2, micro_batch_size=2, loss_agg="seq_mean_token_mean")
    assert seq_mean[0].mini_batches[0].loss_denominator == 9.0  # sequences, not tokens


def test_plan_updates_mini_batches_partition_the_batch_with_their_own_denominators() -> None:
    seqs = [_seq(4, 1 + i % 3, advantage=float(i)) for i in range(12)]
    inputs = plan_updates(seqs, world_size=2, mini_batches=3, epochs=2, micro_batch_size=64, seed=7)
    assert all(x.num_updates == 6 for x in inputs)
    seen = []
    for m in range(3):
        parts = [x.mini_batches[m] for x in inputs]
        assert parts[0].loss_denominator == parts[1].loss_denominator
        members = [s for p in parts for mb in p.micro_batches for s in mb]
        assert parts[0].loss_denominator == sum(len(s.response_ids) for s in members)
        seen += [s.advantage for s in members]
    assert sorted(seen) == [float(i) for i in range(12)]
    # shuffled (seeded) before the split: a mini-batch mixes prompts from the whole batch
    assert seen != [float(i) for i in range(12)]
    again = plan_updates(seqs, world_size=2, mini_batches=3, micro_batch_size=64, seed=7)
    assert [s.advantage for x in again for m in x.mini_batches for mb in m.micro_batches for s in mb] == \
        [s.advantage for x in inputs for m in x.mini_batches for mb in m.micro_batches for s in mb]


def test_plan_forward_only_returns_the_order_of_results() -> None:
    seqs = [_seq(4 + i, 1 + i % 2) for i in range(5)]
    chunks, order = plan_forward_only(seqs, world_size=2, micro_batch_size=2)
    assert len(chunks[0]) == len(chunks[1])
    for rank_chunks, rank_order in zip(chunks, order):
        assert [id(s) for c in rank_chunks for s in c] == [id(seqs[i]) for i in rank_order]
    assert sorted(i for o in order for i in o) == list(range(5))


def test_micro_batch_loss_matches_hand_computed_terms() -> None:
    # two sequences of 2 tokens; old == behaviour, current differs by +0.1 on every token
    behaviour = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]])
    logprobs = (behaviour + 0.1).requires_grad_(True)
    entropy = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    ref = behaviour - 0.2
    settings = LossSettings(entropy_coef=0.01, kl_coef=0.5, kl_estimator="k1", policy_loss_args={"clip_high": 0.28})
    loss, sums = micro_batch_loss(ppo_clip, settings, logprobs, entropy, mask, adv, behaviour, behaviour.clone(),
                                  ref, scale=2.0 / 3.0)
    r = math.exp(0.1)
    # A=+1: -min(r, clip(r, 0.8, 1.28)) = -r on both tokens; A=-1: max(r, clip(r)) = r on its one token
    pg = -r - r + r
    kl = 3 * 0.3  # k1 = logπ - logπ_ref = 0.3 per valid token
    expected = (pg - 0.01 * (1 + 2 + 3) + 0.5 * kl) * (2.0 / 3.0)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    assert sums["tokens"] == 3 and sums["pg_loss"] == pytest.approx(pg, rel=1e-5)
    assert sums["abs_logprob_diff"] == 0.0 and sums["kl"] == pytest.approx(kl, rel=1e-5)
    loss.backward()
    assert logprobs.grad is not None and logprobs.grad[1, 1] == 0.0  # masked token: no gradient


def test_micro_batch_loss_tis_truncates_and_mis_masks_tokens() -> None:
    behaviour = torch.tensor([[-1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.0, -1.0 + math.log(3.0), -1.0 + math.log(0.5)]])  # ratios 1, 3, 0.5
    logprobs = old.clone().requires_grad_(True)
    mask, adv, entropy = torch.ones(1, 3), torch.tensor([1.0]), torch.zeros(1, 3)
    tis = LossSettings(correction_mode="tis", correction_threshold=2.0)
    loss, sums = micro_batch_loss(ppo_clip, tis, logprobs, entropy, mask, adv, behaviour, old, None, scale=1.0)
    # ratio to π_old is 1 on every token, so ℓ_t = -1 weighted by min(w, 2) = 1, 2, 0.5
    assert float(loss.detach()) == pytest.approx(-(1 + 2 + 0.5), rel=1e-5)
    assert sums["correction_weight_sum"] == pytest.approx(3.5, rel=1e-5)
    mis = LossSettings(correction_mode="mis", correction_threshold=2.0, correction_threshold_low=0.6)
    loss, sums = micro_batch_loss(ppo_clip, mis, logprobs, entropy, mask, adv, behaviour, old, None, scale=1.0)
    # tokens with w = 3 (> 2) and w = 0.5 (< 0.6) are masked; the kept one has w = 1
    assert float(loss.detach()) == pytest.approx(-1.0, rel=1e-5)
    assert sums["tokens"] == 1 and sums["mismatch_tokens"] == 3
