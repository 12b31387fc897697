"""The live processes of a run (Runtime: engines, rollout workers, trainer ranks, reward workers)
and one synchronous step: rollout (controller/rollout.py) -> rewards -> (dynamic sampling) ->
update (controller/learn.py) -> weight sync. The run itself (resume, checkpoints, stability guard,
metrics) is controller/train.py."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from mmrl.config.load import to_yaml
from mmrl.config.schema import Config
from mmrl.controller.colocate import colocated_engine_args, engine_colocation
from mmrl.controller.learn import needs_reference, update_policy
from mmrl.controller.metrics import rollout_metrics, weight_sync_metrics
from mmrl.controller.placement import colocated, placement_plan, placement_strategy, reserve_placement
from mmrl.data.sample import Sample
from mmrl.controller.prompts import SampleBatches
from mmrl.controller.restarts import EngineRestarts, record_ranks
from mmrl.controller.rollout_log import log_rollouts
from mmrl.controller.rollout import EngineMonitor, rollout_and_score_groups, run_rollout
from mmrl.processors import PromptRef, build_processor
from mmrl.rewards.workers import RewardPool
from mmrl.rollout.engine import RolloutEngine, cpu_engine_defaults, engine_kwargs
from mmrl.rollout.trainer_engine import TrainerRolloutEngine
from mmrl.rollout.types import SamplingConfig, Trajectory
from mmrl.rollout.workers import RolloutWorkers
from mmrl.trainer.update import LossSettings
from mmrl.trainer.worker import TrainerSpec, make_trainer_actors, setup_ranks
from mmrl.utils.env import apply_env, cleanup_shm, engine_env, init_local_ray, resolve_device, rpc_dir
from mmrl.utils.cpu_clock import ProcessTreeClock
from mmrl.utils.timing import Milestones, StepSpans
from mmrl.utils.signals import reclaim_sigterm


# After a failed weight push: how long a dead engine may take to show as dead (its watch() call
# fails within a second or two of the death; a bound, not a timing assumption: nothing dead, the
# error is raised as it was)
ENGINE_DEATH_WAIT_S = 30.0


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
    workers: RolloutWorkers
    trainers: list[Any]
    weight_version: int = 0
    monitor: EngineMonitor | None = None  # per-step engine metrics
    # CPU seconds of the run's processes, for cores/<phase> (None against a remote Ray cluster,
    # whose actors are not this process's children: mmrl/utils/cpu_clock.py)
    cpu_clock: ProcessTreeClock | None = None
    startup: Milestones = field(default_factory=Milestones)  # start-up phases, logged with step 1
    # (MASTER_ADDR, MASTER_PORT) of the trainer ranks' process group: it names their shared-memory
    # all-reduce buffers, so close() removes this run's and no other run's
    rendezvous: tuple[str, int] | None = None
    # each trainer rank's {rank, pid, node} (also RUN_DIR/ranks.json): a rank that dies is named by them
    ranks: list[dict[str, Any]] = field(default_factory=list)
    engine_restarts: EngineRestarts | None = None  # replaces dead engines (None: rollout.backend=trainer)

    def restart_metrics(self) -> dict[str, float]:
        """Engines and rollout workers replaced so far in this run (rollout.max_actor_restarts)."""
        return {"rollout/engine_restarts": float(self.engine_restarts.count if self.engine_restarts else 0),
                "rollout/worker_restarts": float(self.workers.restarts)}

    def push_weights(self, new_version: bool = True) -> dict[str, float]:
        """Give the engines the trainers' weights (as `weight_version`, bumped first unless
        `new_version` is false). With rollout.backend=trainer the sampler IS the trainer: only
        the version moves."""
        if new_version:
            self.weight_version += 1
        if self.cfg.rollout.backend.value == "trainer":
            ray.get([e.apply_weights.remote(self.weight_version) for e in self.engines])
            return {"mb": 0.0}
        try:
            return self.sync_weights_to(self.engines, self.weight_version)
        except ray.exceptions.RayError:
            # An engine that died during the push is replaced (with these weights); then the
            # push is repeated for all, so every engine runs the same version. Anything else
            # (no engine died: a trainer rank, say) is raised as it was.
            if not self.workers.replace_dead(timeout=ENGINE_DEATH_WAIT_S):
                raise
            return self.sync_weights_to(self.engines, self.weight_version)

    def sync_weights_to(self, engines: list[Any], version: int) -> dict[str, float]:
        """The trainers' weights into `engines` as `version` (all ranks take part in the gathers)."""
        ws = self.cfg.weight_sync
        return ray.get([t.sync_weights.remote(engines, version, ws.bucket_mb, ws.transport.value, ws.timeout_s)
                        for t in self.trainers])[0]

    def close(self) -> None:
        self.rewards.close()
        self.workers.close()
        try:
            ray.get([a.shutdown.remote() for a in self.trainers + self.engines], timeout=60)
        except Exception as e:  # still kill the actors below; say why the clean stop failed
            print(f"[mmrl] warning: clean shutdown failed ({type(e).__name__}: {e}); killing actors")
        for actor in self.engines + self.trainers:
            ray.kill(actor)
        if self.device == "cpu":
            master_addr, master_port = self.rendezvous or (None, None)
            cleanup_shm(master_addr, master_port)
        shutil.rmtree(rpc_dir(self.run_dir), ignore_errors=True)


