"""A trainer rank that dies (run.max_restarts): name it, restart the run from its newest complete
checkpoint in the same process, or stop with the command that resumes it. A rollout engine that
dies is replaced in place instead (EngineRestarts; rollout.max_actor_restarts): the run goes on.

train() turns the Ray error of a dead rank into RankDied (rank_failure, before its actors are torn
down); train_with_restarts() then calls train() again, which starts a new runtime and resumes
exactly as rerunning the command does (the records written after the checkpoint are dropped; no
checkpoint yet: a fresh start). Each restart is counted in `run/restarts` and logged in
RUN_DIR/restarts.jsonl. Past run.max_restarts the run stops with RunStopped: the CLI prints it and
exits with RESUME_EXIT_CODE.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

RESUME_EXIT_CODE = 75  # EX_TEMPFAIL: a temporary failure; rerunning the same command resumes
PROBE_TIMEOUT_S = 60.0  # how long the ranks get to answer "alive?" after a Ray error
PROBE_GRACE_S = 5.0  # ...once a dead one is found (a live peer may hang in a collective with it)


class RankDied(RuntimeError):
    """A trainer rank's actor died while the run was using it."""

    def __init__(self, rank: int, pid: int | None, node: str | None, step: int | None, cause: BaseException):
        self.rank, self.pid, self.node, self.step = rank, pid, node, step
        text = str(cause).strip()
        self.cause = f"{type(cause).__name__}: {text.splitlines()[0]}" if text else type(cause).__name__
        super().__init__(self.describe())

    def describe(self) -> str:
        where = ", ".join(part for part in (self.pid and f"pid {self.pid}", self.node and f"node {self.node}") if part)
        when = f"at step {self.step}" if self.step is not None else "before the first step"
        return f"trainer rank {self.rank}{f' ({where})' if where else ''} died {when}"


class RunStopped(RuntimeError):
    """A rank died and no restart is left: the message names the rank and the resume command."""

    exit_code = RESUME_EXIT_CODE


class EngineRestarts:
    """`on_engine_lost` of the run's RolloutWorkers: start a replacement for dead engine i, give
    it the trainers' current weights (the version the engines run), return it ready. Bounded by
    rollout.max_actor_restarts per run."""

    def __init__(self, start_engine: Callable[[int], Any], max_restarts: int):
        self.start_engine, self.max_restarts = start_engine, max_restarts
        self.count = 0
        self.runtime: Any = None  # the run's Runtime, set once it exists

    def __call__(self, index: int, error: BaseException) -> Any:
        import ray

        from mmrl.rollout.workers import ActorRestartsExhausted

        self.count += 1
        if self.count > self.max_restarts:
            raise ActorRestartsExhausted(
                f"rollout engine {index} died ({type(error).__name__}); that is {self.count} engine deaths in "
                f"this run, more than rollout.max_actor_restarts={self.max_restarts}. Look for the cause in the "
                f"engine's log (Ray's logs/ folder: memory, a vLLM crash), then rerun the command to resume from "
                f"the newest checkpoint, or raise rollout.max_actor_restarts")
        rt = self.runtime
        print(f"[mmrl] rollout engine {index} died ({type(error).__name__}); starting a replacement "
              f"({self.count}/{self.max_restarts}); its requests wait for it or go to the other engines", flush=True)
        t0 = time.time()
        engine = self.start_engine(index)
        ray.get(engine.ready.remote())
        rt.sync_weights_to([engine], rt.weight_version)
        if rt.monitor is not None:
            rt.monitor.forget(index)
        print(f"[mmrl] rollout engine {index} replaced in {time.time() - t0:.0f} s (weight version "
              f"{rt.weight_version})", flush=True)
        return engine


