"""Each vLLM engine started in a process reads the environment set for it. vLLM freezes its
environment variables once an engine core runs in-process (`vllm.envs.enable_envs_cache`); the
serve's sampler started after another in-process engine (a judge reward, an earlier test) then
bound its ZMQ sockets under the first engine's RPC folder, which that run had removed (CI:
`ZMQError: No such file or directory for ipc path "/tmp/mmrl-rpc-.../..."`)."""
from __future__ import annotations

import pytest

from mmrl.utils.env import reread_vllm_env


def test_an_engine_started_after_another_reads_its_own_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.envs

    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/tmp/mmrl-rpc-first-run")
    vllm.envs.enable_envs_cache()  # what the first in-process engine core does when it starts
    try:
        monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/tmp/mmrl-rpc-second-run")
        assert vllm.envs.VLLM_RPC_BASE_PATH == "/tmp/mmrl-rpc-first-run"  # the freeze this guards against
        reread_vllm_env()
        assert vllm.envs.VLLM_RPC_BASE_PATH == "/tmp/mmrl-rpc-second-run"
    finally:
        vllm.envs.disable_envs_cache()
