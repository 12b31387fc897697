"""Quotas per API key (owner id): live training models (`serve.quota_max_models`) and sampled
tokens in any 60 s (`serve.quota_sampled_tokens_per_minute`). Over a quota is a 429 with
`Retry-After`; a sample request larger than the whole per-minute budget is a 400 (it could never
pass).

Sampled tokens: a request is charged num_samples x max_tokens when admitted (the most it can
sample), and corrected to the tokens it actually sampled when its result is known (0 if it
failed). The window slides: a charge stops counting 60 s after its admission.

Training models: a model counts from its admission until it is unloaded (or its creation failed).
tinker 0.38 has no client call that unloads a model, so a key at its quota whose sessions stopped
(a script that ended or crashed) would be stuck: when room is needed, the key's models whose
session sent no heartbeat for `SESSION_EXPIRY_S` (the SDK beats every 10 s and warns after 120 s)
are unloaded first. Counts are per server process (the models live in its memory).

The clocks are attributes (`clock` for the token window, `wall_clock` for the store's heartbeat
times) so tests can drive them.
"""
from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from mmrl.serve.trainer import UserInputError

if TYPE_CHECKING:
    from mmrl.serve.service import Service

WINDOW_S = 60.0
SESSION_EXPIRY_S = 180.0
MODELS_KEY = "serve.quota_max_models"
TOKENS_KEY = "serve.quota_sampled_tokens_per_minute"


class QuotaExceeded(Exception):
    """Answered 429 with `headers` (Retry-After; models: x-should-retry: false, see app.py)."""

    def __init__(self, message: str, quota: str, retry_after: int, retry: bool = True):
        super().__init__(message)
        self.field = quota
        self.retry_after = retry_after
        # The SDK's HTTP layer obeys x-should-retry: a model quota rarely frees by itself, so the
        # user sees the refusal at once instead of after ten retries.
        self.headers = {"Retry-After": str(retry_after)}
        if not retry:
            self.headers["x-should-retry"] = "false"


@dataclass
class Charge:
    """Tokens charged to a key at `at` (the quota clock); corrected by `KeyQuotas.settle`."""

    owner: str
    at: float
    tokens: int