def start_runtime(cfg: Config) -> Runtime:
    """Start Ray, the rollout engines and the trainer ranks for `cfg`."""
    startup = Milestones()
    startup.mark("imports")  # the interpreter, mmrl and its libraries, the config
    run_dir = Path(cfg.run.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    device = resolve_device(cfg.cluster.device.value)
    env = engine_env(run_dir, device, {"VLLM_LOGGING_LEVEL": "WARNING", **cfg.rollout.engine_env})
    apply_env(env)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        sigterm_handler = signal.getsignal(signal.SIGTERM)
        if cfg.cluster.ray_address:
            ray.init(address=cfg.cluster.ray_address, runtime_env={"env_vars": env})
        else:
            init_local_ray(num_cpus=cfg.cluster.num_cpus or os.cpu_count(), include_dashboard=False,
                     runtime_env={"env_vars": env}, log_to_driver=True)
        reclaim_sigterm(sigterm_handler)  # ray.init replaced it (the CLI's unwinds like Ctrl-C)
    startup.mark("ray")

    plan = placement_plan(cfg, device)
    strategy = placement_strategy(cfg, device)  # cluster.placement_strategy; PACK when colocated
    reserve_placement(plan, strategy, name=f"mmrl:{run_dir.resolve()}")
    llm_kwargs = engine_kwargs(cfg.model.path, cfg.model.dtype.value, cfg.run.seed, cfg.rollout.engine_args,
                               min_pixels=cfg.processor.min_pixels, max_pixels=cfg.processor.max_pixels)
    llm_kwargs.setdefault("trust_remote_code", cfg.model.trust_remote_code)
    if colocated(cfg, device):  # sleep mode, and room for the trainer rank on the same GPU
        colocated_engine_args(cfg, device, llm_kwargs)
    if device == "cpu":
        cpu_engine_defaults(llm_kwargs)
        if cfg.rollout.seed_per_step:
            llm_kwargs.setdefault("enable_chunked_prefill", False)  # see RolloutEngine.generate
    if strategy and llm_kwargs.get("tensor_parallel_size", 1) * llm_kwargs.get("pipeline_parallel_size", 1) > 1:
        # vLLM would put its workers into the placement group it runs in (any GPU bundle, the
        # trainers' too): its own processes instead, on the engine actor's GPUs
        llm_kwargs.setdefault("distributed_executor_backend", "mp")
    vllm_backend = cfg.rollout.backend.value == "vllm"
    engine_places = [p for p in plan if p.role == "rollout" and vllm_backend]

    def start_engine(i: int) -> Any:  # engine i, at the start and when it is replaced
        p = engine_places[i]
        return RolloutEngine.as_actor(p.ray_options(), {**llm_kwargs, "seed": cfg.run.seed + p.index}, env,
                                      partial=cfg.rollout.partial.value, recompute_kv=cfg.rollout.recompute_kv)

    engines = [start_engine(i) for i in range(len(engine_places))]
    engine_restarts = EngineRestarts(start_engine, cfg.rollout.max_actor_restarts) if vllm_backend else None
    # The engines start first: vLLM's start (an actor, then its engine-core process, each
    # importing vLLM) is the longest chain of the start-up; everything below runs beside it.
    starting = {e.ready.remote(): "engines" for e in engines}
    processor_spec = dict(name=cfg.processor.name, model_path=cfg.model.path, min_pixels=cfg.processor.min_pixels,
                          max_pixels=cfg.processor.max_pixels, max_prompt_tokens=cfg.processor.max_prompt_tokens,
                          trust_remote_code=cfg.model.trust_remote_code)
    # The driver's processor decodes responses for the rewards and declares the media limits;
    # prompts are processed in the rollout workers.
    processor = build_processor(**processor_spec)
    startup.mark("processor")
    forbidden = processor.forbidden_token_ids if cfg.rollout.forbid_vision_tokens else []
    sampling = SamplingConfig(n=cfg.rollout.group_size, max_new_tokens=cfg.rollout.max_new_tokens,
                              temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                              forbidden_token_ids=forbidden, seed=None)
    trainer_opts = [p.ray_options() for p in plan if p.role == "trainer"]  # per rank: its own bundle
    alg = cfg.algorithm
    loss = LossSettings(
        policy_loss=alg.policy_loss, policy_loss_args={"clip_low": alg.clip_low, "clip_high": alg.clip_high,
                                                       **alg.policy_loss_args},
        loss_agg=alg.loss_agg.value, entropy_coef=alg.entropy_coef,
        kl_coef=alg.kl.coef if alg.kl.placement.value == "loss" else 0.0, kl_estimator=alg.kl.estimator,
        correction_mode=alg.rollout_correction.mode.value, correction_level=alg.rollout_correction.level.value,
        correction_threshold=alg.rollout_correction.threshold,
        correction_threshold_low=alg.rollout_correction.threshold_low)
    lora = cfg.trainer.lora
    spec = TrainerSpec(
        model_path=cfg.model.path, dtype=cfg.model.dtype.value, world_size=cfg.trainer.world_size,
        device=device, lr=cfg.trainer.lr,
        betas=(cfg.trainer.betas[0], cfg.trainer.betas[1]), weight_decay=cfg.trainer.weight_decay,
        grad_clip=cfg.trainer.grad_clip, deepspeed=dict(cfg.trainer.deepspeed),
        temperature=cfg.rollout.temperature, forbidden_token_ids=forbidden, pad_token_id=processor.pad_token_id,
        loss=loss, seed=cfg.run.seed, env=env, trust_remote_code=cfg.model.trust_remote_code,
        reference_model=needs_reference(cfg), padding_free=cfg.trainer.padding_free, processor=cfg.processor.name,
        lora={"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
              "target_modules": list(lora.target_modules)} if lora.enabled else None,
        freeze_vision_tower=cfg.trainer.freeze_vision_tower, freeze_projector=cfg.trainer.freeze_projector,
        gradient_checkpointing=cfg.trainer.gradient_checkpointing,
        release_cache_after_update=colocated(cfg, device), routing_replay=cfg.algorithm.routing_replay.value)
    if colocated(cfg, device):
        # vLLM sizes its KV cache from the GPU memory it sees taken while it profiles: the ranks
        # that share its GPU start loading only once it is up (controller/colocate.py)
        ray.get([ref for ref, what in starting.items() if what == "engines"])
    trainers = make_trainer_actors(spec, trainer_opts)
    if not vllm_backend:
        engines = [TrainerRolloutEngine.as_actor(p.ray_options(), trainers, processor_spec)
                   for p in plan if p.role == "rollout"]
        starting.update({e.ready.remote(): "engines" for e in engines})
    # The ranks start now (DeepSpeed's start takes seconds), while the reward pool below waits
    # for its workers and the rollout workers come up.
    rank_setups, rendezvous = setup_ranks(trainers)
    starting.update({ref: "trainer_ranks" for ref in rank_setups})
    # Model-based rewards (clip_score, vlm_judge) load their model when a worker starts, while
    # the engines and trainer ranks start too: give the workers time on a small CPU box.
    rewards = RewardPool([dataclasses.asdict(r) for r in cfg.rewards],
                         num_workers=cfg.reward_execution.num_workers, timeout_s=cfg.reward_execution.timeout_s,
                         on_error=cfg.reward_execution.on_error.value, start_timeout_s=300.0,
                         actor_options=next(p for p in plan if p.role == "reward").ray_options())
    workers = RolloutWorkers(cfg.rollout.num_workers, engines, processor_spec, cfg.rollout.agent_loop,
                             cfg.rollout.agent_loop_args, cfg.rollout.max_requests_per_engine,
                             actor_options=next(p for p in plan if p.role == "rollout_worker").ray_options(),
                             max_restarts=cfg.rollout.max_actor_restarts, on_engine_lost=engine_restarts)
    startup.mark("workers_started")  # reward and rollout workers; the engines and ranks start meanwhile
    pending = list(starting)
    while pending:  # in the order they come up: which of them the start waits for
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done)  # a start that failed raises here
        startup.ready(starting[done[0]])
    startup.mark("engines_and_ranks")
    ranks = record_ranks(run_dir, ray.get(rank_setups))
    workers.ready()
    startup.mark("rollout_workers_ready")
    rt = Runtime(cfg=cfg, run_dir=run_dir, device=device, processor=processor, rewards=rewards,
                 sampling=sampling, engines=engines, workers=workers, trainers=trainers,
                 monitor=EngineMonitor(engines), cpu_clock=None if cfg.cluster.ray_address else ProcessTreeClock(),
                 startup=startup, rendezvous=tuple(ray.get(rendezvous)), ranks=ranks,
                 engine_restarts=engine_restarts)
    if engine_restarts is not None:
        engine_restarts.runtime = rt
    return rt


