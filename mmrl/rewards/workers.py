"""Reward execution, in one import: Ray reward workers with per-call timeouts and failure policies.

The pieces live in focused modules; this one gathers their public names:

  report.py     GroupResult, RewardReport, FailureRecord, RewardFailure (plain data, no Ray)
  scorer.py     GroupScorer: scores a group in one process, each call isolated and timed out;
                plain, batched and async rewards (variants.py); RewardWorker, the Ray actor body
  pool.py       RewardPool: Ray worker actors, submit/as_completed/score, retries, deadlines
  streaming.py  RewardStream: scores groups as the agent loop reports them, overlapping rollout

    pool = RewardPool(cfg_rewards, num_workers=2, timeout_s=30, on_error="zero")
    report = pool.score(samples, groups, decode=processor.decode)   # fills traj.reward(_components)
    report.keep          # per group: False = no gradient for that group (policy drop_group)
    report.metrics()     # reward means + reward/errors, reward/timeouts, reward/dropped_groups, ...
"""
from __future__ import annotations

from mmrl.rewards.pool import RewardHandle, RewardPool
from mmrl.rewards.report import (ON_ERROR_POLICIES, WORKER, FailureRecord, GroupResult, RewardFailure,
                                 RewardReport)
from mmrl.rewards.scorer import GroupScorer
from mmrl.rewards.streaming import RewardStream

__all__ = ["RewardPool", "RewardReport", "GroupResult", "FailureRecord", "RewardFailure", "RewardHandle",
           "GroupScorer", "RewardStream", "ON_ERROR_POLICIES", "WORKER"]
