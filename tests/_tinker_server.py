"""An `mmrl serve` server in a background thread of the test process, on a free port, for tests that
drive it with the official `tinker` SDK."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
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
            raise TimeoutError(f"mmrl serve not up after {START_TIMEOUT_S} s; the stacks of this process's "
                               f"threads:\n{_thread_stacks()}")
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


def _thread_stacks() -> str:
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
                     for ident, frame in sys._current_frames().items())


class ServerProcess:
    """`mmrl serve` in its own process, as users run it, on a free port (`url`).

    For a server that starts Ray (serve.trainer=deepspeed): Ray then lives in that process, not in
    the test process beside other modules' finished Ray sessions, and a server that hangs is
    killed with everything under it instead of blocking the test process's exit (a worker thread
    stuck in a start is joined forever). On a start that hangs, SIGUSR1 first makes it print every
    thread's stack into its log (mmrl/cli.py), which the error shows."""

    def __init__(self, model_dir: Path, store_dir: Path, log_path: Path, sampler: str = "trainer",
                 extra: tuple[str, ...] = ()):
        config = log_path.with_suffix(".yaml")
        config.write_text("{}\n")  # the defaults, as serve_in_thread's load_config(None, ...)
        cmd = [sys.executable, "-m", "mmrl.cli", "serve", str(config), "--host", "127.0.0.1", "--port", "0",
               f"model.path={model_dir}", f"serve.store_dir={store_dir}", f"serve.sampler={sampler}",
               "serve.model_name=tiny-vlm", *extra]
        env = {**os.environ, "MMRL_API_KEYS": f"{KEY_A},{KEY_B}", "HF_HUB_OFFLINE": "1"}
        self.log_path = log_path
        with open(log_path, "w") as log:
            # run from the log's folder: the defaults' relative paths (work/data/...) exist there no
            # more than on a clean machine, where the server must start all the same
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         cwd=log_path.parent)
        try:
            self.url = _wait_until_up(self.proc, log_path)
        except BaseException:
            self.kill()
            raise

    def stop(self, timeout_s: float = 300) -> int:
        """SIGTERM, as a scheduler stops it (the service stops its ranks and Ray); its exit status."""
        _close_clients(self.url)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        """SIGKILL to what is left of its process group (after stop(), or when it hung)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=60)


def _wait_until_up(proc: subprocess.Popen, log_path: Path) -> str:
    import httpx

    deadline = time.time() + START_TIMEOUT_S
    url = None
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"mmrl serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        if url is None:
            found = re.search(r"Tinker API on (http://\S+) ", log_path.read_text())
            url = found.group(1) if found else None
        if url is not None:
            try:
                if httpx.get(f"{url}/api/v1/healthz", timeout=5).status_code == 200:
                    return url
            except httpx.TransportError:  # bound, not listening until the service has started
                pass
        if time.time() > deadline:
            proc.send_signal(signal.SIGUSR1)  # the CLI's stack dump (mmrl/cli.py)
            time.sleep(3)
            raise TimeoutError(f"mmrl serve not up after {START_TIMEOUT_S} s; its log, ending with every "
                               f"thread's stack:\n{log_path.read_text()[-12000:]}")
        time.sleep(0.5)


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
