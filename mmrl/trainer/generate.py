"""Sampling with the trainer's own model (`rollout.backend: trainer`).

Every ZeRO-3 rank samples its share of the requests with a KV cache, one token per forward for
the whole share. A forward all-gathers the parameters collectively, so all ranks run the same
number of forwards: after each one they agree (all-reduce) whether any rank still has a request
running, and a rank whose share is done (or that only holds a filler) keeps stepping until
then. The tokens are drawn from exactly the distribution the trainer's logprob function
describes (forbidden-token bias, temperature; then top-p), each request with its own generator.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from mmrl.rollout.types import RequestSampling
from mmrl.trainer.batch import model_positions, position_axes

# vLLM clamps a logit bias to +-100; the trainer's logprob function uses the same number.
FORBIDDEN_BIAS = -100.0


@dataclass
class GenerationRequest:
    """One response to sample: the prompt as the trainer sees it (vision blocks expanded) and its settings."""

    prompt_ids: list[int]
    positions_AP: torch.Tensor
    next_position: int
    mm_inputs: dict[str, torch.Tensor]
    sampling: RequestSampling
    # A filler only keeps a rank without requests in step with the others; its tokens are discarded.
    filler: bool = False


@dataclass
class Generated:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" (an end-of-sequence token or a stop string) | "length"


def _prefill_inputs(requests: Sequence[GenerationRequest], pad_id: int) -> dict[str, Any]:
    """Left-padded prompts (every row's next token is in the last column), their positions (the
    adapter's A axes) and vision tensors."""
    B, P = len(requests), max(len(r.prompt_ids) for r in requests)
    input_ids = torch.full((B, P), pad_id, dtype=torch.long)
    attention = torch.zeros((B, P), dtype=torch.long)
    positions = torch.zeros((position_axes(requests), B, P), dtype=torch.long)
    for i, r in enumerate(requests):
        n = len(r.prompt_ids)
        input_ids[i, P - n:] = torch.tensor(r.prompt_ids)
        attention[i, P - n:] = 1
        positions[:, i, P - n:] = r.positions_AP
    keys = sorted({k for r in requests for k in r.mm_inputs})
    mm = {k: torch.cat([r.mm_inputs[k] for r in requests if k in r.mm_inputs]) for k in keys}
    return {"input_ids": input_ids, "attention_mask": attention, "position_ids": model_positions(positions), **mm}


def _draw(logits_V: torch.Tensor, sampling: RequestSampling, generator: torch.Generator | None) -> int:
    logits = logits_V.float()
    if sampling.forbidden_token_ids:
        logits = logits.clone()
        logits[list(sampling.forbidden_token_ids)] += FORBIDDEN_BIAS
    if sampling.greedy:
        return int(logits.argmax())
    # shifted so the top logit is 0: a tiny temperature then gives (1, 0, ...) instead of inf/inf = nan
    probs = torch.softmax((logits - logits.max()) / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # keep the smallest set whose mass reaches top_p (the most likely token always stays, even
        # for a top_p that rounds to 0)
        drop = sorted_p.cumsum(0) - sorted_p >= sampling.top_p
        drop[0] = False
        probs = probs.clone()
        probs[order[drop]] = 0.0
    return int(torch.multinomial(probs, 1, generator=generator))


def _generator(sampling: RequestSampling) -> torch.Generator:
    g = torch.Generator()
    if sampling.seed is None:
        g.seed()
    else:
        g.manual_seed(int(sampling.seed) % 2**63)
    return g


def sample_responses(forward: Callable[..., Any], requests: Sequence[GenerationRequest], *, pad_id: int,
                     eos_token_ids: Sequence[int], all_done: Callable[[bool], bool],
                     decode: Callable[[list[int]], str] | None = None,
                     prefill_context: Callable[[dict[str, torch.Tensor]], Any] | None = None) -> list[Generated]:
    """Sample every request to its end (see the module docstring). `forward(**inputs)` is the
    model; `all_done(local_done)` is True once every rank is done (a collective); `decode`
    renders tokens for stop strings; `prefill_context(mm_inputs)` wraps the first forward (the
    vision tower must run on every rank)."""
    eos = set(eos_token_ids)
    inputs = _prefill_inputs(requests, pad_id)
    mm = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "position_ids")}
    attention = inputs["attention_mask"]
    generators = [None if r.sampling.greedy else _generator(r.sampling) for r in requests]
    out_ = [Generated() for _ in requests]
    done = [r.filler or r.sampling.max_tokens <= 0 for r in requests]
    next_pos = torch.tensor([r.next_position for r in requests])
    axes = position_axes(requests)
    with prefill_context(mm) if prefill_context is not None else nullcontext():
        out = forward(**inputs, use_cache=True, logits_to_keep=1)
    step = 0
    while True:
        fed = torch.full((len(requests), 1), pad_id, dtype=torch.long)
        for b, r in enumerate(requests):
            if done[b]:
                continue
            token = _draw(out.logits[b, -1], r.sampling, generators[b])
            gen = out_[b]
            gen.token_ids.append(token)
            fed[b, 0] = token
            s = r.sampling
            if token in eos and not s.ignore_eos:
                done[b], gen.finish_reason = True, "stop"
            elif s.stop and decode is not None and any(x in decode(gen.token_ids) for x in s.stop):
                done[b], gen.finish_reason = True, "stop"
            elif len(gen.token_ids) >= s.max_tokens:
                done[b] = True
        if all_done(all(done)):
            return out_
        attention = torch.cat([attention, torch.ones((len(requests), 1), dtype=torch.long)], dim=1)
        positions = model_positions((next_pos + step).view(1, -1, 1).expand(axes, -1, 1))
        out = forward(input_ids=fed, attention_mask=attention, position_ids=positions,
                      past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
        step += 1
