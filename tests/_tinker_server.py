"""An `mmrl serve` server in a background thread of the test process, on a free port, for tests that
drive it with the official `tinker` SDK."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

KEY_A = "tml-test-key-aaaaaaaaaaaaaaaa"
KEY_B = "tml-test-key-bbbbbbbbbbbbbbbb"
START_TIMEOUT_S = 600  # a hang guard (vLLM start on a loaded 2-core machine), not a speed check


def serve_in_thread(model_dir: Path, store_dir: Path, sampler: str = "trainer",
                    extra: tuple[str, ...] = (), on_app: Callable[[Any], None] | None = None) -> Iterator[str]:
    import uvicorn

    from mmrl.config import load_config
    from mmrl.serve import build_app

    cfg = load_config(None, [f"model.path={model_dir}", f"serve.store_dir={store_dir}", f"serve.sampler={sampler}",
                             "serve.model_name=tiny-vlm", *extra], check_files=False)
    app = build_app(cfg, keys=[KEY_A, KEY_B])
    if on_app is not None:  # a test that reaches the app's state (e.g. app.state.quotas' clock)
        on_app(app)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("mmrl serve did not start (see the log above)")
        if time.time() > deadline:
            raise TimeoutError(f"mmrl serve not up after {START_TIMEOUT_S} s")
        time.sleep(0.2)
    url = f"http://127.0.0.1:{port}"
    try:
        yield url
    finally:
        _close_clients(url)
        server.should_exit = True
        thread.join(timeout=120)


# `with running_server(model_dir, store_dir) as url:` for a test that stops and restarts a server
running_server = contextmanager(serve_in_thread)


_CLIENTS: dict[str, list[Any]] = {}  # base URL -> the SDK clients made for it (closed with its server)


def service_client(base_url: str, key: str = KEY_A) -> Any:
    import tinker

    client = tinker.ServiceClient(base_url=base_url, api_key=key)
    _CLIENTS.setdefault(base_url, []).append(client)
    return client


def _close_clients(base_url: str) -> None:
    """End the SDK sessions made for a server before it stops: otherwise their heartbeat threads
    outlive it and report "Tinker is down" until the test process exits."""
    for client in _CLIENTS.pop(base_url, []):
        try:
            client.close("success").result(timeout=30)
        except Exception:  # noqa: BLE001 -- a session the test already ended or broke on purpose
            pass


def image_input(tokenizer, model_dir, expected_delta: int = 0):
    """(chunks before the image, the image chunk, token ids of the whole sequence with the image's
    pads) for a 56x56 PNG, laid out as tinker-cookbook's Qwen-VL renderers do."""
    import io

    from tinker import types
    from PIL import Image
    from transformers import AutoProcessor

    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 30, 30)).save(buf, format="PNG")
    ip = AutoProcessor.from_pretrained(model_dir).image_processor
    n = ip.get_number_of_image_patches(56, 56, {}) // ip.merge_size ** 2
    vs, ve, pad = (tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>"))
    pre = tokenizer.encode("look:") + [vs]
    post = [ve] + tokenizer.encode(" it is red")
    image = types.ImageChunk(data=buf.getvalue(), format="png", expected_tokens=n + expected_delta)
    return pre, image, post, pre + [pad] * n + post


def sample_and_score(sampler: Any, chunks: list, seed: int, max_tokens: int = 4) -> tuple[Any, list]:
    """One sampled sequence for the prompt `chunks`, and compute_logprobs over prompt + that sequence."""
    from tinker import types

    seq = sampler.sample(types.ModelInput(chunks=chunks), 1, types.SamplingParams(max_tokens=max_tokens, seed=seed)
                         ).result().sequences[0]
    scored = sampler.compute_logprobs(types.ModelInput(chunks=chunks + [types.EncodedTextChunk(tokens=seq.tokens)])
                                      ).result()
    return seq, scored
