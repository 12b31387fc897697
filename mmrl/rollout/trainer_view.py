"""A multi-turn response that holds media, re-laid on the trainer's tokens.

The engine sees one vision pad per image; the trainer sees the expanded vision block. When a
tool put an image into the conversation, the rollout worker expands the whole transcript once
(the processor adapter's `expand_traced`) and moves the trajectory onto the trainer's tokens:
each engine token keeps its loss mask, logprob and weight version, and a vision block's tokens
get mask 0 (they are inputs, never sampled). The response's positions (M-RoPE included) and
the new media's vision tensors go into the worker's object store as `ResponseInputs`.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import ray

from mmrl.processors.base import ProcessedPrompt
from mmrl.rollout.types import ResponseInputs, Trajectory


def _media_lists(mm: dict[str, Any] | None) -> dict[str, list[Any]]:
    return {k: list(v) if isinstance(v, (list, tuple)) else [v] for k, v in (mm or {}).items()}


def to_trainer_view(processor: Any, prompt: ProcessedPrompt, t: Trajectory) -> None:
    """Rewrite `t` in place (see the module docstring); a trajectory without new media is left alone."""
    if not t.new_media:
        return
    if not hasattr(processor, "expand_traced"):
        raise TypeError(f"processor {type(processor).__name__} has no expand_traced(): it cannot place media that "
                        f"a tool returned after the prompt; use a text-only tool or add the method to the adapter")
    engine_prompt = list(prompt.vllm_input["prompt_token_ids"])
    media = _media_lists(prompt.vllm_input.get("multi_modal_data"))
    for k, items in t.new_media.items():
        media.setdefault(k, []).extend(items)
    full, source = processor.expand_traced({"prompt_token_ids": engine_prompt + list(t.response_ids),
                                            "multi_modal_data": media})
    P, Pe = prompt.num_tokens, len(engine_prompt)
    if full.prompt_ids[:P] != list(prompt.prompt_ids):
        raise RuntimeError(f"sample {prompt.key!r}: expanding the transcript changed the prompt's own tokens")
    ids, mask, logprobs, versions, routed = [], [], [], [], []
    counts: dict[int, int] = {}
    for j in source[P:]:
        counts[j - Pe] = counts.get(j - Pe, 0) + 1
    for i, j in zip(range(P, len(full.prompt_ids)), source[P:]):
        j -= Pe
        ids.append(full.prompt_ids[i])
        single = counts[j] == 1  # a vision block's tokens share one engine token
        mask.append(t.loss_mask[j] if single else 0)
        logprobs.append(t.behaviour_logprobs[j] if single else 0.0)
        versions.append((t.token_versions[j] if t.token_versions else -1) if single else -1)
        # a routing row belongs to the input before the token: kept where that input is the
        # engine's own previous token (not inside an expanded vision block)
        prev = source[i - 1] - Pe
        same_input = single and (i == P or (prev == j - 1 and counts.get(prev, 0) == 1))
        routed.append(j if same_input else -1)
    tail = {}
    for k, v in full.mm_inputs.items():
        start = prompt.mm_inputs[k].shape[0] if k in prompt.mm_inputs else 0
        if v.shape[0] > start:
            tail[k] = v[start:]
    t.response_ids, t.loss_mask, t.behaviour_logprobs, t.token_versions = ids, mask, logprobs, versions
    if t.routed_experts is not None and routed:
        rec = t.routed_experts
        t.routed_experts = np.stack([rec[j] if j >= 0 else np.full(rec.shape[1:], -1, dtype=rec.dtype) for j in routed])
    t.response_inputs = ray.put(ResponseInputs(positions_AT=full.positions_AP[:, P:], mm_inputs=tail))
    t.new_media = {}
