"""A rollout engine: vLLM's `AsyncLLM` serving single-trajectory requests inside a Ray actor.

The actor is an asyncio actor: every `generate` call is one request that vLLM batches
continuously with whatever else is in flight, so many agent loops can share one engine without
waiting for each other. Each generated token carries the weight version that sampled it (vLLM
stamps the engine core's outputs; `set_weight_version` is called while generation is paused).

A weight update (`apply_weights`) does not wait for the queue to drain unless told to:
  pause (in-flight requests frozen: `partial="keep"`, aborted: `partial="abort"`, or finished
  first: `partial="wait"`) -> load the staged buckets -> reset caches -> new version -> resume.
With `recompute_kv=True` (the default) pausing also drops the KV cache, so a frozen request
recomputes its prefix under the new weights and its later tokens are exactly the new policy's;
`recompute_kv=False` keeps the old KV (faster, a measured mismatch the correction covers).
"""
from __future__ import annotations

import asyncio
import os
import tempfile
import time
import uuid
from typing import Any

import ray

from mmrl.rollout import model_info_cache
from mmrl.rollout.counters import RequestCounters
from mmrl.rollout.types import Completion, RequestSampling
from mmrl.rollout.vllm_logs import configure_engine_logging

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
    # vLLM's periodic throughput lines; the engine reports its own numbers (EngineStats) instead
    "disable_log_stats": True,
}

PARTIAL_MODES = ("keep", "abort", "wait")

# vLLM's CPU platform turns the in-process executor ("uni") into "mp", so the model worker is a
# third interpreter (actor -> engine core -> worker), each importing vLLM (~8 CPU-s) one after
# the other on the start's critical path, and "mp" pins the worker to one core and reserves the
# other for the engine core. Named by class path the check passes it by: the worker runs inside
# the engine-core process (on CUDA that is vLLM's own default at one GPU). Measured side by side
# under load: engine start 45 s instead of 109 s, 39 CPU-s instead of 67.
# `rollout.engine_args.distributed_executor_backend: mp` restores vLLM's choice.
CPU_IN_PROCESS_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"


def cpu_engine_defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    """mmrl's engine settings on CPU, under anything the user set: eager mode (engine start
    16-27 s instead of ~40 s with torch.compile) and, at one worker, the worker in the engine core."""
    kwargs.setdefault("enforce_eager", True)
    if kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1) == 1:
        kwargs.setdefault("distributed_executor_backend", CPU_IN_PROCESS_EXECUTOR)
    return kwargs


def engine_kwargs(model_path: str, dtype: str, seed: int, engine_args: dict[str, Any],
                  mm_limits: dict[str, int] | None = None, min_pixels: int | None = None,
                  max_pixels: int | None = None) -> dict[str, Any]:
    """vLLM's engine arguments. The processor's pixel budget (`processor.min_pixels/max_pixels`)
    goes to vLLM's own processor too (`mm_processor_kwargs`): otherwise the engine resizes images
    to the model's default budget and sees other vision tokens than the trainer."""
    kwargs = {**DEFAULT_ENGINE_ARGS, "model": model_path, "dtype": dtype, "seed": seed,
              "worker_extension_cls": WORKER_EXTENSION}
    if mm_limits is not None:
        kwargs["limit_mm_per_prompt"] = mm_limits
    pixels = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
    if pixels:
        kwargs["mm_processor_kwargs"] = pixels
    for key, value in engine_args.items():
        kwargs[key] = {**kwargs[key], **value} if key == "mm_processor_kwargs" and key in kwargs else value
    return kwargs


