"""Quotas per API key (mmrl/serve/quota.py): sampled tokens in a sliding 60 s window and live
training models, answered 429 with Retry-After (a sample larger than the whole budget: 400).

The quota's clock is a fake one the tests move by hand, in the unit tests and in the running server
(reached through `app.state.quotas`), so no result depends on timing or machine load."""
from __future__ import annotations

import asyncio
import re
import time

import numpy as np
import pytest

from mmrl.serve.auth import owner_id
from mmrl.serve.quota import MODELS_KEY, SESSION_EXPIRY_S, TOKENS_KEY, KeyQuotas, QuotaExceeded
from mmrl.serve.trainer import UserInputError

A, B = "owner-a", "owner-b"


class FakeClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def tokens_quota(limit: int) -> tuple[KeyQuotas, FakeClock]:
    clock = FakeClock(1000.0)
    return KeyQuotas(sampled_tokens_per_minute=limit, clock=clock), clock


# ---- quota.py with a fake clock ------------------------------------------------------------------
def test_the_window_slides_and_retry_after_counts_down_to_the_oldest_charge():
    q, clock = tokens_quota(100)
    q.admit_sample(A, 3, 20)  # 60 tokens at t=1000
    clock.now = 1010.0
    q.admit_sample(A, 1, 30)  # 90 in the window
    clock.now = 1020.0
    with pytest.raises(QuotaExceeded) as err:
        q.admit_sample(A, 1, 20)
    assert err.value.retry_after == 40 and err.value.headers == {"Retry-After": "40"}
    assert str(err.value) == (f"key quota {TOKENS_KEY}=100 reached (90 used in the last 60 s, this request needs "
                              f"20); retry in 40 s")
    clock.now = 1059.75  # a fraction of a second left: rounded up to 1
    with pytest.raises(QuotaExceeded) as err:
        q.admit_sample(A, 1, 20)
    assert err.value.retry_after == 1
    clock.now = 1060.0  # the first charge has left the window
    assert q.sampled(A) == 30
    q.admit_sample(A, 1, 20)
    assert q.sampled(A) == 50
    assert q.refusals[(A, TOKENS_KEY)] == 2


def test_retry_after_waits_until_enough_charges_have_left():
    q, clock = tokens_quota(100)
    for t in (0.0, 5.0, 10.0):
        clock.now = 1000.0 + t
        q.admit_sample(A, 1, 30)
    clock.now = 1015.0
    with pytest.raises(QuotaExceeded) as err:  # 90 used + 70: the two oldest charges must leave
        q.admit_sample(A, 1, 70)
    assert err.value.retry_after == 50
    clock.now = 1065.0
    q.admit_sample(A, 1, 70)
    assert q.sampled(A) == 100


def test_a_charge_is_corrected_to_the_tokens_sampled():
    q, clock = tokens_quota(100)
    charge = q.admit_sample(A, 4, 20)
    assert q.sampled(A) == 80
    q.settle(charge, 9)  # stopped early
    assert q.sampled(A) == 9
    q.settle(charge, 500)  # never more than admitted
    assert q.sampled(A) == 9
    q.admit_sample(A, 4, 20)
    assert q.sampled(A) == 89


def test_the_sampling_job_settles_what_it_sampled_or_nothing_when_it_failed():
    q, _ = tokens_quota(100)

    async def sampled_three_and_two() -> tuple[dict, str]:
        return {"sequences": [{"tokens": [1, 2, 3]}, {"tokens": [4, 5]}]}, "response"

    async def engine_failure() -> tuple[dict, str]:
        raise RuntimeError("engine down")

    assert asyncio.run(q.sampling_job(q.admit_sample(A, 2, 10), sampled_three_and_two)()) == "response"
    assert q.sampled(A) == 5
    with pytest.raises(RuntimeError, match="engine down"):
        asyncio.run(q.sampling_job(q.admit_sample(A, 2, 10), engine_failure)())
    assert q.sampled(A) == 5


def test_a_request_larger_than_the_whole_budget_is_a_400_naming_quota_and_size():
    q, _ = tokens_quota(100)
    with pytest.raises(UserInputError) as err:
        q.admit_sample(A, 3, 40)
    assert f"{TOKENS_KEY}=100" in str(err.value) and "can sample 120 tokens" in str(err.value)
    assert "num_samples=3 x max_tokens=40" in str(err.value)
    assert err.value.field == "sampling_params.max_tokens"
    assert q.sampled(A) == 0 and not q.refusals  # not charged, not a 429
    q.admit_sample(A, 1, 100)  # exactly the budget passes


