"""Rollout routing replay (R3, Ma et al. 2025) in the trainer's forward.

The rollout engine records, for every generated token, the top-k experts each MoE layer chose in
the forward that sampled it (`Trajectory.routed_experts`, (T, MoE layers, k); row t is the
routing of the input at position P - 1 + t, the position whose logits give token t). Here every
MoE router of the trainer's model gets a forward hook which, for those positions:

  * `algorithm.routing_replay: rollout` replaces the router's own top-k indices by the engine's,
    and recomputes the gate weights from the trainer's router logits at those indices
    (softmax over all experts, gathered, renormalised: what transformers' Qwen3-MoE router
    does with its own choice), so the router still gets gradients;
  * in both modes counts how often the trainer's own top-k set equals the engine's
    (`mismatch/router_agreement`).

Positions without a record (the prompt before its last token, tokens a tool wrote, right padding)
keep the trainer's own routing: the engine computes a group's shared prompt once, or takes it
from its prefix cache, so most requests never route their prompt (rollout/routing_capture.py).
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np
import torch

MODES = ("off", "rollout")


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k routers of the model's MoE layers in layer order (transformers' Qwen3-(VL-)MoE
    family: `...layers.N.mlp.gate` modules with `top_k` and `num_experts`)."""
    found: list[tuple[int, torch.nn.Module]] = []
    for name, module in model.named_modules():
        m = re.search(r"layers\.(\d+)\.mlp\.gate$", name)
        if m and hasattr(module, "top_k") and hasattr(module, "num_experts"):
            found.append((int(m.group(1)), module))
    return [module for _, module in sorted(found, key=lambda x: x[0])]


def replay_rows(seqs: Sequence[Any], mb: Any) -> torch.Tensor | None:
    """(N, MoE layers, k) expert ids for the N = B * L rows of the micro-batch's flattened
    input, -1 where the trainer routes itself; None when no sequence carries a record.
    Response token t of sequence i is predicted by the input row `logits_to_keep` names."""
    records = [getattr(s, "routed_experts", None) for s in seqs]
    shape = next((r.shape[1:] for r in records if r is not None), None)
    if shape is None:
        return None
    B, L = mb.input_ids_BL.shape
    rows = torch.full((B * L, *shape), -1, dtype=torch.long)
    keep = mb.logits_to_keep
    packed = mb.attention_mask_BL is None  # one row, each sequence's kept columns in turn
    offset = 0
    for i, (s, rec) in enumerate(zip(seqs, records)):
        n = len(s.response_ids)
        if rec is not None:
            if rec.shape[0] != n:
                raise ValueError(f"routed experts of {rec.shape[0]} tokens for a response of {n}")
            flat = keep[offset:offset + n] if packed else i * L + keep[:n]
            rows[flat] = torch.from_numpy(np.asarray(rec, dtype=np.int64))
        offset += n
    return rows


class RoutingReplay:
    """Hooks on the model's MoE routers; `use(rows)` sets the rows of the next forward (kept
    until the next `use`, so that a gradient-checkpointing recompute replays the same choice)."""

    def __init__(self, model: torch.nn.Module, mode: str):
        if mode not in MODES:
            raise ValueError(f"algorithm.routing_replay must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.routers = moe_routers(model)
        self.rows: torch.Tensor | None = None
        self.measuring = False
        self.agree = 0.0  # (token, layer) pairs whose top-k sets match the engine's
        self.pairs = 0.0
        self._handles = [r.register_forward_hook(self._hook(j)) for j, r in enumerate(self.routers)]

    def use(self, rows: torch.Tensor | None, measure: bool) -> None:
        if rows is not None and rows.shape[1] != len(self.routers):
            raise ValueError(f"routed experts for {rows.shape[1]} MoE layers, the model has {len(self.routers)}")
        self.rows, self.measuring = rows, measure

    def take_counts(self) -> dict[str, float]:
        out = {"router_agree": self.agree, "router_pairs": self.pairs}
        self.agree = self.pairs = 0.0
        return out

    def _hook(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, inputs: Any, output: tuple[torch.Tensor, ...]) -> Any:
            if self.rows is None:
                return None
            logits, _, own = output
            target = self.rows[:, layer].to(own.device)
            if target.shape[0] != own.shape[0]:
                raise RuntimeError(f"routing replay: {target.shape[0]} rows recorded, the router saw {own.shape[0]}")
            valid = target[:, 0] >= 0
            if self.measuring:
                same = (own[valid].sort(dim=-1).values == target[valid].sort(dim=-1).values).all(dim=-1)
                self.agree += float(same.sum())
                self.pairs += float(valid.sum())
            if self.mode != "rollout":
                return None
            index = torch.where(valid[:, None], target, own)
            # the trainer's own router probabilities at the replayed experts: gradients reach it
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            weights = probs.gather(1, index)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), index
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
