"""How one rollout batch becomes optimizer updates: mini-batches, the split over data-parallel
ranks, and micro-batches sized by a token budget.

Two rules shape everything here:
  * every ZeRO-3 rank must run the same number of forwards/backwards per update (each one
    all-gathers parameters collectively), so a rank short of sequences runs *fillers*: a copy of
    one of its sequences with an all-zero loss mask;
  * the loss of a mini-batch is Σ over its tokens / one global denominator, so micro-batch and
    rank boundaries do not change the gradient (the aggregation modes: algorithms/losses.py).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from mmrl.algorithms.losses import aggregate_denominator
from mmrl.trainer.batch import TrainSequence
from mmrl.utils import split_even


@dataclass
class MiniBatch:
    """One optimizer update's share for one rank. An empty micro-batch is a filler."""

    micro_batches: list[list[TrainSequence]]
    loss_denominator: float


@dataclass
class StepInputs:
    """Everything one rank trains on for one rollout batch: `epochs` passes over `mini_batches`,
    one optimizer step per mini-batch. `entropy_coef`, when set, is this step's value of the
    entropy bonus (algorithm.entropy_schedule) in place of the static LossSettings one."""

    mini_batches: list[MiniBatch]
    epochs: int = 1
    entropy_coef: float | None = None

    @property
    def num_updates(self) -> int:
        return self.epochs * len(self.mini_batches)


def padded_tokens(seqs: Sequence[TrainSequence], padding_free: bool = False) -> int:
    """What a micro-batch costs the forward: rows x (longest prompt + longest response), as
    prompts are left-padded and responses right-padded to those lengths (trainer.batch.collate);
    with `padding_free`, the tokens themselves (one packed row)."""
    if not seqs:
        return 0
    if padding_free:
        return sum(s.num_tokens for s in seqs)
    return len(seqs) * (max(s.prompt_length for s in seqs) + max(len(s.response_ids) for s in seqs))


def pack_micro_batches(seqs: Sequence[TrainSequence], *, max_rows: int, max_tokens: int | None = None,
                       padding_free: bool = False) -> list[list[TrainSequence]]:
    """Greedy packing by length (longest first, so similar lengths share padding): a micro-batch
    takes sequences while it has at most `max_rows` sequences and costs at most `max_tokens`
    tokens (`padded_tokens`). A single sequence over the budget still gets a micro-batch of its own."""
    if max_rows < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {max_rows}")
    order = sorted(seqs, key=lambda s: (s.prompt_length, len(s.response_ids)), reverse=True)
    bins: list[list[TrainSequence]] = []
    for seq in order:
        if bins and len(bins[-1]) < max_rows and (
                max_tokens is None or padded_tokens(bins[-1] + [seq], padding_free) <= max_tokens):
            bins[-1].append(seq)
        else:
            bins.append([seq])
    return bins


def split_to_count(bins: list[list[TrainSequence]], count: int) -> list[list[TrainSequence]]:
    """Exactly `count` micro-batches: halve the largest until there are enough (halving never
    breaks the token budget), then pad with fillers ([]) when a rank has too few sequences."""
    bins = [list(b) for b in bins]
    if len(bins) > count:
        raise ValueError(f"{len(bins)} micro-batches do not fit in {count}")
    while len(bins) < count:
        largest = max(range(len(bins)), key=lambda i: len(bins[i]), default=None)
        if largest is None or len(bins[largest]) < 2:
            bins.append([])
            continue
        b = bins.pop(largest)
        bins[largest:largest] = [b[:len(b) // 2], b[len(b) // 2:]]
    return bins


def _response_mask(seqs: Sequence[TrainSequence], T: int) -> torch.Tensor:
    mask_BT = torch.zeros(len(seqs), T)
    for i, s in enumerate(seqs):
        mask_BT[i, :len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=torch.float32)
    return mask_BT


def plan_updates(seqs: Sequence[TrainSequence], *, world_size: int, mini_batches: int = 1, epochs: int = 1,
                 micro_batch_size: int, max_tokens_per_micro_batch: int | None = None,
                 loss_agg: str = "token_mean", seed: int = 0, padding_free: bool = False) -> list[StepInputs]:
    """One StepInputs per rank. With several mini-batches the sequences are shuffled first (seeded),
    so each update sees a mix of prompts rather than the first groups of the batch."""
    if len(seqs) < world_size:
        raise ValueError(f"a batch of {len(seqs)} sequences cannot feed {world_size} trainer ranks")
    if mini_batches < 1 or epochs < 1:
        raise ValueError(f"need mini_batches >= 1 and ppo_epochs >= 1; got {mini_batches}, {epochs}")
    order = list(seqs)
    if mini_batches > 1:
        random.Random(seed).shuffle(order)
    T = max(max(len(s.response_ids) for s in order), 1)
    per_rank: list[list[MiniBatch]] = [[] for _ in range(world_size)]
    for part in split_even(order, min(mini_batches, len(order) // world_size or 1)):
        denominator = max(float(aggregate_denominator(_response_mask(part, T), loss_agg)), 1.0)
        rank_bins = [pack_micro_batches(share, max_rows=micro_batch_size, max_tokens=max_tokens_per_micro_batch,
                                        padding_free=padding_free) for share in split_even(part, world_size)]
        count = max(len(b) for b in rank_bins)
        for rank, bins in enumerate(rank_bins):
            per_rank[rank].append(MiniBatch(split_to_count(bins, count), denominator))
    return [StepInputs(mini_batches=m, epochs=epochs) for m in per_rank]


def plan_forward_only(seqs: Sequence[TrainSequence], *, world_size: int, micro_batch_size: int,
                      max_tokens_per_micro_batch: int | None = None,
                      padding_free: bool = False) -> tuple[list[list[list[TrainSequence]]], list[list[int]]]:
    """Micro-batches per rank for a no-grad pass (logprob recompute), and for each rank the
    indices into `seqs` in the order its results come back."""
    index = {id(s): i for i, s in enumerate(seqs)}
    chunks, order = [], []
    bins_per_rank = [pack_micro_batches(share, max_rows=micro_batch_size, max_tokens=max_tokens_per_micro_batch,
                                        padding_free=padding_free) for share in split_even(list(seqs), world_size)]
    count = max(len(b) for b in bins_per_rank)
    for bins in bins_per_rank:
        bins = split_to_count(bins, count)
        chunks.append(bins)
        order.append([index[id(s)] for b in bins for s in b])
    return chunks, order


def filler_for(chunk: list[TrainSequence], fallback: TrainSequence) -> tuple[list[TrainSequence], bool]:
    """The micro-batch to run: the chunk itself, or one fully masked copy of `fallback`."""
    if chunk:
        return chunk, False
    return [replace(fallback, loss_mask=[0] * len(fallback.loss_mask), advantage=0.0)], True
