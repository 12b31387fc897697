"""A vLLM engine inside a Ray actor: generates with behaviour logprobs, takes weight pushes."""
from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import ray

from mmrl.rollout.types import Completion, SamplingConfig
from mmrl.rollout.vllm_logs import configure_engine_logging

# Seed spacing between the requests of one call: more than any group size, so no two samples share a seed.
SEED_STRIDE = 4096

# A clean engine stop takes 5-8 s on a 2-core machine (the worker exits, then the engine core tears
# down); vLLM's default 5 s for each made it force-kill the engine core at the end of nearly every
# run, with a warning and shared memory left to Python's resource tracker.
SHUTDOWN_GRACE_S = 30.0  # the engine core, waited on by this actor
WORKER_SHUTDOWN_GRACE_S = 15  # the worker, waited on by the engine core (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS)

WORKER_EXTENSION = "mmrl.weight_sync.vllm_extension.WeightSyncExtension"

# Defaults mmrl needs; rollout.engine_args overrides any of them.
DEFAULT_ENGINE_ARGS: dict[str, Any] = {
    # Logprobs after temperature and logit bias: what the sampler actually drew from, and what
    # the trainer recomputes.
    "logprobs_mode": "processed_logprobs",
    "max_model_len": 2048,
    "use_tqdm_on_load": False,  # a progress bar for loading a checkpoint, per engine start
}


def engine_kwargs(model_path: str, dtype: str, seed: int, engine_args: dict[str, Any],
                  mm_limits: dict[str, int] | None = None) -> dict[str, Any]:
    kwargs = {**DEFAULT_ENGINE_ARGS, "model": model_path, "dtype": dtype, "seed": seed,
              "worker_extension_cls": WORKER_EXTENSION}
    if mm_limits is not None:
        kwargs["limit_mm_per_prompt"] = mm_limits
    kwargs.update(engine_args)
    return kwargs


class RolloutEngine:
    """Wraps `vllm.LLM`. Used as a Ray actor (`RolloutEngine.as_actor(...)`) in training, and
    directly in tests that want an in-process engine."""

    def __init__(self, llm_kwargs: dict[str, Any], env: dict[str, str]):
        os.environ.update(env)
        os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(WORKER_SHUTDOWN_GRACE_S))
        # before vLLM is imported: its known-harmless warnings stay off the console
        configure_engine_logging(os.environ.get("VLLM_CACHE_ROOT") or tempfile.mkdtemp(prefix="mmrl-vllm-"))
        from vllm import LLM

        t0 = time.time()
        self.llm = LLM(**llm_kwargs)
        self.start_seconds = time.time() - t0
        self.weight_version = 0

    @classmethod
    def as_actor(cls, options: dict[str, Any], llm_kwargs: dict[str, Any], env: dict[str, str]) -> Any:
        return ray.remote(cls).options(**options).remote(llm_kwargs, env)

    def ready(self) -> dict[str, Any]:
        return {"start_seconds": self.start_seconds, "pid": os.getpid()}

    def generate(self, requests: list[dict[str, Any]], sampling: SamplingConfig) -> list[list[Completion]]:
        """One list of `sampling.n` completions per request, in request order."""
        from vllm import SamplingParams

        base = dict(
            n=sampling.n,
            max_tokens=sampling.max_new_tokens,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            logprobs=0,  # the sampled token's logprob
            # clamped to -100 by vLLM: probability ~e^-100; the trainer applies the same bias
            logit_bias={t: -100.0 for t in sampling.forbidden_token_ids} or None,
        )
        if sampling.seed is None:
            params: Any = SamplingParams(**base)
        else:
            # One seed per request (vLLM gives its n samples seed, seed+1, ...): each request's draws
            # then depend on nothing else in the batch, so how the engine happens to batch the
            # requests (timing-dependent) cannot change them. On CPU this needs chunked prefill
            # off (start_runtime sets it): vLLM rewinds a generator after a partial prefill and
            # CPU generators cannot rewind ("CPU Generator does not use offset").
            params = [SamplingParams(**base, seed=sampling.seed + i * SEED_STRIDE) for i in range(len(requests))]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        result = []
        for out in outputs:
            group = []
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [float(step[tok].logprob) for tok, step in zip(ids, c.logprobs or [])]
                group.append(Completion(token_ids=ids, logprobs=lps, text=c.text, finish_reason=c.finish_reason))
            result.append(group)
        return result

    # ---- weight sync (called by trainer rank 0) -------------------------------------------------
    def stage_weights(self, payload: bytes) -> int:
        return sum(self.llm.collective_rpc("mmrl_stage_bucket", args=(payload,)))

    def apply_weights(self, version: int) -> dict[str, float]:
        t0 = time.time()
        n = self.llm.collective_rpc("mmrl_apply_staged")[0]
        # Stale caches after an update: cached prefix KV blocks and vision-encoder outputs were
        # computed with the old weights (and a scheduler/worker mismatch kills the engine with
        # "Encoder cache miss"). Reset both, every time.
        self.llm.llm_engine.reset_encoder_cache()
        self.llm.reset_prefix_cache()
        self.weight_version = version
        return {"tensors": float(n), "apply_seconds": time.time() - t0}

    def weights_checksum(self) -> float:
        return self.llm.collective_rpc("mmrl_weights_checksum")[0]

    def get_weight_version(self) -> int:
        return self.weight_version

    def shutdown(self) -> None:
        """Stop the engine core process cleanly: killing the actor outright leaves vLLM's
        shared-memory ring buffers (hundreds of MB in /dev/shm) behind."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_GRACE_S)
            self.llm = None
