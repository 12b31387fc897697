"""`rollout.backend: trainer`: the policy being trained samples its own rollouts.

`TrainerRolloutEngine` is an asyncio Ray actor with the rollout engine's interface (`generate`,
`generate_many`, `apply_weights`, `stats`, ...), so the router, the rollout workers and every
agent loop run unchanged. It has no model: it expands each engine prompt to the trainer's view
(`processor.expand`), collects the requests that arrive together into one batch, and has the
ZeRO-3 ranks sample it (`TrainerWorker.generate`: the batch split over the ranks, a collective
call on all of them). There is no separate inference engine, no weight sync and, by
construction, no rollout/trainer mismatch: the behaviour logprobs are computed by the very
forward the update runs. The price is speed (the trainer's forward, no continuous batching, no
overlap with training), which is why it is the exact end of the trade-off, for on-policy
reference runs and for debugging a mismatch, and runs in sync mode only.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import uuid
from typing import Any, Sequence

import ray

from mmrl.rollout.counters import RequestCounters
from mmrl.rollout.types import Completion, RequestSampling
from mmrl.trainer.generate import GenerationRequest

# How long the first request of a batch waits for the others issued with it (a rollout submits
# all its groups at once; their calls reach the actor over a few milliseconds). Only the batch
# size depends on it, never the tokens (each request draws from its own seeded generator).
BATCH_WAIT_S = 0.05


def eos_token_ids(model_path: str, processor: Any, trust_remote_code: bool = False) -> list[int]:
    """The tokens that end a response: the tokenizer's and the model's generation config's (as vLLM)."""
    ids = {int(processor.eos_token_id)} if processor.eos_token_id is not None else set()
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).eos_token_id
        ids |= {int(x) for x in (eos if isinstance(eos, list) else [eos]) if x is not None}
    except OSError:  # a model folder without generation_config.json
        pass
    return sorted(ids)


class TrainerRolloutEngine:
    """See the module docstring; used as a Ray actor (`TrainerRolloutEngine.as_actor`)."""

    def __init__(self, trainers: Sequence[Any], processor_spec: dict[str, Any]):
        from mmrl.processors import build_processor

        self.trainers = list(trainers)
        self.processor = build_processor(**processor_spec)
        self.eos_token_ids = eos_token_ids(processor_spec["model_path"], self.processor,
                                           processor_spec.get("trust_remote_code", False))
        self.weight_version = 0
        self.counters = RequestCounters()
        self._queue: list[tuple[GenerationRequest, str, asyncio.Future]] = []
        self._runner: asyncio.Task | None = None
        self.batches = 0

    @classmethod
    def as_actor(cls, options: dict[str, Any], trainers: Sequence[Any], processor_spec: dict[str, Any]) -> Any:
        return ray.remote(cls).options(**{"max_concurrency": 4096, **options}).remote(list(trainers), processor_spec)

    async def ready(self) -> dict[str, Any]:
        return {"start_seconds": 0.0, "pid": os.getpid()}

    async def generate(self, prompt: dict[str, Any], sampling: RequestSampling) -> Completion:
        return (await self.generate_many(prompt, [sampling]))[0]

    async def generate_many(self, prompt: dict[str, Any], samplings: list[RequestSampling]) -> list[Completion]:
        """Responses to one engine prompt (see RolloutEngine.generate_many), sampled by the trainer."""
        view = self.processor.expand(prompt)
        loop = asyncio.get_running_loop()
        futures = []
        for s in samplings:
            request_id = f"{s.request_key or 'r'}-{uuid.uuid4().hex[:12]}"
            self.counters.enter(request_id)
            future = loop.create_future()
            self._queue.append((GenerationRequest(prompt_ids=view.prompt_ids, positions_AP=view.positions_AP,
                                                  next_position=view.next_position, mm_inputs=view.mm_inputs,
                                                  sampling=s), request_id, future))
            futures.append(future)
        if self._runner is None or self._runner.done():
            self._runner = asyncio.ensure_future(self._run())
        return list(await asyncio.gather(*futures))

    async def _run(self) -> None:
        """Batch after batch until the queue is empty; one batch on the ranks at a time (collective)."""
        while self._queue:
            await asyncio.sleep(BATCH_WAIT_S)
            batch, self._queue = self._queue, []
            world = len(self.trainers)
            shares = [batch[r::world] for r in range(world)]
            filler = dataclasses.replace(batch[0][0], filler=True)
            try:
                results = await asyncio.gather(*[
                    t.generate.remote([req for req, _, _ in share] or [filler], self.eos_token_ids)
                    for t, share in zip(self.trainers, shares)])
            except Exception as e:  # a rank failed: every request of the batch fails with it
                for _, request_id, future in batch:
                    self.counters.leave(request_id)
                    if not future.done():
                        future.set_exception(e)
                continue
            self.batches += 1
            for share, outs in zip(shares, results):
                for (req, request_id, future), out in zip(share, outs):
                    self.counters.leave(request_id, len(out["token_ids"]))
                    if not future.done():
                        future.set_result(self._completion(req.sampling, out))

    def _completion(self, sampling: RequestSampling, out: dict[str, Any]) -> Completion:
        text = self.processor.decode(out["token_ids"])
        for stop in sampling.stop:  # like vLLM: the text ends before the stop string
            if stop in text:
                text = text[:text.index(stop)]
        return Completion(token_ids=out["token_ids"], logprobs=out["logprobs"], text=text,
                          finish_reason=out["finish_reason"], token_versions=[self.weight_version] * len(out["token_ids"]))

    # ---- the rest of the engine interface ------------------------------------------------------
    async def apply_weights(self, version: int) -> dict[str, float]:
        """The trainer's weights are the sampler's: only the version changes."""
        self.weight_version = version
        return {"tensors": 0.0, "apply_seconds": 0.0, "frozen_requests": 0.0}

    def stats(self, reset_peaks: bool = False) -> dict[str, float]:
        return {**self.counters.stats(reset_peaks), "batches": float(self.batches)}

    def progress(self) -> dict[str, int]:
        return dict(self.counters.progress)

    def configure(self, partial: str | None = None, recompute_kv: bool | None = None) -> None:
        """Nothing is in flight across a weight update (sync mode only)."""

    def get_weight_version(self) -> int:
        return self.weight_version

    async def shutdown(self) -> None:
        """Nothing to stop: the trainer ranks are the runtime's."""