def evaluate(rt: Runtime, heldout: list[Sample]) -> dict[str, float]:
    """Greedy decoding on the held-out samples; correct when the reward score >= eval.threshold.
    A held-out sample the processor refuses is left out (and logged once)."""
    greedy = SamplingConfig(n=1, max_new_tokens=rt.sampling.max_new_tokens, temperature=1.0,
                            forbidden_token_ids=rt.sampling.forbidden_token_ids, greedy=True)
    rollout = run_rollout(rt.workers, heldout, greedy, evaluation=True, on_failure=_warn_heldout_failure)
    samples, groups = rollout.samples, rollout.groups
    rt.rewards.score(samples, groups, decode=rt.processor.decode, on_error="zero")
    correct = [g[0].reward >= rt.cfg.eval.threshold for g in groups]
    metrics = {"eval/heldout_accuracy": float(np.mean(correct)) if correct else 0.0,
               "eval/num_prompts": float(len(correct))}
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


_warned_heldout: set[str] = set()


def _warn_heldout_failure(bad: Any) -> None:
    if bad.key not in _warned_heldout:
        _warned_heldout.add(bad.key)
        print(f"[mmrl] held-out sample {bad.key!r} left out of evaluation ({bad.reason}): {bad.detail}")


def step_seed(*parts: int) -> int:
    """A 62-bit seed hashed from integers: far apart for neighbouring inputs (vLLM derives each
    request's seed from it by small offsets), and stable across processes."""
    state = np.random.SeedSequence([int(p) % 2**32 for p in parts]).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 30) ^ int(state[1])


