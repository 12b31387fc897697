"""A real rollout engine (vLLM in a Ray actor, the tiny VLM) plus one rollout worker, for tests
that drive agent loops without the trainer (the engine itself: `mmrl.testing.local_engine`)."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


@contextmanager
def tiny_engine(model_dir: Path, run_dir: Path, agent_loop: str = "single_turn",
                agent_loop_args: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Yield {"engine", "workers", "processor", "forbidden"}: one engine and one rollout worker
    running `agent_loop`."""
    from mmrl.rollout.workers import RolloutWorkers
    from mmrl.testing import local_engine

    with local_engine(model_dir, run_dir) as eng:
        workers = RolloutWorkers(1, [eng["engine"]], {"name": "auto", "model_path": str(model_dir)}, agent_loop,
                                 agent_loop_args)
        try:
            workers.ready()
            yield {**eng, "workers": workers}
        finally:
            workers.close()


@contextmanager
def demo_runtime(model_dir: Path, colors_dir: Path, run_dir: Path, *overrides: str) -> Iterator[Any]:
    """The demo config's live processes (Ray, engines, the 2 ZeRO-3 ranks, workers) on `model_dir`
    and the colours shards, with `overrides`; closed and Ray shut down afterwards."""
    import ray

    from mmrl.config import load_config
    from mmrl.controller.loop import start_runtime

    repo = Path(__file__).resolve().parents[1]
    cfg = load_config(str(repo / "configs" / "colors_demo.yaml"), [
        f"model.path={model_dir}", f"data.train_shards={colors_dir}/train-000000.tar",
        f"data.heldout_shards={colors_dir}/heldout-000000.tar", f"run.output_dir={run_dir}", *overrides])
    rt = start_runtime(cfg)
    try:
        yield rt
    finally:
        rt.close()
        ray.shutdown()


def demo_steps(rt: Any, colors_dir: Path, count: int) -> Iterator[tuple[int, dict[str, float], list]]:
    """`count` of the demo's synchronous GRPO steps on `rt` (weights pushed each step), from a
    fresh seeded stream of the colours shards: yields (step, metrics, samples used)."""
    from mmrl import registry
    from mmrl.controller.loop import run_step
    from mmrl.controller.prompts import SampleBatches
    from mmrl.data.stream import ShardStream
    from mmrl.utils.timing import StepSpans

    stream = ShardStream(f"{colors_dir}/train-000000.tar", shuffle_buffer=rt.cfg.data.shuffle_buffer, seed=1)
    batches = SampleBatches(stream, rt.cfg.rollout.prompts_per_step)
    advantage = registry.resolve("advantage", rt.cfg.algorithm.advantage)
    first = rt.weight_version
    for step in range(first + 1, first + 1 + count):
        metrics, used = run_step(rt, batches(), advantage, StepSpans(), step=step, batches=batches)
        yield step, metrics, used
