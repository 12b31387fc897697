"""Stability guard: declares a collapse from per-step metrics by configurable rules.

RL runs on VLMs die by collapse: reward falls off a cliff, entropy goes to 0 (or explodes),
the KL or the gradient norm shoots up, the sampler and the trainer drift apart, or the policy
slowly forgets what it had learned (held-out accuracy sinks while the training reward, sampled
at temperature, still looks fine). Each rule below watches one of those; a rule that holds for
`patience` consecutive steps (after `warmup_steps`) declares a collapse. The loop then rolls
back to the newest checkpoint saved before the first alarming step (for the held-out rule: at
or before the last healthy evaluation) and applies the remedy (StabilityConfig).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmrl.config.schema import StabilityConfig


@dataclass
class Verdict:
    collapse: bool
    reasons: list[str] = field(default_factory=list)
    first_alarm_step: int | None = None  # the first step of the alarming streak


def _threshold_rules(cfg: StabilityConfig) -> list[tuple[str, str, str, float]]:
    """(rule name, metric, direction, threshold) for the simple bound checks that are switched on."""
    rules = [("min_entropy", "actor/entropy", "below", cfg.min_entropy),
             ("max_entropy", "actor/entropy", "above", cfg.max_entropy),
             ("max_kl", "actor/kl", "above", cfg.max_kl),
             ("max_clip_fraction", "actor/clip_fraction", "above", cfg.max_clip_fraction),
             ("max_grad_norm", "actor/grad_norm_max", "above", cfg.max_grad_norm),
             ("max_mismatch", "mismatch/mean_abs_logprob_diff", "above", cfg.max_mismatch)]
    return [(n, m, d, float(t)) for n, m, d, t in rules if t is not None]


class StabilityGuard:
    def __init__(self, cfg: StabilityConfig):
        self.cfg = cfg
        self.rewards: deque[float] = deque(maxlen=max(cfg.window, 1))
        self.best_reward_window = -np.inf
        self.streak = 0
        self.streak_start: int | None = None
        self.rollbacks = 0
        self.best_heldout = -np.inf
        self.last_healthy_eval_step: int | None = None
        self.heldout_alarm: str | None = None  # stands from a bad evaluation until the next one

    def observe(self, step: int, metrics: dict[str, Any]) -> Verdict:
        """Feed one step's metrics; returns whether the run has collapsed."""
        if not self.cfg.enabled:
            return Verdict(False)
        reasons = []
        reward = metrics.get("reward/mean")
        if reward is not None and np.isfinite(reward):
            self.rewards.append(float(reward))
        if len(self.rewards) == self.rewards.maxlen:
            window_mean = float(np.mean(self.rewards))
            if (self.cfg.reward_drop is not None and step > self.cfg.warmup_steps
                    and window_mean < self.best_reward_window - self.cfg.reward_drop):
                reasons.append(f"reward: window mean {window_mean:.3f} is more than {self.cfg.reward_drop} below "
                               f"its best {self.best_reward_window:.3f}")
            if not reasons:  # the best is only updated on healthy steps
                self.best_reward_window = max(self.best_reward_window, window_mean)
        self._observe_heldout(step, metrics.get("eval/heldout_accuracy"))
        if self.heldout_alarm:
            reasons.append(self.heldout_alarm)
        for name, metric, direction, threshold in _threshold_rules(self.cfg):
            value = metrics.get(metric)
            if value is None:
                continue
            bad = (not np.isfinite(value)) or (value < threshold if direction == "below" else value > threshold)
            if bad and step > self.cfg.warmup_steps:
                reasons.append(f"{metric} = {value:.4g} is {direction} {name} = {threshold:g}")
        if reasons:
            if self.streak == 0:
                self.streak_start = step
            self.streak += 1
        else:
            self.streak, self.streak_start = 0, None
        if self.streak >= self.cfg.patience:
            first = self.streak_start
            if self.heldout_alarm and self.last_healthy_eval_step is not None:
                # checkpoints after the last healthy evaluation may already hold the decline
                first = min(first, self.last_healthy_eval_step + 1)
            return Verdict(True, reasons, first)
        return Verdict(False, reasons)

    def _observe_heldout(self, step: int, accuracy: float | None) -> None:
        if accuracy is None or self.cfg.heldout_drop is None:
            return
        if step > self.cfg.warmup_steps and accuracy < self.best_heldout - self.cfg.heldout_drop:
            self.heldout_alarm = (f"eval/heldout_accuracy = {accuracy:.3f} is more than {self.cfg.heldout_drop} below "
                                  f"its best {self.best_heldout:.3f}")
        else:
            self.heldout_alarm = None
            self.best_heldout = max(self.best_heldout, float(accuracy))
            self.last_healthy_eval_step = step

    def after_rollback(self) -> None:
        """Start watching afresh (the restored policy gets a new warm window)."""
        self.rollbacks += 1
        self.rewards.clear()
        self.streak, self.streak_start = 0, None
        self.heldout_alarm = None  # the restored weights were healthy when evaluated

    def state_dict(self) -> dict[str, Any]:
        return {"rewards": list(self.rewards), "best_reward_window": self.best_reward_window, "streak": self.streak,
                "streak_start": self.streak_start, "rollbacks": self.rollbacks, "best_heldout": self.best_heldout,
                "last_healthy_eval_step": self.last_healthy_eval_step, "heldout_alarm": self.heldout_alarm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rewards = deque(state["rewards"], maxlen=max(self.cfg.window, 1))
        self.best_reward_window = state["best_reward_window"]
        self.streak, self.streak_start = state["streak"], state["streak_start"]
        self.rollbacks = state["rollbacks"]
        self.best_heldout = state.get("best_heldout", -np.inf)
        self.last_healthy_eval_step = state.get("last_healthy_eval_step")
        self.heldout_alarm = state.get("heldout_alarm")