def rollout_and_score(rt: Runtime, samples: list[Sample], spans: StepSpans,
                      batches: SampleBatches | None = None) -> tuple[list[PromptRef], list[list[Trajectory]],
                                                                      list[Sample], dict[str, float]]:
    """Roll out a batch of samples and score the groups. Returns the prompts, groups and samples
    that take part in the update (a group whose reward failed under on_error=drop_group does
    not) and the reward/rollout metrics. With `batches`, a refused sample is quarantined there
    and its slot refilled from the stream."""
    def on_failure(bad: Any) -> None:
        if batches is not None:
            batches.record_failure(bad)

    rollout, report = rollout_and_score_groups(rt, samples, spans, refill=batches.refill if batches else None,
                                               on_failure=on_failure)
    if batches is not None and rollout.groups:
        batches.record_success()
    metrics = report.metrics()
    keep = report.keep
    metrics.update(rollout_metrics(rollout.groups))
    return ([p for p, k in zip(rollout.prompts, keep) if k], [g for g, k in zip(rollout.groups, keep) if k],
            rollout.samples, metrics)



def run_step(rt: Runtime, samples: list[Sample], advantage_fn: Any, spans: StepSpans, step: int = 0,
             batches: SampleBatches | None = None) -> tuple[dict[str, float], list[Sample]]:
    """One synchronous RL step on a batch of samples: rollout, rewards, (dynamic sampling),
    advantages, update, weight sync. `batches` refills refused samples and gives more batches when
    dynamic sampling needs more informative groups. Returns the metrics and the samples rolled out."""
    cfg = rt.cfg
    if cfg.rollout.seed_per_step:
        # Rollouts become a function of (seed, step, weights): a resumed run samples exactly what
        # the uninterrupted run would have. The step's seed is a hash, not seed + step: request
        # seeds are consecutive within a step, so consecutive step seeds would replay the
        # previous step's random streams (shifted by one sample) and starve exploration.
        rt.sampling.seed = step_seed(cfg.run.seed, step)
    dyn = cfg.algorithm.dynamic_sampling
    if not dyn.enabled:
        prompts, groups, used, metrics = rollout_and_score(rt, samples, spans, batches)
    else:
        prompts, groups, used, metrics = _dynamic_sampling(rt, samples, spans, batches)
    if not groups:
        metrics["train/skipped_steps"] = 1.0  # every group dropped: nothing to learn from
        return metrics, used
    log_rollouts(rt, step, used, prompts, groups)
    colo = engine_colocation(rt)  # cluster.colocate: the engines sleep while the ranks train
    if colo:
        colo.sleep(spans)
    metrics.update(update_policy(rt.trainers, cfg, prompts, groups, advantage_fn, spans, step))
    if colo:
        colo.wake_weights(spans)  # the sync loads into the weights; the KV cache wakes after it
    with spans("weight_sync"):
        sync = rt.push_weights()
    if colo:
        colo.wake_kv_cache(spans)
    metrics.update({**weight_sync_metrics(sync), "weight_version": float(rt.weight_version)})
    if rt.monitor is not None:
        metrics.update(rt.monitor.metrics())
    metrics.update(rt.restart_metrics())
    return metrics, used


