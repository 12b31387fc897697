"""`mmrl train`: the run from start (or resume) to the end.

Per step: data -> run_step (rollout, rewards, update, weight sync) -> eval -> metrics and trace
-> stability guard -> checkpoint. Rerunning the same command resumes from the newest complete
checkpoint in RUN_DIR/checkpoints (checkpoint.resume=true).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable

import ray
import torch

from mmrl import registry
from mmrl.config.schema import Config
from mmrl.controller.async_rollout import AsyncRollout, run_async_step
from mmrl.controller.checkpoint import (latest_checkpoint, load_checkpoint, remove_leftovers, save_checkpoint,
                                       truncate_metrics)
from mmrl.controller.guard import StabilityGuard
from mmrl.controller.loop import Runtime, evaluate, run_step, start_runtime
from mmrl.controller.metrics import MetricsLogger
from mmrl.controller.prompts import SampleBatches
from mmrl.controller.restarts import rank_failure
from mmrl.data.sample import Sample
from mmrl.utils.schedule import scheduled, warmup_factor
from mmrl.utils.timing import StepSpans
from mmrl.utils.trace import TraceWriter


@dataclass
class TrainHooks:
    """Callbacks for research code and tests, e.g. inject a fault or log extra metrics.
    `before_step(rt, step)` runs before the step's data is read; `after_step(rt, step, metrics)`
    after its metrics are complete (it may add keys)."""

    before_step: Callable[[Runtime, int], None] | None = None
    after_step: Callable[[Runtime, int, dict[str, Any]], None] | None = None


def _open_stream(cfg: Config, rt: Runtime, resume: dict[str, Any] | None) -> Any:
    from mmrl.data.stream import DecodeOptions, ShardStream

    decode = DecodeOptions.from_config(cfg.data.decode, getattr(rt.processor, "media_limits", None))
    return ShardStream(cfg.data.train_shards, shuffle_buffer=cfg.data.shuffle_buffer, seed=cfg.run.seed,
                       num_workers=cfg.data.num_workers, decode=decode, quarantine_path=rt.run_dir / "quarantine.jsonl",
                       max_bad_ratio=cfg.data.max_bad_ratio, min_samples_for_ratio=cfg.data.min_samples_for_ratio,
                       resume=resume)


def _heldout(cfg: Config, rt: Runtime) -> list[Sample]:
    from mmrl.data.stream import DecodeOptions, load_all

    if not cfg.data.heldout_shards:
        return []
    decode = DecodeOptions.from_config(cfg.data.decode, getattr(rt.processor, "media_limits", None))
    samples = load_all(cfg.data.heldout_shards, decode=decode)
    return samples[:cfg.eval.num_prompts] if cfg.eval.num_prompts else samples


def _data_state(cfg: Config, data: dict[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """A checkpoint's data state -> (stream cursor, async window state). A sync checkpoint's
    cursor has nothing in flight, so an async run may start from it; the reverse would lose the
    samples that were in flight."""
    if data is None or data.get("mode") != "async":
        return data, None
    if cfg.rollout.mode.value != "async":
        raise ValueError("this run's checkpoint was written with rollout.mode=async (samples were in flight); "
                         "resume it with rollout.mode=async, or start a new run directory")
    return data["cursor"], data


def _window(cfg: Config, rt: Runtime, batches: SampleBatches, resume: dict[str, Any] | None) -> AsyncRollout | None:
    if cfg.rollout.mode.value != "async":
        return None
    from mmrl.controller.loop import step_seed

    capacity = cfg.rollout.max_buffered_groups or cfg.rollout.prompts_per_step * (cfg.rollout.max_staleness + 1)
    return AsyncRollout(rt, batches, batch_size=cfg.rollout.prompts_per_step, capacity=capacity,
                        max_staleness=cfg.rollout.max_staleness, informative_only=cfg.algorithm.dynamic_sampling.enabled,
                        resume=resume, seed=step_seed(cfg.run.seed, 0x5EED), version=rt.weight_version)


def _trace_step(trace: TraceWriter, step: int, spans: StepSpans) -> None:
    for name, start, duration in spans.events:
        trace.span(name, start, duration, process="train", thread=name, args={"step": step})


def _sync_engines(rt: Runtime, new_version: bool) -> None:
    """Push the trainers' weights to the engines after a restore. On resume the fresh engines get
    the checkpoint's own version (the same weights); after a rollback the engines held newer
    weights, so the restored ones get a new version and versions stay monotonic."""
    rt.push_weights(new_version)


def scheduled_lr(cfg: Config, step: int, lr_scale: float = 1.0) -> float:
    """The learning rate of step `step`: trainer.lr x warm-up x trainer.lr_schedule x the guard's
    lr_scale (a function of the step and the rollbacks so far: resumes are exact)."""
    s = cfg.trainer.lr_schedule
    factor = scheduled(step, 1.0, s.end_factor, s.kind.value, s.start_step, s.steps)
    return cfg.trainer.lr * lr_scale * warmup_factor(step, s.warmup_steps) * factor


def train(cfg: Config, hooks: TrainHooks | None = None) -> dict[str, Any]:
    """Run `cfg` to the end; return a summary (final/best held-out accuracy, steps, wall time)."""
    hooks = hooks or TrainHooks()
    torch.manual_seed(cfg.run.seed)
    rt = start_runtime(cfg)
    advantage_fn = registry.resolve("advantage", cfg.algorithm.advantage)
    guard = StabilityGuard(cfg.stability)
    summary: dict[str, Any] = {"run_dir": str(rt.run_dir), "heldout_curve": [], "rollbacks": []}
    lr_scale, start_step, resume_cursor, wall_offset = 1.0, 1, None, 0.0
    for done in remove_leftovers(rt.run_dir):  # a save or prune that a kill interrupted
        print(f"[mmrl] checkpoints: {done} (left by an interrupted save)")
    ckpt = latest_checkpoint(rt.run_dir) if cfg.checkpoint.resume else None
    stream = logger = trace = step = None
    try:
        if ckpt is None:  # a fresh start: records of an earlier start that never checkpointed go
            truncate_metrics(rt.run_dir, -1)
            truncate_metrics(rt.run_dir, -1, name="batches.jsonl")
        else:
            state = load_checkpoint(ckpt, rt.trainers)
            start_step, rt.weight_version = state["step"] + 1, state["weight_version"]
            resume_cursor, lr_scale, wall_offset = state["data"], state["lr_scale"], state["wall_s"]
            guard.load_state_dict(state["guard"])
            summary.update(state["summary"])
            dropped = truncate_metrics(rt.run_dir, state["step"])
            truncate_metrics(rt.run_dir, state["step"], name="batches.jsonl")
            _sync_engines(rt, new_version=False)
            print(f"[mmrl] resumed from {ckpt} (step {state['step']}; {dropped} later metric lines dropped)")
        resume_cursor, resume_window = _data_state(cfg, resume_cursor)
        stream = _open_stream(cfg, rt, resume_cursor)
        batches = SampleBatches(stream, cfg.rollout.prompts_per_step, processor_name=type(rt.processor).__name__,
                                model_path=cfg.model.path)
        window = _window(cfg, rt, batches, resume_window)
        heldout = _heldout(cfg, rt)
        logger = MetricsLogger(rt.run_dir, total_steps=cfg.run.max_steps, tensorboard=cfg.logging.tensorboard,
                               progress_bar=cfg.logging.progress_bar, console_every=cfg.logging.console_every,
                               start_step=start_step - 1)
        trace = TraceWriter(rt.run_dir / "trace.json")
        rt.startup.mark("data")  # the shard stream opened, the held-out set loaded (and a resume's checkpoint)
        t_start = time.time() - wall_offset
        if heldout and start_step == 1:
            first = evaluate(rt, heldout)
            logger.log(0, {**first, "time/wall_s": 0.0})
            summary["heldout_curve"].append((0, first["eval/heldout_accuracy"], 0.0))
            rt.startup.mark("first_eval")
        last_good = latest_checkpoint(rt.run_dir)
        step = start_step
        # A checkpoint is the last thing a step does, after its records are written: a checkpoint
        # at step N then implies every record up to N exists, whenever the run is killed. Its
        # time counts in the next step (time/checkpoint_s), whose spans start before it.
        spans, t_step = StepSpans(rt.cpu_clock), time.time()
        # what cores/<phase> is out of: the CPUs Ray was given on this machine
        machine = {"cores/available": float(ray.cluster_resources().get("CPU", 0.0))} if rt.cpu_clock else {}
        lr_set = None  # what the trainers hold now (None: unknown, set it)
        while step <= cfg.run.max_steps:
            lr = scheduled_lr(cfg, step, lr_scale)
            if lr != lr_set:
                ray.get([t.set_lr.remote(lr) for t in rt.trainers])
                lr_set = lr
            if hooks.before_step:
                hooks.before_step(rt, step)
            if window is None:
                with spans("data_wait"):
                    samples = batches()
                metrics, used = run_step(rt, samples, advantage_fn, spans, step=step, batches=batches)
            else:
                metrics, used = run_async_step(rt, window, advantage_fn, spans, step)
            wall = time.time() - t_start
            if heldout and cfg.eval.every_steps and (step % cfg.eval.every_steps == 0 or step == cfg.run.max_steps):
                with spans("eval"):
                    metrics.update(evaluate(rt, heldout))
                summary["heldout_curve"].append((step, metrics["eval/heldout_accuracy"], wall))
            verdict = guard.observe(step, metrics)
            metrics.update({
                "data/rejected_prompts": float(len(batches.rejected)),
                "data/bad_samples": float(sum(stream.bad_counts.values())),
                "guard/alarm": float(bool(verdict.reasons)), "guard/rollbacks": float(guard.rollbacks),
                "train/lr_scale": lr_scale, "train/lr": lr,
            })
            if verdict.collapse:
                with spans("rollback"):
                    if window is not None:
                        window.close()
                    lr_scale, data = _rollback(rt, cfg, guard, verdict, step, batches, summary)
                    if window is not None:
                        window = _window(cfg, rt, batches, _data_state(cfg, data)[1])
                lr_set = None
                last_good = latest_checkpoint(rt.run_dir)
                metrics["guard/rollbacks"] = float(guard.rollbacks)
            metrics.update({**spans.metrics(), **machine, "time/step_s": time.time() - t_step, "time/wall_s": wall})
            if step == start_step:  # this process's start-up, through its first step (cold caches and all)
                rt.startup.mark("first_step")
                metrics.update(rt.startup.metrics())
                if rt.cpu_clock is not None:  # what each kind of process spent to get here
                    metrics.update({f"startup_cpu/{k}_s": v for k, v in rt.cpu_clock.by_process().items()})
            if hooks.after_step:
                hooks.after_step(rt, step, metrics)
            logger.log(step, metrics)
            with open(rt.run_dir / "batches.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "keys": [s.key for s in used]}) + "\n")
            _trace_step(trace, step, spans)
            if step % 10 == 0:
                trace.flush()
            summary["steps"] = step
            spans, t_step = StepSpans(rt.cpu_clock), time.time()
            if not verdict.collapse and cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
                with spans("checkpoint"):
                    data = window.state_dict() if window is not None else stream.state_dict()
                    state = {"step": step, "weight_version": rt.weight_version, "data": data,
                             "lr_scale": lr_scale, "wall_s": wall, "guard": guard.state_dict(),
                             "lora_scaling": (cfg.trainer.lora.alpha / cfg.trainer.lora.rank
                                              if cfg.trainer.lora.enabled else None),
                             "summary": {k: summary[k] for k in ("heldout_curve", "rollbacks")}}
                    healthy = not verdict.reasons
                    path = save_checkpoint(rt.run_dir, step, rt.trainers, state, model_path=cfg.model.path,
                                           trust_remote_code=cfg.model.trust_remote_code,
                                           keep_last=cfg.checkpoint.keep_last, protect=None if healthy else last_good)
                    if healthy:
                        last_good = path
            stop = _should_stop(cfg, metrics, wall)
            if stop:
                summary["stopped"] = stop
                break
            step += 1
    except Exception as e:
        died = rank_failure(rt, e, step)  # a trainer rank that died: named, for controller/restarts.py
        if died is not None:
            raise died from e
        raise
    finally:
        if stream is not None:  # its loader processes (a restart in this process opens new ones)
            stream.close()
        if logger is not None:
            logger.close()
        if trace is not None:
            trace.flush()
        rt.close()
    curve = summary["heldout_curve"]
    summary.update(wall_s=time.time() - t_start, final_heldout_accuracy=curve[-1][1] if curve else None,
                   best_heldout_accuracy=max((c[1] for c in curve), default=None),
                   rejected_prompts=len(batches.rejected), bad_samples=dict(stream.bad_counts))
    return summary


def _should_stop(cfg: Config, metrics: dict[str, Any], wall: float) -> str | None:
    acc = metrics.get("eval/heldout_accuracy")
    if cfg.run.stop_at_heldout_accuracy is not None and acc is not None and acc >= cfg.run.stop_at_heldout_accuracy:
        return f"held-out accuracy {acc:.3f} >= {cfg.run.stop_at_heldout_accuracy}"
    if cfg.run.time_limit_s is not None and wall > cfg.run.time_limit_s:
        return f"time limit {cfg.run.time_limit_s}s"
    return None


class CollapseError(RuntimeError):
    pass


def _rollback(rt: Runtime, cfg: Config, guard: StabilityGuard, verdict: Any, step: int, batches: SampleBatches,
              summary: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Restore the newest checkpoint saved before the alarm began and apply the remedy; returns
    the new learning-rate scale and the data state the batches were rewound to (None: kept). Step numbers keep counting forward (metrics stay monotonic);
    `guard/rollbacks` and RUN_DIR/guard.jsonl record what happened."""
    reasons = "; ".join(verdict.reasons)
    target = latest_checkpoint(rt.run_dir, before_step=verdict.first_alarm_step)
    if target is None or guard.rollbacks >= cfg.stability.max_rollbacks:
        why = "no checkpoint before the alarm (set checkpoint.every_steps)" if target is None else \
            f"stability.max_rollbacks={cfg.stability.max_rollbacks} reached"
        raise CollapseError(f"collapse at step {step} ({reasons}) and no rollback possible: {why}")
    state = load_checkpoint(target, rt.trainers)
    lr_scale = state["lr_scale"] * cfg.stability.lr_scale
    ray.get([t.set_lr.remote(scheduled_lr(cfg, step, lr_scale)) for t in rt.trainers])
    _sync_engines(rt, new_version=True)
    data = None
    if not cfg.stability.skip_batches:
        data = state["data"]
        batches.rewind(_data_state(cfg, data)[0])
    guard.after_rollback()
    event = {"at_step": step, "to_step": state["step"], "reasons": verdict.reasons, "lr_scale": lr_scale}
    summary["rollbacks"].append(event)
    with open(rt.run_dir / "guard.jsonl", "a") as f:
        f.write(json.dumps(event) + "\n")
    print(f"[mmrl] collapse at step {step}: {reasons}. Rolled back to {target.name}, learning rate x{lr_scale:g}")
    return lr_scale, data
