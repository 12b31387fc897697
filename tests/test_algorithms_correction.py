"""Rollout-correction weights, masks and stats on a crafted sampler/trainer mismatch."""
from __future__ import annotations

import math

import pytest
import torch

from mmrl.algorithms import rollout_correction

ATOL = 1e-5
NAN, NEG_INF = float("nan"), float("-inf")


def close(a, b) -> None:
    a = torch.as_tensor(a)
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=ATOL, rtol=0)


def _mismatch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ratios π_old/μ: row 0 = [3, 0.5, 1 | pad], row 1 = [1.5, 1.2 | pad, pad].

    Sequence ratios (products): row 0 = 1.5, row 1 = 1.8.
    Geometric: row 0 = 1.5^(1/3) = 1.144714, row 1 = 1.8^(1/2) = 1.341641.
    """
    behaviour = torch.tensor([[-1.0, -2.0, -0.5, NEG_INF], [-1.0, -1.0, NEG_INF, NAN]])
    delta = torch.tensor([[math.log(3.0), math.log(0.5), 0.0, 0.0], [math.log(1.5), math.log(1.2), 0.0, 0.0]])
    old = behaviour + delta
    old[0, 3], old[1, 2] = NAN, 7.0  # garbage at padding
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    return old, behaviour, mask


def test_token_tis() -> None:
    old, beh, mask = _mismatch()
    w, m, st = rollout_correction(old, beh, mask, mode="tis", level="token", threshold=2.0)
    close(w, [[2.0, 0.5, 1.0, 0.0], [1.5, 1.2, 0.0, 0.0]])  # 3 is truncated to C = 2
    assert m.dtype == mask.dtype and torch.equal(m, mask)
    assert w.dtype == torch.float32 and not w.requires_grad
    assert st["frac_tokens_truncated"] == pytest.approx(1 / 5)
    assert st["frac_seqs_truncated"] == pytest.approx(1 / 2)
    assert st["frac_tokens_masked"] == 0.0 and st["frac_seqs_masked"] == 0.0
    assert st["weight_mean"] == pytest.approx((2 + 0.5 + 1 + 1.5 + 1.2) / 5)


def test_mismatch_stats() -> None:
    old, beh, mask = _mismatch()
    _, _, st = rollout_correction(old, beh, mask, mode="none")
    # |Δ| = [ln 3, ln 2, 0 | ln 1.5, ln 1.2] = [1.098612, 0.693147, 0, 0.405465, 0.182322]
    assert st["abs_logprob_diff_mean"] == pytest.approx(0.475909, abs=ATOL)
    assert st["abs_logprob_diff_max"] == pytest.approx(1.098612, abs=ATOL)
    # per-sequence mean |Δ|: 1.791759/3 = 0.597253 ; 0.587787/2 = 0.293893
    assert st["seq_abs_logprob_diff_mean"] == pytest.approx((0.597253 + 0.293893) / 2, abs=ATOL)
    assert st["seq_abs_logprob_diff_max"] == pytest.approx(0.597253, abs=ATOL)
    assert st["ratio_mean"] == pytest.approx(7.2 / 5, abs=ATOL)
    assert (st["ratio_min"], st["ratio_max"]) == (pytest.approx(0.5), pytest.approx(3.0))
    assert st["seq_ratio_mean"] == pytest.approx(1.65, abs=ATOL)
    assert (st["seq_ratio_min"], st["seq_ratio_max"]) == (pytest.approx(1.5), pytest.approx(1.8))
    assert all(isinstance(v, float) for v in st.values())


def test_none_mode_is_identity() -> None:
    old, beh, mask = _mismatch()
    w, m, st = rollout_correction(old, beh, mask.bool(), mode="none", level="sequence")
    close(w, mask.float())
    assert m.dtype == torch.bool and torch.equal(m, mask.bool())
    assert st["weight_mean"] == 1.0


def test_sequence_and_geometric_tis() -> None:
    old, beh, mask = _mismatch()
    w, _, st = rollout_correction(old, beh, mask, mode="tis", level="sequence", threshold=2.0)
    close(w, [[1.5, 1.5, 1.5, 0.0], [1.8, 1.8, 0.0, 0.0]])
    assert st["frac_tokens_truncated"] == 0.0
    w, _, st = rollout_correction(old, beh, mask, mode="tis", level="sequence", threshold=1.6)
    close(w, [[1.5, 1.5, 1.5, 0.0], [1.6, 1.6, 0.0, 0.0]])  # 1.8 truncated to 1.6
    assert st["frac_tokens_truncated"] == pytest.approx(2 / 5)
    assert st["frac_seqs_truncated"] == pytest.approx(1 / 2)
    w, _, _ = rollout_correction(old, beh, mask, mode="tis", level="geometric", threshold=2.0)
    close(w, [[1.144714] * 3 + [0.0], [1.341641] * 2 + [0.0, 0.0]])


def test_token_mis_and_rs() -> None:
    old, beh, mask = _mismatch()
    # keep ratios in [0.6, 2]: row 0 drops 3 (above) and 0.5 (below), row 1 keeps both
    w, m, st = rollout_correction(old, beh, mask, mode="mis", level="token", threshold=2.0, threshold_low=0.6)
    close(w, [[0.0, 0.0, 1.0, 0.0], [1.5, 1.2, 0.0, 0.0]])  # kept tokens weighted by their ratio
    assert m.tolist() == [[0, 0, 1, 0], [1, 1, 0, 0]]
    assert st["frac_tokens_masked"] == pytest.approx(2 / 5)
    assert st["frac_seqs_masked"] == pytest.approx(1 / 2)
    assert st["frac_tokens_truncated"] == 0.0
    assert st["weight_mean"] == pytest.approx((1 + 1.5 + 1.2) / 3)
    w, m2, _ = rollout_correction(old, beh, mask, mode="rs", level="token", threshold=2.0, threshold_low=0.6)
    close(w, [[0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # rejection only: kept weight 1
    assert torch.equal(m2, m)
    # without a lower bound only the 3 goes
    _, m3, _ = rollout_correction(old, beh, mask, mode="mis", threshold=2.0)
    assert m3.tolist() == [[0, 1, 1, 0], [1, 1, 0, 0]]


def test_sequence_mis_and_geometric_rs() -> None:
    old, beh, mask = _mismatch()
    # Seq-MIS, C = 1.6: row 0 (1.5) kept with weight 1.5, row 1 (1.8) rejected entirely
    w, m, st = rollout_correction(old, beh, mask, mode="mis", level="sequence", threshold=1.6)
    close(w, [[1.5, 1.5, 1.5, 0.0], [0.0] * 4])
    assert m.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]
    assert st["frac_tokens_masked"] == pytest.approx(2 / 5)
    assert st["frac_seqs_masked"] == pytest.approx(1 / 2)
    # Geo-RS, C = 1.2: row 0 (1.144714) kept, row 1 (1.341641) rejected
    w, m, _ = rollout_correction(old, beh, mask, mode="rs", level="geometric", threshold=1.2)
    close(w, [[1.0, 1.0, 1.0, 0.0], [0.0] * 4])
    assert m.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]


def test_extremes_bf16_and_empty() -> None:
    # log-ratio 100 is clamped to 20 before exp(): finite, truncated at C
    w, _, st = rollout_correction(torch.tensor([[100.0]]), torch.tensor([[0.0]]), torch.ones(1, 1), threshold=2.0)
    close(w, [[2.0]])
    assert st["ratio_max"] == pytest.approx(math.exp(20.0), rel=1e-5)
    # bf16 inputs: weights come back fp32
    w, _, _ = rollout_correction(torch.zeros(1, 2, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.bfloat16),
                                 torch.ones(1, 2))
    assert w.dtype == torch.float32
    close(w, [[1.0, 1.0]])
    # nothing valid: zero weights, zero stats, no nan
    w, m, st = rollout_correction(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2), mode="mis")
    close(w, torch.zeros(2, 2))
    assert all(v == 0.0 for v in st.values())


def test_bad_arguments() -> None:
    old, beh, mask = _mismatch()
    with pytest.raises(ValueError, match="tis"):
        rollout_correction(old, beh, mask, mode="icepop")
    with pytest.raises(ValueError, match="geometric"):
        rollout_correction(old, beh, mask, level="seq")
    with pytest.raises(ValueError, match="threshold_low"):
        rollout_correction(old, beh, mask, mode="mis", threshold=2.0, threshold_low=3.0)
    # unknown keywords from a shared config dict are ignored
    rollout_correction(old, beh, mask, mode="tis", some_other_option=1)