def record_ranks(run_dir: Path, setups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranks' {rank, pid, node} from their setup info, also written to RUN_DIR/ranks.json
    (for an operator, or a test, that looks for the processes)."""
    ranks = [{"rank": s["rank"], "pid": s.get("pid"), "node": s.get("node")} for s in setups]
    (Path(run_dir) / "ranks.json").write_text(json.dumps(ranks) + "\n")
    return ranks


def _ray_error(error: BaseException) -> BaseException | None:
    """The Ray error in `error`'s chain (a rank's death surfaces as one), if any."""
    from ray.exceptions import RayError

    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, RayError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def dead_ranks(trainers: Sequence[Any], timeout_s: float = PROBE_TIMEOUT_S) -> list[int]:
    """The indices of the trainer actors that are dead: each is asked a no-op call; a dead one
    answers with ActorDiedError. A live rank busy in a call (or stuck in a collective with a
    dead peer) does not answer: it counts as alive."""
    import ray
    from ray.exceptions import ActorUnavailableError, RayActorError

    refs = {t.__ray_ready__.remote(): i for i, t in enumerate(trainers)}
    pending, dead = list(refs), []
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            try:
                ray.get(ref)
            except ActorUnavailableError:  # unreachable for now, not dead
                pass
            except RayActorError:
                dead.append(refs[ref])
                deadline = min(deadline, time.monotonic() + PROBE_GRACE_S)
    return sorted(dead)


def rank_failure(rt: Any, error: BaseException, step: int | None) -> RankDied | None:
    """RankDied naming the trainer rank whose death caused `error` (a Ray error from a call on
    it, or from a peer's collective that lost it); None when every rank is alive, or `error`
    did not come through Ray."""
    from ray.exceptions import RayActorError

    ray_error = _ray_error(error)
    if ray_error is None or not rt.trainers:
        return None
    ids = [t._actor_id.hex() for t in rt.trainers]
    named = getattr(ray_error, "actor_id", None) if isinstance(ray_error, RayActorError) else None
    try:
        dead = [ids.index(named)] if named in ids else dead_ranks(rt.trainers)
    except Exception as e:  # Ray itself in trouble: the original error is the one to see
        print(f"[mmrl] warning: could not ask the trainer ranks whether they are alive ({type(e).__name__}: {e})")
        return None
    if not dead:
        return None
    info = rt.ranks[dead[0]] if dead[0] < len(rt.ranks) else {}
    return RankDied(dead[0], info.get("pid"), info.get("node"), step, ray_error)


def _with_restart_count(hooks: Any, restarts: int) -> Any:
    from mmrl.controller.train import TrainHooks

    hooks = hooks or TrainHooks()
    after = hooks.after_step

    def after_step(rt: Any, step: int, metrics: dict[str, Any]) -> None:
        metrics["run/restarts"] = float(restarts)
        if after is not None:
            after(rt, step, metrics)

    return dataclasses.replace(hooks, after_step=after_step)


def stop_message(died: RankDied, command: str, checkpoint: Path | None, max_restarts: int) -> str:
    used = (f"run.max_restarts={max_restarts} restarts used up" if max_restarts else
            "run.max_restarts=0 (no restart in this process)")
    head = f"{died.describe()} ({died.cause}); {used}."
    if checkpoint is None:
        return f"{head} No checkpoint was written yet: this command starts the run again:\n  {command}"
    return (f"{head} To resume from the newest checkpoint ({checkpoint}), run the same command again:\n"
            f"  {command}")


def train_with_restarts(cfg: Any, command: str | None = None, hooks: Any = None) -> dict[str, Any]:
    """train(cfg), restarted from the newest checkpoint when a trainer rank dies, at most
    cfg.run.max_restarts times; then RunStopped naming the rank and `command` (what resumes the
    run; default: `mmrl train RUN_DIR/config.yaml`, the resolved config the run wrote)."""
    from mmrl.controller.checkpoint import latest_checkpoint
    from mmrl.controller.train import train

    run_dir = Path(cfg.run.output_dir)
    if command is None:
        command = f"mmrl train {run_dir / 'config.yaml'}"
    if not cfg.checkpoint.resume:
        command += " checkpoint.resume=true"
    restarts = 0
    while True:
        try:
            summary = train(cfg, _with_restart_count(hooks, restarts))
        except RankDied as died:
            checkpoint = latest_checkpoint(run_dir)
            again = restarts < cfg.run.max_restarts
            event = {"step": died.step, "rank": died.rank, "pid": died.pid, "node": died.node, "error": died.cause,
                     "checkpoint": checkpoint.name if checkpoint else None, "restart": restarts + 1 if again else None,
                     "time": time.strftime("%Y-%m-%d %H:%M:%S")}
            with open(run_dir / "restarts.jsonl", "a") as f:
                f.write(json.dumps(event) + "\n")
            if not again:
                raise RunStopped(stop_message(died, command, checkpoint, cfg.run.max_restarts)) from died
            restarts += 1
            start = f"checkpoint {checkpoint.name}" if checkpoint and cfg.checkpoint.resume else "the start"
            print(f"[mmrl] {died.describe()} ({died.cause}). Restart {restarts} of run.max_restarts="
                  f"{cfg.run.max_restarts}: from {start}", flush=True)
            continue
        summary["restarts"] = restarts
        return summary
