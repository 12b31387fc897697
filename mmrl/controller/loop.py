"""The synchronous RL loop: data -> processor -> rollout -> rewards -> advantages -> train ->
weight sync, with held-out evaluation and metrics every step."""
from __future__ import annotations

import json
import math
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import ray
import torch

from mmrl import registry
from mmrl.config.load import to_yaml
from mmrl.config.schema import Config
from mmrl.controller.metrics import MetricsLogger
from mmrl.controller.placement import placement_plan
from mmrl.data.quarantine import BadSample
from mmrl.data.sample import Sample
from mmrl.processors import ProcessedPrompt, build_processor
from mmrl.processors.base import PromptRejected
from mmrl.rewards.workers import RewardPool
from mmrl.rollout.agent_loops import RolloutContext
from mmrl.rollout.engine import RolloutEngine, engine_kwargs
from mmrl.rollout.types import SamplingConfig, Trajectory
from mmrl.trainer.batch import TrainSequence
from mmrl.utils import split_even
from mmrl.trainer.worker import StepInputs, TrainerSpec, make_trainer_actors
from mmrl.utils.env import apply_env, cleanup_shm, engine_env, resolve_device, rpc_dir
from mmrl.utils.timing import StepSpans


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Runtime:
    """The live processes of a run (kept together so tests can drive them step by step)."""

    cfg: Config
    run_dir: Path
    device: str
    processor: Any
    rewards: RewardPool
    sampling: SamplingConfig
    engines: list[Any]
    trainers: list[Any]
    weight_version: int = 0

    def close(self) -> None:
        self.rewards.close()
        try:
            ray.get([a.shutdown.remote() for a in self.trainers + self.engines], timeout=60)
        except Exception as e:  # still kill the actors below; say why the clean stop failed
            print(f"[mmrl] warning: clean shutdown failed ({type(e).__name__}: {e}); killing actors")
        for actor in self.engines + self.trainers:
            ray.kill(actor)
        if self.device == "cpu":
            cleanup_shm()
        shutil.rmtree(rpc_dir(self.run_dir), ignore_errors=True)


