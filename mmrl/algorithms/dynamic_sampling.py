"""DAPO dynamic sampling (Yu et al., arXiv 2503.14476).

A group whose metric is the same for every response (all correct, all wrong) has zero advantage
under any group baseline, so it only dilutes the batch. DAPO drops such groups and keeps
generating until enough informative groups are collected (verl algorithm.filter_groups: metric
acc|score|seq_reward, max_num_gen_batches=10), then truncates to the target.

    acc = GroupAccumulator(target_groups=512, max_rounds=10)
    while not acc.done:
        groups, metric_BG = generate_round()        # any per-group objects + their metric
        acc.add(groups, metric_BG)
    groups, bound_hit = acc.result()                # bound_hit: fewer than 512 after 10 rounds
"""
from __future__ import annotations

from typing import Generic, Sequence, TypeVar

import torch
from torch import Tensor

__all__ = ["informative_groups", "GroupAccumulator"]

T = TypeVar("T")


def informative_groups(rewards_BG: Tensor, eps: float = 1e-6) -> Tensor:
    """keep_B: True for groups whose rewards are not all equal (max − min > eps).

    A tolerance rather than exact equality, since float rewards such as IoU can differ by
    rounding noise only. A group of size 1 is never informative.
    """
    r = torch.as_tensor(rewards_BG)
    if r.dim() != 2:
        raise ValueError(f"rewards_BG must have shape (prompts B, group size G); got {tuple(r.shape)}")
    if r.shape[1] == 0:
        return torch.zeros(r.shape[0], dtype=torch.bool, device=r.device)
    r = r.float()
    return (r.amax(dim=1) - r.amin(dim=1)) > eps


class GroupAccumulator(Generic[T]):
    """Collects informative groups over several rollout rounds, up to `target_groups`.

    `max_rounds` bounds the number of rounds (None: unbounded). When it is reached with fewer
    than `target_groups` kept, `result()` returns what was kept and bound_hit=True; the caller
    decides whether to train on the smaller batch or stop (verl raises instead).
    """

    def __init__(self, target_groups: int, max_rounds: int | None = 10, eps: float = 1e-6) -> None:
        if target_groups <= 0:
            raise ValueError(f"target_groups must be > 0, got {target_groups}")
        if max_rounds is not None and max_rounds <= 0:
            raise ValueError(f"max_rounds must be > 0 or None, got {max_rounds}")
        self.target_groups = target_groups
        self.max_rounds = max_rounds
        self.eps = eps
        self.rounds = 0
        self.n_seen = 0
        self._kept: list[T] = []

    @property
    def n_kept(self) -> int:
        return len(self._kept)

    @property
    def bound_hit(self) -> bool:
        """The round bound was reached before the target."""
        return (self.max_rounds is not None and self.rounds >= self.max_rounds
                and self.n_kept < self.target_groups)

    @property
    def done(self) -> bool:
        return self.n_kept >= self.target_groups or self.bound_hit

    def add(self, groups: Sequence[T], rewards_BG: Tensor) -> int:
        """Keep the informative groups of one round (in order); return how many were kept.

        `groups[b]` is whatever represents group b (samples, indices) and `rewards_BG[b]` its
        filter metric. Adding once done raises, so a caller loop cannot overshoot silently.
        """
        if self.done:
            raise RuntimeError(f"accumulator is done ({self.n_kept}/{self.target_groups} groups after "
                               f"{self.rounds} rounds); call result()")
        keep_B = informative_groups(rewards_BG, self.eps)
        if keep_B.shape[0] != len(groups):
            raise ValueError(f"{len(groups)} groups but rewards for {keep_B.shape[0]}")
        kept = [g for g, k in zip(groups, keep_B.tolist()) if k]
        self._kept.extend(kept)
        self.rounds += 1
        self.n_seen += len(groups)
        return len(kept)

    def result(self) -> tuple[list[T], bool]:
        """(the first `target_groups` kept groups, or all of them if fewer; bound_hit).

        The surplus of the last round is dropped, as verl truncates to train_batch_size.
        """
        return self._kept[: self.target_groups], self.bound_hit

    def stats(self) -> dict[str, float]:
        """rounds; kept_frac = informative groups / groups generated; n_surplus dropped."""
        return {
            "rounds": float(self.rounds),
            "kept_frac": self.n_kept / self.n_seen if self.n_seen else 0.0,
            "n_surplus": float(max(self.n_kept - self.target_groups, 0)),
        }