def test_keys_have_separate_budgets():
    q, _ = tokens_quota(50)
    q.admit_sample(A, 1, 50)
    with pytest.raises(QuotaExceeded):
        q.admit_sample(A, 1, 1)
    q.admit_sample(B, 1, 50)  # B is not affected by A's use
    assert (q.sampled(A), q.sampled(B)) == (50, 50)
    assert q.refusals == {(A, TOKENS_KEY): 1}


def test_no_quota_by_default_and_limits_must_be_positive():
    q = KeyQuotas()
    assert q.admit_sample(A, 128, 10**6) is None and q.sampled(A) == 0
    with pytest.raises(ValueError, match=TOKENS_KEY):
        KeyQuotas(sampled_tokens_per_minute=0)
    with pytest.raises(ValueError, match=MODELS_KEY):
        KeyQuotas(max_models=-1)


# ---- through the official SDK, against a server with both quotas --------------------------------
tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from _tinker_server import KEY_A, KEY_B, running_server, service_client  # noqa: E402

TOKENS_PER_MINUTE = 8
PROMPT = types.ModelInput.from_ints([3, 14, 15, 92])
OWNER_A, OWNER_B = owner_id(KEY_A), owner_id(KEY_B)
WAIT_S = 120  # hang guards only: each wait ends on an event, not on a timer


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """(url, the running app's quotas) with sampled tokens capped at 8 a minute and one model a key;
    the token window runs on a fake clock installed before the server starts."""
    apps = []
    extra = (f"serve.quota_sampled_tokens_per_minute={TOKENS_PER_MINUTE}", "serve.quota_max_models=1")
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("serve"), extra=extra, on_app=apps.append) as url:
        quotas = apps[0].state.quotas
        quotas.clock = FakeClock(0.0)
        yield url, quotas


@pytest.fixture
def quotas(server):
    """The server's quotas with its fake clock moved past every earlier test's charges."""
    _, q = server
    q.clock.now += 1000.0
    return q


def sample(sampler, max_tokens: int, seed: int, num_samples: int = 1):
    return sampler.sample(PROMPT, num_samples, types.SamplingParams(max_tokens=max_tokens, seed=seed))


def raw_post(url: str, route: str, key: str, body: dict):
    import httpx

    return httpx.post(f"{url}/api/v1/{route}", headers={"X-API-Key": key}, json=body, timeout=60)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def test_over_the_token_quota_the_sdk_backs_off_until_the_window_frees(server, quotas):
    url, _ = server
    sampler_a = service_client(url, KEY_A).create_sampling_client(base_model="tiny-vlm").result()
    first = sample(sampler_a, TOKENS_PER_MINUTE, seed=0).result()
    sampled = len(first.sequences[0].tokens)
    assert quotas.sampled(OWNER_A) == sampled  # the admitted 8, corrected to what was sampled

    # what a plain HTTP client sees: 429, Retry-After, and a detail naming the quota
    raw = raw_post(url, "asample", KEY_A, {"base_model": "tiny-vlm", "prompt": {"chunks": [
        {"type": "encoded_text", "tokens": [3, 14, 15, 92]}]}, "sampling_params": {"max_tokens": 8}})
    assert raw.status_code == 429 and raw.headers["retry-after"] == "60"  # the clock has not moved
    assert raw.json()["detail"] == (f"key quota {TOKENS_KEY}={TOKENS_PER_MINUTE} reached ({sampled} used in the "
                                    f"last 60 s, this request needs 8); retry in 60 s")
    refused = quotas.refusals[(OWNER_A, TOKENS_KEY)]

    # the SDK treats the 429 as backpressure: it waits and sends the request again
    pending = sample(sampler_a, TOKENS_PER_MINUTE, seed=1)
    wait_for(lambda: quotas.refusals[(OWNER_A, TOKENS_KEY)] > refused, "the SDK's sample to be refused")
    assert not pending.future().done()  # the clock is frozen: no retry can pass
    # key B samples meanwhile, on its own budget
    sampler_b = service_client(url, KEY_B).create_sampling_client(base_model="tiny-vlm").result()
    other = sample(sampler_b, TOKENS_PER_MINUTE, seed=2).result()
    assert quotas.sampled(OWNER_B) == len(other.sequences[0].tokens) >= 1
    assert not pending.future().done()

    quotas.clock.now += 60.0  # the first sample leaves the window: the SDK's next retry passes
    second = pending.result(timeout=WAIT_S)
    assert 1 <= len(second.sequences[0].tokens) <= TOKENS_PER_MINUTE
    assert quotas.sampled(OWNER_A) == len(second.sequences[0].tokens)