def _dynamic_sampling(rt: Runtime, samples: list[Sample], spans: StepSpans, batches: SampleBatches | None,
                      ) -> tuple[list[PromptRef], list[list[Trajectory]], list[Sample], dict[str, float]]:
    """DAPO: keep only groups whose rewards differ; roll out further batches until
    rollout.prompts_per_step groups are kept or dynamic_sampling.max_rounds is reached."""
    from mmrl.algorithms.dynamic_sampling import informative_groups

    target = rt.cfg.rollout.prompts_per_step
    kept_prompts: list[PromptRef] = []
    kept_groups: list[list[Trajectory]] = []
    used: list[Sample] = []
    first_metrics: dict[str, float] = {}
    rounds, seen = 0, 0
    while True:
        rounds += 1
        prompts, groups, rolled, metrics = rollout_and_score(rt, samples, spans, batches)
        used += rolled
        first_metrics = first_metrics or metrics
        seen += len(groups)
        if groups:
            keep_B = informative_groups(torch.tensor([[t.reward for t in g] for g in groups]))
            kept_prompts += [p for p, k in zip(prompts, keep_B.tolist()) if k]
            kept_groups += [g for g, k in zip(groups, keep_B.tolist()) if k]
        if len(kept_groups) >= target or rounds >= rt.cfg.algorithm.dynamic_sampling.max_rounds or batches is None:
            break
        samples = batches()
        if rt.sampling.seed is not None:  # a fresh seed per round, still a function of the step
            rt.sampling.seed = step_seed(rt.sampling.seed, rounds)
    first_metrics.update({"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/kept_groups": float(len(kept_groups)),
                          "dynamic_sampling/kept_fraction": len(kept_groups) / max(seen, 1)})
    return kept_prompts[:target], kept_groups[:target], used, first_metrics
