"""`mmrl serve CONFIG`: a self-hosted Tinker API backend for vision-language models (docs/service.md).

app.py (routes) -> service.py (engines and checkpoints) -> trainer.py (a peft LoRA per training
client, in the server process) or ranks.py (the same on DeepSpeed ZeRO-3 ranks), sampler.py (vLLM or transformers), futures.py (ordered per-model queues), store.py (SQL),
auth.py (API keys), wire.py (the SDK's protobuf bodies), inputs.py (text and image chunks),
losses.py (Tinker's built-in losses), openapi.py (the request bodies in /openapi.json).
"""
from __future__ import annotations

import logging
import socket
from typing import Any


def build_app(cfg: Any, keys: list[str] | None = None) -> Any:
    from mmrl.serve.app import make_app
    from mmrl.serve.auth import Keys, load_keys
    from mmrl.serve.service import Service

    keys = keys if keys is not None else load_keys(cfg.serve.api_keys_file)
    return make_app(Service(cfg), Keys(keys))


def serve(cfg: Any, host: str | None = None, port: int | None = None) -> None:
    """Run the server until interrupted. Port 0: any free port (printed)."""
    import uvicorn

    host = host or cfg.serve.host
    port = cfg.serve.port if port is None else port
    app = build_app(cfg)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    print(f"mmrl serve: Tinker API on http://{host}:{sock.getsockname()[1]} (model {cfg.model.path})", flush=True)
    logging.basicConfig(level=logging.INFO)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])
