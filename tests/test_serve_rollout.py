"""`mmrl serve-rollout`: the config's engines behind the OpenAI-compatible proxy, used by an
outside agent through the `openai` package (a real engine in a real server process)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_serve_rollout_records_an_outside_agents_trajectory(tiny_model_dir: Path, colors_dir: Path, tmp_path: Path) -> None:
    import httpx
    from openai import OpenAI

    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmrl.cli", "serve-rollout", str(REPO / "configs" / "colors_demo.yaml"),
         f"model.path={tiny_model_dir}", f"data.train_shards={colors_dir}/train-000000.tar",
         f"data.heldout_shards={colors_dir}/heldout-000000.tar", f"run.output_dir={tmp_path / 'run'}",
         "rollout.max_new_tokens=6", "cluster.num_cpus=2", "--port", "0"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 900  # a hang guard: the engine starts in minutes on a loaded machine
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            port = _served_port(tmp_path / "serve.log")
            try:
                if port and httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(1)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        messages = [{"role": "user", "content": "Name a colour."}]
        first = client.chat.completions.create(model="m", messages=messages, extra_body={"trajectory_id": "t1"})
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Another one."}]
        second = client.chat.completions.create(model="m", messages=messages, extra_headers={"X-Trajectory-Id": "t1"},
                                                max_tokens=3)
        record = httpx.get(f"http://127.0.0.1:{port}/trajectories/t1", timeout=10).json()
        # token-in/token-out extras ride along the OpenAI fields
        ids_1, ids_2 = first.choices[0].token_ids, second.choices[0].token_ids
        assert 0 < len(ids_1) <= 6 and 0 < len(ids_2) <= 3
        sampled = [t for t, m in zip(record["response_ids"], record["loss_mask"]) if m]
        assert sampled == ids_1 + ids_2 and record["proxy_calls"] == 2
        assert record["prompt_ids"] == first.prompt_token_ids
        assert all(v == 0 for v, m in zip(record["weight_versions"], record["loss_mask"]) if m)
        assert httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"messages": messages}).status_code == 400
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()


def _served_port(log: Path) -> int | None:
    """The port the server printed (it was started with --port 0: the kernel picked it)."""
    found = re.search(r"rollout proxy on http://127\.0\.0\.1:(\d+)/v1", log.read_text())
    return int(found.group(1)) if found else None