def test_a_sample_larger_than_the_budget_is_a_400_through_the_sdk(server, quotas):
    url, _ = server
    sampler = service_client(url, KEY_B).create_sampling_client(base_model="tiny-vlm").result()
    too_large = rf"can sample 16 tokens.*{re.escape(TOKENS_KEY)}={TOKENS_PER_MINUTE}: it can never pass"
    with pytest.raises(tinker.BadRequestError, match=too_large):
        sample(sampler, TOKENS_PER_MINUTE, seed=0, num_samples=2).result(timeout=WAIT_S)
    assert quotas.sampled(OWNER_B) == 0


@pytest.fixture(scope="module")
def model_a(server):
    """Key A's one training model (serve.quota_max_models=1)."""
    url, _ = server
    return service_client(url, KEY_A).create_lora_training_client(base_model="tiny-vlm", rank=2, seed=0).result()


def forward_datum() -> types.Datum:
    ids = [3, 14, 15, 92]
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(ids[1:], dtype=np.int64)})


def test_the_model_quota_refuses_an_extra_training_client(server, quotas, model_a):
    url, _ = server
    refused = quotas.refusals[(OWNER_A, MODELS_KEY)]
    # the SDK does not retry this 429 (x-should-retry: false): the user sees it at once
    refusal = re.escape(f"{MODELS_KEY}=1 reached (live training models of this key: {model_a.model_id})")
    with pytest.raises(tinker.RateLimitError, match=refusal):
        service_client(url, KEY_A).create_lora_training_client(base_model="tiny-vlm", rank=2).result(timeout=WAIT_S)
    assert quotas.refusals[(OWNER_A, MODELS_KEY)] == refused + 1  # one answer: the SDK did not retry
    # key B has its own quota
    service_client(url, KEY_B).create_lora_training_client(base_model="tiny-vlm", rank=2).result(timeout=WAIT_S)

    # creating from a saved state counts too (over plain HTTP: the SDK retries that route's 429s
    # for five minutes before it raises)
    path = model_a.save_state("q").result(timeout=WAIT_S).path
    session = raw_post(url, "create_session", KEY_A, {"sdk_version": "raw"}).json()["session_id"]
    raw = raw_post(url, "load_weights", KEY_A, {"session_id": session, "model_seq_id": 0, "path": path})
    assert raw.status_code == 429 and raw.headers["x-should-retry"] == "false"
    assert f"{MODELS_KEY}=1 reached" in raw.json()["detail"] and raw.json()["field"] == MODELS_KEY
    # no model can free itself before the heartbeats of model_a's session have been silent long enough
    assert 1 <= int(raw.headers["retry-after"]) <= SESSION_EXPIRY_S
    assert quotas.refusals[(OWNER_A, MODELS_KEY)] == refused + 2
    model_a.forward([forward_datum()], "cross_entropy").result(timeout=WAIT_S)  # the refusals left it alone


def test_a_model_whose_session_went_silent_makes_room(server, quotas, model_a):
    """A key at its quota whose scripts stopped is not stuck: the silent session's model is
    unloaded to make room (here for a model created from a saved state, which counts too)."""
    url, _ = server
    path = model_a.save_state("before-silence").result(timeout=WAIT_S).path
    refused = quotas.refusals[(OWNER_A, MODELS_KEY)]
    quotas.wall_clock = lambda: time.time() + SESSION_EXPIRY_S + 3600  # as if its heartbeats stopped an hour ago
    try:
        fresh = service_client(url, KEY_A).create_training_client_from_state(path).result(timeout=WAIT_S)
    finally:
        quotas.wall_clock = time.time
    assert quotas.refusals[(OWNER_A, MODELS_KEY)] == refused
    fresh.forward([forward_datum()], "cross_entropy").result(timeout=WAIT_S)
    with pytest.raises(tinker.NotFoundError, match=re.escape(f"model_id '{model_a.model_id}' not found")):
        model_a.forward([forward_datum()], "cross_entropy").result(timeout=WAIT_S)
    # the model created from the state is the key's one live model now
    refusal = re.escape(f"{MODELS_KEY}=1 reached (live training models of this key: {fresh.model_id})")
    with pytest.raises(tinker.RateLimitError, match=refusal):
        service_client(url, KEY_A).create_lora_training_client(base_model="tiny-vlm", rank=2).result(timeout=WAIT_S)


def test_a_quota_below_one_is_a_config_error_naming_the_key() -> None:
    from mmrl.config import ConfigError, load_config

    for key in ("serve.quota_max_models", "serve.quota_sampled_tokens_per_minute"):
        with pytest.raises(ConfigError, match=f"'{key}': 0"):
            load_config(None, [f"{key}=0"], check_files=False)
        load_config(None, [f"{key}=1"], check_files=False)
