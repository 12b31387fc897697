"""The rollout client: how agent loops reach the engines.

`Router` spreads requests over the engine actors: a new trajectory goes to the engine with the
least in-flight work (requested tokens not yet returned), and every later request of the same
trajectory sticks to that engine, so a multi-turn prefix hits its prefix cache. At most
`max_requests_per_engine` requests wait on one engine; a loop asking for more awaits its turn
(back-pressure instead of an unbounded queue inside vLLM).

Requests for the same prompt object on the same engine that are issued in the same event-loop
turn (a group's `group_size` single-turn loops start together) travel in ONE actor call; inside
the engine they are still separate requests (own seeds, versions, aborts). One Ray call per
group instead of per trajectory keeps the per-call cost of the actor hop off the rollout.

An agent loop holds a `RolloutClient`: the router seen by one trajectory. A request that a weight
update aborted (`rollout.partial=abort`) is resubmitted here with the tokens it already has as a
prefix, so the loop sees one completion whose tokens carry the versions that sampled them.

An engine actor that dies fails its requests with `EngineLost`; the client resubmits each one
unchanged (same seed, same prefix) on a live engine, or waits until the driver has started a
replacement with the current weights (`Router.replace_engine`). Under the same weights and seed
the resubmitted request draws the same tokens the lost one would have.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from mmrl.rollout.types import Completion, RequestSampling, SamplingConfig, join_routing


class EngineLost(RuntimeError):
    """The engine actor a request went to died before answering."""

    def __init__(self, engine: int, cause: BaseException):
        super().__init__(f"rollout engine {engine} died: {type(cause).__name__}: {cause}")
        self.engine = engine


@dataclass
class EngineLoad:
    """What the router knows about one engine (from its own requests)."""

    in_flight_requests: int = 0
    in_flight_tokens: int = 0  # token budget of the requests in flight
    requests: int = 0
    generated_tokens: int = 0
    resubmitted: int = 0
    lost: int = 0  # requests that died with the engine and were resubmitted
    # (start, end) wall times of this router's requests: busy intervals for the trace
    windows: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class _Batch:
    prompt: dict[str, Any]
    items: list[tuple[RequestSampling, Any]] = field(default_factory=list)
    task: Any = None


class Router:
    """Least-loaded, sticky routing of single requests over engine actors (see module docstring)."""

    def __init__(self, engines: Sequence[Any], max_requests_per_engine: int = 256,
                 replaces_engines: bool = False):
        self.engines = list(engines)
        # True when someone (the run's driver) replaces dead engines: a request may then wait
        # for one; otherwise a request whose engines are all dead fails
        self.replaces_engines = replaces_engines
        self.load = [EngineLoad() for _ in self.engines]
        self._sticky: dict[str, int] = {}
        self._slots = [asyncio.Semaphore(max_requests_per_engine) for _ in self.engines]
        # (engine, id(prompt)) -> the batch being collected in this event-loop turn
        self._collecting: dict[tuple[int, int], _Batch] = {}
        self._up = [asyncio.Event() for _ in self.engines]  # cleared while an engine is dead
        for up in self._up:
            up.set()

    def pick(self, key: str) -> int:
        """The engine for trajectory `key`: its engine so far, else the least loaded live one."""
        if not self.engines:
            raise RuntimeError("this rollout has no engines to generate with (rollout.num_engines=0)")
        if key not in self._sticky:
            live = [i for i in range(len(self.engines)) if self._up[i].is_set()] or list(range(len(self.engines)))
            self._sticky[key] = min(live, key=lambda i: (self.load[i].in_flight_tokens,
                                                         self.load[i].in_flight_requests, i))
        return self._sticky[key]

    def engine_lost(self, engine: int, handle: Any) -> None:
        """`handle` (engine `engine`) died; unless it was replaced already, route around it."""
        if self.engines[engine] is handle:
            self._up[engine].clear()

    def replace_engine(self, engine: int, handle: Any) -> None:
        """The driver started `handle` in place of a dead engine (with the current weights)."""
        self.engines[engine] = handle
        self._up[engine].set()

    def any_engine_up(self) -> bool:
        return any(up.is_set() for up in self._up)

    async def until_an_engine_is_up(self) -> None:
        if self.any_engine_up():
            return
        waits = [asyncio.ensure_future(up.wait()) for up in self._up]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def release(self, key: str) -> None:
        """The trajectory is over: forget its engine."""
        self._sticky.pop(key, None)

    def client(self, key: str) -> "RolloutClient":
        return RolloutClient(self, key)

    async def _request(self, engine: int, prompt: dict[str, Any], sampling: RequestSampling) -> Completion:
        load = self.load[engine]
        async with self._slots[engine]:
            load.in_flight_requests += 1
            load.in_flight_tokens += sampling.max_tokens
            t0 = time.time()
            try:
                completion = await self._join_batch(engine, prompt, sampling)
            finally:
                load.in_flight_requests -= 1
                load.in_flight_tokens -= sampling.max_tokens
            load.windows.append((t0, time.time()))
            load.requests += 1
            load.generated_tokens += len(completion.token_ids)
            return completion

    def _join_batch(self, engine: int, prompt: dict[str, Any], sampling: RequestSampling) -> "asyncio.Future[Completion]":
        loop = asyncio.get_running_loop()
        key = (engine, id(prompt))
        batch = self._collecting.get(key)
        if batch is None:
            batch = self._collecting[key] = _Batch(prompt)
            loop.call_soon(self._send, key)  # after the requests already started in this turn
        future: asyncio.Future[Completion] = loop.create_future()
        batch.items.append((sampling, future))
        return future

    def _send(self, key: tuple[int, int]) -> None:
        from ray.exceptions import RayActorError

        batch = self._collecting.pop(key)
        handle = self.engines[key[0]]
        call = handle.generate_many.remote(batch.prompt, [s for s, _ in batch.items])

        async def deliver() -> None:
            try:
                completions = await call
            except BaseException as e:  # the engine failed: every request of the batch fails with it
                if isinstance(e, RayActorError):  # the actor died: the requests go elsewhere
                    self.engine_lost(key[0], handle)
                    e = EngineLost(key[0], e)
                for _, future in batch.items:
                    if not future.done():
                        future.set_exception(e)
                return
            for (_, future), completion in zip(batch.items, completions):
                if not future.done():
                    future.set_result(completion)

        batch.task = asyncio.ensure_future(deliver())  # kept: a task nobody references may be collected

    def take_windows(self) -> list[list[tuple[float, float]]]:
        """Busy windows per engine since the last call (then forgotten)."""
        out = [load.windows for load in self.load]
        for load in self.load:
            load.windows = []
        return out


class RolloutClient:
    """One trajectory's view of the router: `await client.generate(prompt, sampling)`."""

    def __init__(self, router: Router, key: str):
        self.router, self.key = router, key
        self.engine: int | None = None  # the engine this trajectory's requests went to
        self.requests = 0

    async def generate(self, prompt: dict[str, Any], sampling: RequestSampling) -> Completion:
        """One response to `prompt` (a vLLM prompt dict: `prompt_token_ids` plus multimodal data).
        A request aborted by a weight update continues from its tokens so far."""
        sampling = RequestSampling(**{**sampling.__dict__, "request_key": self.key})
        token_ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        routing: list[tuple[Any, int]] = []
        text, attempt, current_prompt, current = "", 0, prompt, sampling
        while True:
            if self.router.replaces_engines:
                await self.router.until_an_engine_is_up()
            self.engine = self.router.pick(self.key)
            self.requests += 1
            try:
                c = await self.router._request(self.engine, current_prompt, current)
            except EngineLost:  # the same request again (same seed and prefix) on a live engine
                self.router.load[self.engine].lost += 1
                self.router.release(self.key)
                if not (self.router.replaces_engines or self.router.any_engine_up()):
                    raise
                continue
            token_ids += c.token_ids
            logprobs += c.logprobs
            versions += c.token_versions
            routing.append((c.routed_experts, len(c.token_ids)))
            text += c.text
            if c.finish_reason != "abort" or len(token_ids) >= sampling.max_tokens:
                finish = c.finish_reason if c.finish_reason != "abort" else "length"
                return Completion(token_ids=token_ids, logprobs=logprobs, text=text, finish_reason=finish,
                                  token_versions=versions, routed_experts=join_routing(routing))
            attempt += 1
            self.router.load[self.engine].resubmitted += 1
            current_prompt = {**prompt, "prompt_token_ids": list(prompt["prompt_token_ids"]) + token_ids}
            current = sampling.continued(len(token_ids), attempt)

    def close(self) -> None:
        self.router.release(self.key)


def generate_groups(engines: Sequence[Any], prompts: Sequence[dict[str, Any]],
                    sampling: SamplingConfig) -> list[list[Completion]]:
    """`sampling.n` completions per vLLM prompt dict, through a router over `engines`, from
    synchronous code (scripts, tests, tools). Trajectory `j` of prompt `i` is seeded as in
    training (`SamplingConfig.for_trajectory(i, j)`)."""

    async def run() -> list[list[Completion]]:
        router = Router(engines)

        async def one(i: int, j: int) -> Completion:
            request = sampling.for_trajectory(i, j)
            client = router.client(request.request_key)
            try:
                return await client.generate(prompts[i], request)
            finally:
                client.close()

        flat = await asyncio.gather(*[one(i, j) for i in range(len(prompts)) for j in range(sampling.n)])
        return [list(flat[i * sampling.n:(i + 1) * sampling.n]) for i in range(len(prompts))]

    return asyncio.run(run())
