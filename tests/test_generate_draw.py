"""The transformers sampler's draw (`mmrl.trainer.generate._draw`) at the edges of its parameters:
what `mmrl serve`'s trainer sampler and the trainer engine accept must sample, not fail."""
from __future__ import annotations

import torch

from mmrl.rollout.types import RequestSampling
from mmrl.trainer.generate import _draw


def test_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    logits_V = torch.tensor([0.0, 3.0, 1.0, -2.0])
    for top_p in (1e-50, 0.0, 1e-8):
        draws = {_draw(logits_V, RequestSampling(top_p=top_p), torch.Generator().manual_seed(s)) for s in range(20)}
        assert draws == {1}, (top_p, draws)


def test_a_tiny_temperature_samples_the_argmax_instead_of_nan():
    logits_V = torch.tensor([0.5, -1.0, 2.5, 2.0])
    for temperature in (1e-30, 1e-45):
        draws = {_draw(logits_V, RequestSampling(temperature=temperature), torch.Generator().manual_seed(s))
                 for s in range(20)}
        assert draws == {2}, (temperature, draws)


def test_a_normal_draw_still_follows_the_distribution():
    """The shift by the top logit changes nothing at an ordinary temperature: frequencies match softmax."""
    logits_V = torch.tensor([0.0, 1.0, 2.0])
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([_draw(logits_V, RequestSampling(temperature=1.0), g) for _ in range(4000)]),
                            minlength=3).float() / 4000
    torch.testing.assert_close(counts, torch.softmax(logits_V, -1), atol=0.03, rtol=0)
