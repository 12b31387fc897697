"""DAPO dynamic sampling: informative-group filter and the multi-round accumulator."""
from __future__ import annotations

import pytest
import torch

from mmrl.algorithms import GroupAccumulator, informative_groups


def test_informative_groups() -> None:
    r = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [0.5, 0.5 + 1e-9, 0.5], [2.0, 2.0, 2.0], [0.0, 0.3, 0.0]])
    # all-equal and equal-up-to-rounding groups are dropped
    assert informative_groups(r).tolist() == [False, True, False, False, True]
    assert informative_groups(r, eps=0.5).tolist() == [False, True, False, False, False]
    assert informative_groups(torch.tensor([[1, 0], [1, 1]])).tolist() == [True, False]  # integer metric
    assert informative_groups(torch.tensor([[1.0], [0.0]])).tolist() == [False, False]  # group of one
    with pytest.raises(ValueError, match="shape"):
        informative_groups(torch.tensor([1.0, 0.0]))


def test_accumulator_reaches_target_and_truncates() -> None:
    acc: GroupAccumulator[str] = GroupAccumulator(target_groups=3, max_rounds=3)
    assert acc.add(["a", "b", "c", "d"], torch.tensor([[1, 0], [1, 1], [0, 1], [0, 0]])) == 2
    assert not acc.done and acc.n_kept == 2
    assert acc.add(["e", "f"], torch.tensor([[1.0, 0.0], [0.0, 1.0]])) == 2
    assert acc.done and not acc.bound_hit
    assert acc.result() == (["a", "c", "e"], False)  # order kept; the surplus "f" is dropped
    assert acc.stats() == {"rounds": 2.0, "kept_frac": 4 / 6, "n_surplus": 1.0}
    with pytest.raises(RuntimeError, match="done"):
        acc.add(["g"], torch.tensor([[1.0, 0.0]]))


def test_accumulator_round_bound() -> None:
    acc: GroupAccumulator[int] = GroupAccumulator(target_groups=5, max_rounds=2)
    acc.add([0, 1], torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    assert not acc.done
    acc.add([2, 3], torch.tensor([[0.0, 0.0], [0.0, 1.0]]))
    assert acc.done and acc.bound_hit
    assert acc.result() == ([0, 3], True)  # what it has, and the flag


def test_accumulator_unbounded_and_validation() -> None:
    acc: GroupAccumulator[int] = GroupAccumulator(target_groups=1, max_rounds=None)
    for i in range(20):
        acc.add([i], torch.tensor([[1.0, 1.0]]))
    assert not acc.done and acc.stats()["kept_frac"] == 0.0
    with pytest.raises(ValueError, match="groups"):
        acc.add([1, 2], torch.tensor([[1.0, 0.0]]))
    with pytest.raises(ValueError):
        GroupAccumulator(target_groups=0)
    with pytest.raises(ValueError):
        GroupAccumulator(target_groups=1, max_rounds=0)