def _limit(value: Any, key: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{key} must be an integer >= 1 or null (unlimited), got {value!r}")
    return value


def _seconds(wait: float) -> int:
    """Retry-After: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(wait))


class KeyQuotas:
    def __init__(self, max_models: int | None = None, sampled_tokens_per_minute: int | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time):
        self.max_models = _limit(max_models, MODELS_KEY)
        self.tokens_per_minute = _limit(sampled_tokens_per_minute, TOKENS_KEY)
        self.clock = clock
        self.wall_clock = wall_clock
        self.refusals: Counter[tuple[str, str]] = Counter()  # (owner, quota key) -> 429s answered
        self._charges: dict[str, deque[Charge]] = {}
        self._models: dict[str, list[str]] = {}  # owner -> model ids admitted by this process
        self._creating: set[str] = set()

    @classmethod
    def from_config(cls, serve_cfg: Any) -> KeyQuotas:
        return cls(serve_cfg.quota_max_models, serve_cfg.quota_sampled_tokens_per_minute)

    # ---- sampled tokens -------------------------------------------------------------------------
    def sampled(self, owner: str) -> int:
        """Tokens charged to `owner` in the last 60 s."""
        return sum(c.tokens for c in self._window(owner))

    def _window(self, owner: str) -> deque[Charge]:
        charges = self._charges.setdefault(owner, deque())
        start = self.clock() - WINDOW_S
        while charges and charges[0].at <= start:
            charges.popleft()
        return charges

    def admit_sample(self, owner: str, num_samples: int, max_tokens: int) -> Charge | None:
        """Charge num_samples x max_tokens to `owner`, or raise: UserInputError (400) for a request
        larger than the whole budget, QuotaExceeded (429) when the last 60 s leave too little."""
        limit = self.tokens_per_minute
        if limit is None:
            return None
        tokens = num_samples * max_tokens
        if tokens > limit:
            raise UserInputError(
                f"this request can sample {tokens} tokens (num_samples={num_samples} x max_tokens={max_tokens}), "
                f"more than the key quota {TOKENS_KEY}={limit}: it can never pass; lower num_samples or max_tokens",
                "sampling_params.max_tokens")
        charges = self._window(owner)
        used = sum(c.tokens for c in charges)
        if used + tokens > limit:
            self.refusals[(owner, TOKENS_KEY)] += 1
            wait = _seconds(self._wait_until_free(charges, used + tokens - limit))
            raise QuotaExceeded(f"key quota {TOKENS_KEY}={limit} reached ({used} used in the last 60 s, this "
                                f"request needs {tokens}); retry in {wait} s", TOKENS_KEY, wait)
        charge = Charge(owner, self.clock(), tokens)
        charges.append(charge)
        return charge

    def _wait_until_free(self, charges: deque[Charge], excess: int) -> float:
        """Seconds until charges worth `excess` tokens leave the window (oldest leave first)."""
        freed = 0
        for c in charges:
            freed += c.tokens
            if freed >= excess:
                return c.at + WINDOW_S - self.clock()
        return WINDOW_S  # not reached: the caller checked that the request fits an empty window

    def settle(self, charge: Charge | None, sampled: int) -> None:
        """Correct an admitted charge to the tokens actually sampled (never more than admitted)."""
        if charge is not None:
            charge.tokens = min(charge.tokens, max(0, sampled))

    def sampling_job(self, charge: Charge | None, job: Callable[[], Awaitable[tuple[dict, Any]]]
                     ) -> Callable[[], Awaitable[Any]]:
        """`job` (returning (sampler output, response)) as a future job that settles `charge` with
        the tokens sampled, or 0 if it failed, and returns the response."""
        async def run() -> Any:
            sampled = 0
            try:
                out, response = await job()
                sampled = sum(len(s["tokens"]) for s in out["sequences"])
                return response
            finally:
                self.settle(charge, sampled)

        return run

    # ---- training models ------------------------------------------------------------------------
    def check_models(self, owner: str, service: Service) -> None:
        """Room for one more training model of `owner`, after unloading its models whose session
        stopped; else QuotaExceeded naming the quota and the live models."""
        limit = self.max_models
        if limit is None:
            return
        live = self._live_models(owner, service)
        if len(live) >= limit:
            live = [m for m in live if not self._unload_if_expired(owner, m, service)]
            self._models[owner] = live
        if len(live) >= limit:
            self.refusals[(owner, MODELS_KEY)] += 1
            wait = _seconds(self._wait_until_expiry(owner, live, service))
            raise QuotaExceeded(
                f"key quota {MODELS_KEY}={limit} reached (live training models of this key: {', '.join(live)}); "
                f"unload one (POST /api/v1/unload_model) or end its session (models of a session without "
                f"heartbeats for {SESSION_EXPIRY_S:.0f} s are unloaded when room is needed); "
                f"retry in {wait} s at the earliest", MODELS_KEY, wait, retry=False)

    def _live_models(self, owner: str, service: Service) -> list[str]:
        live = [m for m in self._models.get(owner, []) if m in self._creating or m in service.trainers]
        self._models[owner] = live
        return live

    def _last_heartbeat(self, owner: str, model_id: str, service: Service) -> float | None:
        row = service.store.model(owner, model_id)
        session = service.store.session(owner, row["session_id"]) if row and row["session_id"] else None
        return None if session is None else float(session["last_heartbeat"])

    def _unload_if_expired(self, owner: str, model_id: str, service: Service) -> bool:
        if model_id in self._creating:  # its creation job would load it again: leave it be
            return False
        beat = self._last_heartbeat(owner, model_id, service)
        if beat is not None and self.wall_clock() - beat <= SESSION_EXPIRY_S:
            return False
        service.unload(model_id)
        return True

    def _wait_until_expiry(self, owner: str, live: list[str], service: Service) -> float:
        """Seconds until the first of `live` could be unloaded, if its session stays silent."""
        beats = [self._last_heartbeat(owner, m, service) for m in live]
        return min((b + SESSION_EXPIRY_S - self.wall_clock() for b in beats if b is not None),
                   default=SESSION_EXPIRY_S)

    def model_job(self, owner: str, model_id: str, job: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
        """Count `model_id` for `owner` from now on; `job` (its creation) as a future job. A model
        whose creation failed stops counting."""
        if self.max_models is None:
            return job
        self._models.setdefault(owner, []).append(model_id)
        self._creating.add(model_id)

        async def run() -> Any:
            try:
                return await job()
            finally:
                self._creating.discard(model_id)

        return run
