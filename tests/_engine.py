"""A real rollout engine (vLLM in a Ray actor, the tiny VLM) for tests that drive agent loops
without the trainer: Ray, the engine actor, rollout workers running the agent loop, a processor."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import ray


@contextmanager
def tiny_engine(model_dir: Path, run_dir: Path, agent_loop: str = "single_turn",
                agent_loop_args: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Start Ray (2 CPUs), one RolloutEngine actor and one rollout worker running `agent_loop`;
    yield {"engine", "workers", "processor", "forbidden"}."""
    from mmrl.processors import build_processor
    from mmrl.rollout.engine import RolloutEngine, engine_kwargs
    from mmrl.rollout.workers import RolloutWorkers
    from mmrl.utils.env import engine_env, init_local_ray

    env = engine_env(run_dir, "cpu", {"VLLM_LOGGING_LEVEL": "WARNING"})
    init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    engine = workers = None
    try:
        # chunked prefill off, as start_runtime sets it on CPU: seeded requests need it (engine.generate)
        kwargs = engine_kwargs(str(model_dir), "float32", 0, {"max_model_len": 512, "enforce_eager": True,
                                                              "enable_chunked_prefill": False,
                                                              "limit_mm_per_prompt": {"image": 2, "video": 0}})
        engine = RolloutEngine.as_actor({"num_cpus": 1}, kwargs, env)
        ray.get(engine.ready.remote(), timeout=600)
        processor = build_processor("auto", str(model_dir))
        workers = RolloutWorkers(1, [engine], {"name": "auto", "model_path": str(model_dir)}, agent_loop,
                                 agent_loop_args)
        workers.ready()
        yield {"engine": engine, "workers": workers, "processor": processor,
               "forbidden": processor.forbidden_token_ids}
    finally:
        if workers is not None:
            workers.close()
        if engine is not None:
            try:
                ray.get(engine.shutdown.remote(), timeout=60)
            except Exception:  # still kill it below
                pass
            ray.kill(engine)
        ray.shutdown()
