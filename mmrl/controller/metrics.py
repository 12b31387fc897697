"""Metrics sinks: a JSONL file, TensorBoard, and the console (progress bar + periodic lines)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from tqdm import tqdm


class MetricsLogger:
    def __init__(self, run_dir: Path, *, total_steps: int, tensorboard: bool = True, progress_bar: bool = True,
                 console_every: int = 10, start_step: int = 0):
        self.path = run_dir / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: a resumed run overwrites what the killed run logged after its checkpoint
            self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)
        self._bar = (tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
                     if progress_bar else None)
        self.console_every = console_every
        self.last_heldout: float | None = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **metrics}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
        if "eval/heldout_accuracy" in metrics:
            self.last_heldout = metrics["eval/heldout_accuracy"]
        if self._bar is not None:
            postfix = {"reward": f"{metrics.get('reward/mean', float('nan')):.3f}",
                       "step_s": f"{metrics.get('time/step_s', float('nan')):.2f}"}
            if self.last_heldout is not None:
                postfix["heldout"] = f"{self.last_heldout:.3f}"
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(1 if step > 0 else 0)  # step 0 is the evaluation before training
        if self.console_every and step % self.console_every == 0:
            keys = ["reward/mean", "eval/heldout_accuracy", "loss/pg", "actor/entropy", "actor/clip_fraction",
                    "mismatch/mean_abs_logprob_diff", "time/step_s"]
            line = " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
            (self._bar.write if self._bar is not None else print)(f"[step {step}] {line}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        self._file.close()


def rollout_metrics(groups: Sequence[Sequence[Any]]) -> dict[str, float]:
    """Per-step means over the trained trajectories: response length, and for multi-turn loops
    their counters (`agent/turns`, `agent/tool_calls`, `agent/tool_errors`, ...) and the share
    of trajectories that ended on each finish reason of a tool episode."""
    trajectories = [t for g in groups for t in g]
    if not trajectories:
        return {}
    out = {"rollout/response_length": float(sum(len(t.response_ids) for t in trajectories) / len(trajectories))}
    keys = sorted({k for t in trajectories for k in t.stats})
    for k in keys:
        out[f"agent/{k}"] = float(sum(t.stats.get(k, 0.0) for t in trajectories) / len(trajectories))
    if keys:
        for reason in ("done", "stop", "length", "tool_error"):
            out[f"agent/finished_{reason}"] = sum(t.finish_reason == reason for t in trajectories) / len(trajectories)
    return out


def weight_sync_metrics(sync: dict[str, float]) -> dict[str, float]:
    """What a weight push reports: MB sent and, for a real sync, the buckets and the engines'
    load time (the rest of `time/weight_sync_s` is gathering, serialising and sending)."""
    out = {"weight_sync/mb": sync["mb"]}
    if "apply_s" in sync:
        out.update({"weight_sync/apply_s": sync["apply_s"], "weight_sync/buckets": sync["buckets"]})
    if "engine_peak_staged_mb" in sync:  # the most an engine held staged at once (weight_sync.transport)
        out["weight_sync/engine_peak_staged_mb"] = sync["engine_peak_staged_mb"]
    # rank 0's parts of the sync: gathers, copies into full tensors, the transport's send, and
    # the wait for the engines to take the last buckets and load (finish_s, apply_s inside it)
    for part in ("gather_s", "copy_s", "send_s", "finish_s"):
        if part in sync:
            out[f"weight_sync/{part}"] = sync[part]
    return out