def start_runtime(cfg: Config) -> Runtime:
    """Start Ray, the rollout engines and the trainer ranks for `cfg`."""
    run_dir = Path(cfg.run.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    device = resolve_device(cfg.cluster.device.value)
    env = engine_env(run_dir, device, {"VLLM_LOGGING_LEVEL": "WARNING", **cfg.rollout.engine_env})
    apply_env(env)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        if cfg.cluster.ray_address:
            ray.init(address=cfg.cluster.ray_address, runtime_env={"env_vars": env})
        else:
            ray.init(num_cpus=cfg.cluster.num_cpus or os.cpu_count(), include_dashboard=False,
                     runtime_env={"env_vars": env}, log_to_driver=True)

    processor = build_processor(cfg.processor.name, cfg.model.path, min_pixels=cfg.processor.min_pixels,
                                max_pixels=cfg.processor.max_pixels, max_prompt_tokens=cfg.processor.max_prompt_tokens,
                                trust_remote_code=cfg.model.trust_remote_code)
    forbidden = processor.forbidden_token_ids if cfg.rollout.forbid_vision_tokens else []
    sampling = SamplingConfig(n=cfg.rollout.group_size, max_new_tokens=cfg.rollout.max_new_tokens,
                              temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                              forbidden_token_ids=forbidden, seed=None)
    plan = placement_plan(cfg, device)
    llm_kwargs = engine_kwargs(cfg.model.path, cfg.model.dtype.value, cfg.run.seed, cfg.rollout.engine_args)
    llm_kwargs.setdefault("trust_remote_code", cfg.model.trust_remote_code)
    if device == "cpu":
        llm_kwargs.setdefault("enforce_eager", True)
    engines = [RolloutEngine.as_actor(p.ray_options(), {**llm_kwargs, "seed": cfg.run.seed + p.index}, env)
               for p in plan if p.role == "rollout"]
    trainer_opts = next(p for p in plan if p.role == "trainer").ray_options()
    spec = TrainerSpec(
        model_path=cfg.model.path, dtype=cfg.model.dtype.value, world_size=cfg.trainer.world_size,
        master_addr="127.0.0.1", master_port=_free_port(), device=device, lr=cfg.trainer.lr,
        betas=(cfg.trainer.betas[0], cfg.trainer.betas[1]), weight_decay=cfg.trainer.weight_decay,
        grad_clip=cfg.trainer.grad_clip, deepspeed=dict(cfg.trainer.deepspeed),
        temperature=cfg.rollout.temperature, forbidden_token_ids=forbidden, pad_token_id=processor.pad_token_id,
        policy_loss=cfg.algorithm.policy_loss,
        policy_loss_args={"clip_low": cfg.algorithm.clip_low, "clip_high": cfg.algorithm.clip_high},
        loss_agg=cfg.algorithm.loss_agg.value, entropy_coef=cfg.algorithm.entropy_coef, seed=cfg.run.seed,
        env=env, trust_remote_code=cfg.model.trust_remote_code)
    trainers = make_trainer_actors(spec, trainer_opts)
    rewards = RewardPool([{"name": r.name, "weight": r.weight, "args": dict(r.args)} for r in cfg.rewards],
                         num_workers=cfg.reward_execution.num_workers, timeout_s=cfg.reward_execution.timeout_s,
                         on_error=cfg.reward_execution.on_error.value)
    ray.get([t.setup.remote() for t in trainers] + [e.ready.remote() for e in engines])
    return Runtime(cfg=cfg, run_dir=run_dir, device=device, processor=processor, rewards=rewards,
                   sampling=sampling, engines=engines, trainers=trainers)


def _prompts(processor: Any, samples: list[Sample], rejected: set[str],
             ledger: Any = None) -> list[tuple[Sample, ProcessedPrompt]]:
    """Process samples; a rejected prompt is skipped, counted, and (for the training stream)
    written to the quarantine report like any other bad sample."""
    out = []
    for s in samples:
        try:
            out.append((s, processor(s)))
        except PromptRejected as e:
            rejected.add(s.key)
            if ledger is not None:
                ledger.record_bad(BadSample("prompt_rejected", s.key, s.source, str(e)), already_counted=True)
    return out


def evaluate(rt: Runtime, heldout: list[tuple[Sample, ProcessedPrompt]]) -> dict[str, float]:
    """Greedy decoding on the held-out prompts; correct when the reward score >= eval.threshold."""
    loop = registry.resolve("agent_loop", rt.cfg.rollout.agent_loop)
    greedy = SamplingConfig(n=1, max_new_tokens=rt.sampling.max_new_tokens, temperature=1.0,
                            forbidden_token_ids=rt.sampling.forbidden_token_ids, greedy=True)
    groups = loop(RolloutContext(rt.engines, greedy, rt.weight_version), [p for _, p in heldout])
    samples = [s for s, _ in heldout]
    rt.rewards.score(samples, groups, decode=rt.processor.decode, on_error="zero")
    correct = [g[0].reward >= rt.cfg.eval.threshold for g in groups]
    metrics = {"eval/heldout_accuracy": float(np.mean(correct)), "eval/num_prompts": float(len(correct))}
    # Accuracy per answer (when answers are a small set of labels) shows which class is stuck.
    answers = [s.answer for s in samples]
    if all(isinstance(a, str) for a in answers) and len(set(answers)) <= 20:
        for label in sorted(set(answers)):
            hits = [c for c, a in zip(correct, answers) if a == label]
            metrics[f"eval/accuracy_by_answer/{label}"] = float(np.mean(hits))
    examples = [{"key": s.key, "answer": s.answer, "response": g[0].text, "reward": g[0].reward}
                for s, g in list(zip(samples, groups))[:8]]
    with open(rt.run_dir / "eval_samples.jsonl", "a") as f:
        f.write(json.dumps({"weight_version": rt.weight_version, "examples": examples}) + "\n")
    return metrics


def build_step_inputs(prompts: list[ProcessedPrompt], groups: list[list[Trajectory]], advantages_BG: torch.Tensor,
                      world_size: int, micro_batch_size: int, loss_agg: str) -> list[StepInputs]:
    from mmrl.algorithms.losses import aggregate_denominator

    seqs = [TrainSequence.from_prompt(prompts[i], t.response_ids, t.behaviour_logprobs, t.loss_mask,
                                      float(advantages_BG[i, j]))
            for i, group in enumerate(groups) for j, t in enumerate(group)]
    T = max(len(s.response_ids) for s in seqs)
    mask_BT = torch.zeros(len(seqs), max(T, 1))
    for i, s in enumerate(seqs):
        mask_BT[i, :len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=torch.float32)
    denominator = max(float(aggregate_denominator(mask_BT, loss_agg)), 1.0)
    shards = split_even(seqs, world_size)
    num_micro = max(1, math.ceil(max(len(s) for s in shards) / micro_batch_size))
    return [StepInputs(sequences=s, num_micro_batches=num_micro, loss_denominator=denominator) for s in shards]


def _merge_train_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    tokens = max(sum(m["tokens"] for m in per_rank), 1.0)
    return {
        "loss/pg": sum(m["pg_loss"] for m in per_rank) / tokens,
        "actor/entropy": sum(m["entropy"] for m in per_rank) / tokens,
        "actor/clip_fraction": sum(m["clipped"] for m in per_rank) / tokens,
        "actor/grad_norm": per_rank[0]["grad_norm"],
        "actor/response_tokens": tokens,
        "mismatch/mean_abs_logprob_diff": sum(m["abs_logprob_diff"] for m in per_rank) / tokens,
        "mismatch/max_abs_logprob_diff": max(m["max_abs_logprob_diff"] for m in per_rank),
    }


def run_step(rt: Runtime, pairs: list[tuple[Sample, ProcessedPrompt]], advantage_fn: Any, agent_loop: Any,
             spans: StepSpans) -> dict[str, float]:
    """One synchronous RL step on a batch of prompts: rollout, rewards, advantages, update, sync."""
    cfg = rt.cfg
    samples, prompts = [s for s, _ in pairs], [p for _, p in pairs]
    with spans("rollout"):
        groups = agent_loop(RolloutContext(rt.engines, rt.sampling, rt.weight_version), prompts)
    with spans("reward"):
        report = rt.rewards.score(samples, groups, decode=rt.processor.decode)
        metrics = report.metrics()
        # groups whose reward failed under on_error=drop_group take no part in the update
        lengths = [len(t.response_ids) for g in groups for t in g]
        prompts = [p for p, keep in zip(prompts, report.keep) if keep]
        groups = [g for g, keep in zip(groups, report.keep) if keep]
    metrics["rollout/response_length"] = float(np.mean(lengths)) if lengths else 0.0
    if not groups:
        metrics["train/skipped_steps"] = 1.0  # every group dropped: nothing to learn from
        return metrics
    rewards_BG = torch.tensor([[t.reward for t in g] for g in groups], dtype=torch.float32)
    advantages_BG = advantage_fn(rewards_BG, **cfg.algorithm.advantage_args)
    metrics["rollout/groups_all_same_reward"] = float((rewards_BG == rewards_BG[:, :1]).all(1).float().mean())
    with spans("train"):
        inputs = build_step_inputs(prompts, groups, advantages_BG, cfg.trainer.world_size,
                                   cfg.trainer.micro_batch_size, cfg.algorithm.loss_agg.value)
        per_rank = ray.get([t.train_step.remote(x) for t, x in zip(rt.trainers, inputs)])
    metrics.update(_merge_train_metrics(per_rank))
    with spans("weight_sync"):
        rt.weight_version += 1
        sync = ray.get([t.sync_weights.remote(rt.engines, rt.weight_version, cfg.weight_sync.bucket_mb)
                        for t in rt.trainers])[0]
    metrics.update({"weight_sync/mb": sync["mb"], "weight_version": float(rt.weight_version)})
    return metrics


def _batches(stream: Iterator[Sample], n: int) -> Iterator[list[Sample]]:
    while True:
        batch = [next(stream) for _ in range(n)]
        yield batch


def train(cfg: Config) -> dict[str, Any]:
    """Run `cfg` to the end; return a summary (final/best held-out accuracy, steps, wall time)."""
    from mmrl.data.stream import DecodeOptions, ShardStream, load_all

    torch.manual_seed(cfg.run.seed)
    rt = start_runtime(cfg)
    advantage_fn = registry.resolve("advantage", cfg.algorithm.advantage)
    agent_loop = registry.resolve("agent_loop", cfg.rollout.agent_loop)
    rejected: set[str] = set()  # keys of prompts the processor refused
    heldout: list[tuple[Sample, ProcessedPrompt]] = []
    decode = DecodeOptions(**{**vars(cfg.data.decode), "decoders": tuple(cfg.data.decode.decoders)})
    if cfg.data.heldout_shards:
        samples = load_all(cfg.data.heldout_shards, decode=decode)
        heldout = _prompts(rt.processor, samples[:cfg.eval.num_prompts] if cfg.eval.num_prompts else samples, rejected)
    stream = ShardStream(cfg.data.train_shards, shuffle_buffer=cfg.data.shuffle_buffer, seed=cfg.run.seed,
                         num_workers=cfg.data.num_workers, decode=decode,
                         quarantine_path=rt.run_dir / "quarantine.jsonl", max_bad_ratio=cfg.data.max_bad_ratio,
                         min_samples_for_ratio=cfg.data.min_samples_for_ratio)
    logger = MetricsLogger(rt.run_dir, total_steps=cfg.run.max_steps, tensorboard=cfg.logging.tensorboard,
                           progress_bar=cfg.logging.progress_bar, console_every=cfg.logging.console_every)
    summary: dict[str, Any] = {"run_dir": str(rt.run_dir), "heldout_curve": []}
    t_start = time.time()
    try:
        if heldout:
            first = evaluate(rt, heldout)
            logger.log(0, {**first, "time/wall_s": 0.0})
            summary["heldout_curve"].append((0, first["eval/heldout_accuracy"], 0.0))
        batches = _batches(iter(stream), cfg.rollout.prompts_per_step)
        for step in range(1, cfg.run.max_steps + 1):
            spans = StepSpans()
            t_step = time.time()
            with spans("data_wait"):
                pairs = _prompts(rt.processor, next(batches), rejected, stream.quarantine)
            metrics = run_step(rt, pairs, advantage_fn, agent_loop, spans)
            wall = time.time() - t_start
            if heldout and cfg.eval.every_steps and (step % cfg.eval.every_steps == 0 or step == cfg.run.max_steps):
                with spans("eval"):
                    metrics.update(evaluate(rt, heldout))
                summary["heldout_curve"].append((step, metrics["eval/heldout_accuracy"], wall))
            metrics.update({
                "data/rejected_prompts": float(len(rejected)),
                "data/bad_samples": float(sum(stream.bad_counts.values())),
                **spans.metrics(), "time/step_s": time.time() - t_step, "time/wall_s": wall,
            })
            logger.log(step, metrics)
            summary["steps"] = step
            acc = metrics.get("eval/heldout_accuracy")
            if (cfg.run.stop_at_heldout_accuracy is not None and acc is not None
                    and acc >= cfg.run.stop_at_heldout_accuracy):
                summary["stopped"] = f"held-out accuracy {acc:.3f} >= {cfg.run.stop_at_heldout_accuracy}"
                break
            if cfg.run.time_limit_s is not None and wall > cfg.run.time_limit_s:
                summary["stopped"] = f"time limit {cfg.run.time_limit_s}s"
                break
    finally:
        logger.close()
        rt.close()
    curve = summary["heldout_curve"]
    summary.update(wall_s=time.time() - t_start, final_heldout_accuracy=curve[-1][1] if curve else None,
                   best_heldout_accuracy=max((c[1] for c in curve), default=None), rejected_prompts=len(rejected),
                   bad_samples=dict(stream.bad_counts))
    return summary