def _stats_logger_factory(sink: dict[str, float]) -> Any:
    """A vLLM stat logger that keeps the scheduler's latest numbers (KV-cache use, queue) in `sink`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Sink(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                usage = float(scheduler_stats.kv_cache_usage)
                sink["kv_cache_usage"] = usage
                sink["kv_cache_usage_peak"] = max(sink.get("kv_cache_usage_peak", 0.0), usage)
                sink["waiting_peak"] = max(sink.get("waiting_peak", 0.0), float(scheduler_stats.num_waiting_reqs))

        def log_engine_initialized(self) -> None:
            pass

    return _Sink


class RolloutEngine:
    """Wraps `vllm.v1.engine.async_llm.AsyncLLM`; used as a Ray actor (`RolloutEngine.as_actor`)."""

    def __init__(self, llm_kwargs: dict[str, Any], env: dict[str, str], partial: str = "keep",
                 recompute_kv: bool = True):
        if partial not in PARTIAL_MODES:
            raise ValueError(f"rollout.partial must be one of {PARTIAL_MODES}, got {partial!r}")
        os.environ.update(env)
        os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(WORKER_SHUTDOWN_GRACE_S))
        # before vLLM is imported: its known-harmless warnings stay off the console
        configure_engine_logging(os.environ.get("VLLM_CACHE_ROOT") or tempfile.mkdtemp(prefix="mmrl-vllm-"))
        self.llm_kwargs, self.partial, self.recompute_kv = llm_kwargs, partial, recompute_kv
        self.llm: Any = None
        self.weight_version = 0
        self.start_seconds = 0.0
        self._scheduler: dict[str, float] = {}
        self.counters = RequestCounters()
        self.moe_layers: list[int] = []  # MoE models: the layers whose routing each request records
        self._shut_down = asyncio.Event()  # ends watch() calls: a clean stop is not a death

    @classmethod
    def as_actor(cls, options: dict[str, Any], llm_kwargs: dict[str, Any], env: dict[str, str],
                 **kwargs: Any) -> Any:
        # max_concurrency: how many generate calls the actor's event loop holds at once (vLLM
        # queues what does not fit into a batch); Ray's default for async actors is 1000.
        return ray.remote(cls).options(**{"max_concurrency": 4096, **options}).remote(llm_kwargs, env, **kwargs)

    async def ready(self) -> dict[str, Any]:
        """Start the engine (on the actor's event loop, which AsyncLLM's output task needs)."""
        if self.llm is None:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            from mmrl.utils.env import reread_vllm_env

            reread_vllm_env()  # this engine's env (RPC folder, cache root), not an earlier engine's
            t0 = time.time()
            cache_root = os.environ.get("VLLM_CACHE_ROOT")
            if cache_root:  # spares vLLM a fresh interpreter that inspects the model class
                model_info_cache.seed_run_cache(cache_root)
            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.llm_kwargs),
                                                 stat_loggers=[_stats_logger_factory(self._scheduler)])
            if cache_root:
                model_info_cache.keep_run_cache(cache_root)
            await self.llm.update_weight_version(str(self.weight_version))
            # MoE models: record every request's routed experts (routing replay, R3); [] if dense
            self.moe_layers = (await self.llm.collective_rpc("mmrl_capture_routing"))[0]
            self.start_seconds = time.time() - t0
        return {"start_seconds": self.start_seconds, "pid": os.getpid()}

    async def generate(self, prompt: dict[str, Any], sampling: RequestSampling) -> Completion:
        """One response to `prompt` (a vLLM prompt dict: token ids plus multimodal data).
        A request aborted by a weight update with `partial="abort"` returns what it had, with
        `finish_reason="abort"`; the rollout client resubmits it with that prefix."""
        return (await self.generate_many(prompt, [sampling]))[0]

    async def generate_many(self, prompt: dict[str, Any], samplings: list[RequestSampling]) -> list[Completion]:
        """Several responses to one prompt, each its own request (one actor call for a group).
        The prompt is rendered once (vLLM's own n-sample requests share one rendering too)."""
        # vLLM's rendering of a token-id prompt with its images/videos: the multimodal processor
        # runs here, in the engine actor
        (engine_input,) = await self.llm.renderer.render_cmpl_async([prompt])
        return list(await asyncio.gather(*[self._generate(engine_input, s) for s in samplings]))

    async def _generate(self, engine_input: Any, sampling: RequestSampling) -> Completion:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=1, max_tokens=sampling.max_tokens,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            logprobs=0,  # the sampled token's logprob
            # clamped to -100 by vLLM: probability ~e^-100; the trainer applies the same bias
            logit_bias={t: -100.0 for t in sampling.forbidden_token_ids} or None,
            # One seed per trajectory: its draws depend on nothing else the engine runs, so how
            # requests happen to be batched (timing-dependent) cannot change them. On CPU this
            # needs chunked prefill off (start_runtime sets it): vLLM rewinds a generator after
            # a partial prefill and CPU generators cannot rewind.
            seed=sampling.seed, stop=list(sampling.stop) or None, ignore_eos=sampling.ignore_eos,
            output_kind=RequestOutputKind.DELTA)
        request_id = f"{sampling.request_key or 'r'}-{uuid.uuid4().hex[:12]}"
        self.counters.enter(request_id)
        ids: list[int] = []
        logprobs: list[float] = []
        text, finish, spans = "", None, None
        try:
            # streamed as deltas: progress() can tell how far each request is
            async for out in self.llm.generate(engine_input, params, request_id=request_id):
                c = out.outputs[0]
                new = list(c.token_ids)
                logprobs += [float(step[tok].logprob) for tok, step in zip(new, c.logprobs or [])]
                ids += new
                text += c.text
                self.counters.progress[request_id] = len(ids)
                finish, spans = c.finish_reason, c.weight_versions or spans
        finally:
            self.counters.leave(request_id, len(ids))
        routing = await self._routing(request_id, len(ids))
        return Completion(token_ids=ids, logprobs=logprobs, text=text, finish_reason=finish,
                          token_versions=self._token_versions(spans, len(ids)), routed_experts=routing)

    async def _routing(self, request_id: str, n: int) -> Any:
        """(n, MoE layers, k) int16 expert ids of a finished (or aborted) request; None for a
        dense model. Taken in any case, so the worker forgets the request."""
        if not self.moe_layers:
            return None
        import numpy as np

        taken = (await self.llm.collective_rpc("mmrl_take_routing", args=(request_id, n)))[0]
        if n == 0:
            return None
        if taken["rows"] != n:
            raise RuntimeError(f"request {request_id}: routing recorded for {taken['rows']} of its {n} tokens")
        return np.frombuffer(bytes(taken["data"]), dtype=np.int16).reshape(n, len(self.moe_layers), -1).copy()

    def _token_versions(self, spans: Any, n: int) -> list[int]:
        if not spans:
            return [self.weight_version] * n
        versions: list[int] = []
        for span in spans:
            versions += [int(span.version)] * (span.end - span.start)
        return versions[:n] + [self.weight_version] * (n - len(versions))

    def stats(self, reset_peaks: bool = False) -> dict[str, float]:
        """Totals so far (generated tokens, busy seconds: any request in flight, pauses) and peaks
        since the last reset (requests in flight, vLLM's waiting queue and KV-cache use)."""
        out = {**self.counters.stats(reset_peaks), **self._scheduler}
        if reset_peaks:
            self._scheduler.pop("kv_cache_usage_peak", None)
            self._scheduler.pop("waiting_peak", None)
        return out

    def progress(self) -> dict[str, int]:
        """Tokens received so far by each request in flight (request id -> count)."""
        return dict(self.counters.progress)

    def configure(self, partial: str | None = None, recompute_kv: bool | None = None) -> None:
        """Change what the next weight updates do to requests in flight (see the module docstring)."""
        if partial is not None:
            if partial not in PARTIAL_MODES:
                raise ValueError(f"rollout.partial must be one of {PARTIAL_MODES}, got {partial!r}")
            self.partial = partial
        if recompute_kv is not None:
            self.recompute_kv = recompute_kv

    # ---- weight sync (called by trainer rank 0) -------------------------------------------------
    async def stage_weights(self, payload: bytes) -> int:
        return sum(await self.llm.collective_rpc("mmrl_stage_bucket", args=(payload,)))

    async def apply_weights(self, version: int) -> dict[str, float]:
        """Pause, load the staged weights, reset caches, set `version`, resume (see the module
        docstring). Returns the tensor count, the pause length and the requests it froze."""
        t0 = time.time()
        frozen = len(self.counters.in_flight)
        await self.llm.pause_generation(mode=self.partial, clear_cache=self.recompute_kv)
        try:
            n = (await self.llm.collective_rpc("mmrl_apply_staged"))[0]
            # Stale caches after an update: vision-encoder outputs (a scheduler/worker mismatch
            # kills the engine with "Encoder cache miss") and cached prefix KV blocks. With the
            # old KV kept, blocks that running requests hold cannot be dropped: they are the
            # measured mismatch of recompute_kv=False.
            await self.llm.reset_encoder_cache()
            await self.llm.reset_mm_cache()
            await self.llm.reset_prefix_cache()
            self.weight_version = version
            await self.llm.update_weight_version(str(version))
        finally:
            await self.llm.resume_generation()
        seconds = time.time() - t0
        self.counters.paused(seconds)
        return {"tensors": float(n), "apply_seconds": seconds, "frozen_requests": float(frozen)}

    # ---- weight sync bucket by bucket (weight_sync.transport collective / cuda_ipc) -------------
    # begin_weight_update -> receive_bucket(_ipc) per bucket -> finish_weight_update: the same
    # pause / reset caches / new version / resume as apply_weights, but each bucket is loaded as
    # it arrives, so nothing is staged (mmrl/weight_sync/collective.py).
    async def weight_workers(self) -> list[dict[str, Any]]:
        """Each vLLM worker's rank and GPU UUID (the weight-sync group has one member per worker)."""
        return await self.llm.collective_rpc("mmrl_worker_info")

    async def join_weight_group(self, host: str, port: int, first_rank: int, world_size: int, backend: str,
                                timeout_s: float, name: str) -> list[int]:
        return await self.llm.collective_rpc("mmrl_join_weight_group",
                                             args=(host, port, first_rank, world_size, backend, timeout_s, name))

    async def begin_weight_update(self) -> None:
        """Pause (as `partial`/`recompute_kv` say) and open the workers' reload sessions."""
        self._update_started = time.time()
        self._update_frozen = len(self.counters.in_flight)
        await self.llm.pause_generation(mode=self.partial, clear_cache=self.recompute_kv)
        try:
            await self.llm.collective_rpc("mmrl_begin_update")
        except BaseException:
            await self.llm.resume_generation()
            raise

    async def receive_bucket(self, header: str) -> int:
        return (await self.llm.collective_rpc("mmrl_receive_bucket", args=(header,)))[0]

    async def receive_bucket_ipc(self, header: str, handle: bytes) -> int:
        return (await self.llm.collective_rpc("mmrl_receive_bucket_ipc", args=(header, handle)))[0]

    async def finish_weight_update(self, version: int | None) -> dict[str, float]:
        """Close the sessions, reset the caches, set `version` (None: an aborted update keeps the
        old number), resume. Returns the pause length and the most the workers staged at once."""
        try:
            done = await self.llm.collective_rpc("mmrl_finish_update")
            await self.llm.reset_encoder_cache()  # see apply_weights
            await self.llm.reset_mm_cache()
            await self.llm.reset_prefix_cache()
            if version is not None:
                self.weight_version = version
                await self.llm.update_weight_version(str(version))
        finally:
            await self.llm.resume_generation()
        seconds = time.time() - getattr(self, "_update_started", time.time())  # no start: a failed begin
        self.counters.paused(seconds)
        return {"apply_seconds": seconds, "frozen_requests": float(getattr(self, "_update_frozen", 0)),
                "tensors": max(d.get("tensors", 0.0) for d in done),
                "peak_staged_bytes": max(d.get("peak_staged_bytes", 0.0) for d in done),
                "staged_tensors": max(d["staged_tensors"] for d in done)}

    async def pause(self) -> None:
        """Freeze generation (tests and controllers that want a stable point)."""
        await self.llm.pause_generation(mode=self.partial, clear_cache=self.recompute_kv)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def weights_checksum(self) -> float:
        return (await self.llm.collective_rpc("mmrl_weights_checksum"))[0]

    def get_weight_version(self) -> int:
        return self.weight_version

    async def watch(self) -> None:
        """Returns only when the engine shuts down. The driver keeps one call open per engine: if
        the actor dies, the call fails at once, which is how a dead engine is noticed while the
        driver waits on rollouts (mmrl/rollout/workers.py, RolloutWorkers.wait)."""
        await self._shut_down.wait()

    async def shutdown(self) -> None:
        """Stop the engine core process cleanly: killing the actor outright leaves vLLM's
        shared-memory ring buffers (hundreds of MB in /dev/shm) behind."""
        self._shut_down.set()
        if self.llm is not None:
            llm, self.llm = self.llm, None
            await asyncio.get_running_loop().run_in_executor(None, lambda: llm.shutdown(timeout=SHUTDOWN_GRACE_S))


    # ---- colocated mode (cluster.colocate; mmrl/controller/colocate.py) --------------------------
    async def sleep(self, level: int = 1) -> None:
        """vLLM sleep mode (engine arg enable_sleep_mode, CUDA only): level 1 moves the weights to
        host memory and frees the KV cache, so the trainer rank on this GPU can use it. Called
        between a sync step's rollout and update, when no request is in flight; one that were
        would be aborted (mode="abort")."""
        await self.llm.sleep(level, mode="abort")

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Back on the GPU: `tags` ["weights"], then ["kv_cache"] (None: all). Returns whether
        the engine is fully awake (vLLM resumes scheduling only then)."""
        return await self.llm.wake_up(tags)

    async def is_sleeping(self) -> bool:
        return await self.llm.is_sleeping()
