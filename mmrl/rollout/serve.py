"""`mmrl serve-rollout CONFIG`: the rollout engines of a config behind the OpenAI-compatible
proxy (rollout/proxy.py), for agents that run outside mmrl. Requests name their trajectory
(`/t/<id>/v1/...`, the `X-Trajectory-Id` header or `extra_body={"trajectory_id": ...}`);
`GET /trajectories/<id>` returns what was recorded for it: prompt and response token ids, loss
mask, logprobs, weight versions and the drift counters. Sampling follows the config's rollout
settings; the engines keep the config's model weights (no trainer runs here).
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from mmrl.config.schema import Config


def serve_rollout(cfg: Config, host: str = "127.0.0.1", port: int = 8000, on_drift: str = "splice",
                  parser: str | None = "hermes") -> None:
    import ray
    import uvicorn

    from mmrl import registry
    from mmrl.controller.placement import placement_plan
    from mmrl.processors import build_processor
    from mmrl.rollout.client import Router
    from mmrl.rollout.engine import RolloutEngine, cpu_engine_defaults, engine_kwargs
    from mmrl.rollout.proxy import RolloutProxy, make_app
    from mmrl.rollout.types import RequestSampling
    from mmrl.utils.env import apply_env, engine_env, init_local_ray, resolve_device

    # Bound before the engines start: a taken port fails now, not after minutes of start-up, and
    # port 0 (any free port, printed below) cannot be taken by another process in between.
    listener = _listen(host, port)
    port = listener.getsockname()[1]
    run_dir = Path(cfg.run.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.cluster.device.value)
    env = engine_env(run_dir, device, {"VLLM_LOGGING_LEVEL": "WARNING", **cfg.rollout.engine_env})
    apply_env(env)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if cfg.cluster.ray_address:
        ray.init(address=cfg.cluster.ray_address, runtime_env={"env_vars": env})
    else:
        init_local_ray(num_cpus=cfg.cluster.num_cpus or os.cpu_count(), include_dashboard=False,
                       runtime_env={"env_vars": env}, log_to_driver=True)
    processor = build_processor(cfg.processor.name, cfg.model.path, min_pixels=cfg.processor.min_pixels,
                                max_pixels=cfg.processor.max_pixels, max_prompt_tokens=cfg.processor.max_prompt_tokens,
                                trust_remote_code=cfg.model.trust_remote_code)
    kwargs = engine_kwargs(cfg.model.path, cfg.model.dtype.value, cfg.run.seed, cfg.rollout.engine_args,
                           min_pixels=cfg.processor.min_pixels, max_pixels=cfg.processor.max_pixels)
    kwargs.setdefault("trust_remote_code", cfg.model.trust_remote_code)
    if device == "cpu":
        cpu_engine_defaults(kwargs)
    engines = [RolloutEngine.as_actor(p.ray_options(), {**kwargs, "seed": cfg.run.seed + p.index}, env)
               for p in placement_plan(cfg, device) if p.role == "rollout"]
    ray.get([e.ready.remote() for e in engines])
    router = Router(engines, cfg.rollout.max_requests_per_engine)

    async def generate(trajectory_id: str, prompt: dict[str, Any], sampling: RequestSampling) -> Any:
        return await router.client(trajectory_id).generate(prompt, sampling)

    forbidden = processor.forbidden_token_ids if cfg.rollout.forbid_vision_tokens else []
    sampling = RequestSampling(max_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                               top_p=cfg.rollout.top_p, forbidden_token_ids=list(forbidden))
    proxy = RolloutProxy(processor, generate, sampling, parser=registry.resolve("tool_parser", parser) if parser else None,
                         on_drift=on_drift, model_name=Path(cfg.model.path).name)
    print(f"[mmrl] rollout proxy on http://{host}:{port}/v1 ({len(engines)} engine(s), model {cfg.model.path})",
          flush=True)
    try:
        uvicorn.Server(uvicorn.Config(make_app(proxy), log_level="warning")).run(sockets=[listener])
    finally:
        for e in engines:
            ray.kill(e)
        ray.shutdown()


def _listen(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise SystemExit(f"serve-rollout: cannot listen on {host}:{port} ({e.strerror}); pick another --port, "
                         f"or --port 0 for any free one (the address is printed when the server is up)") from None
    return sock
