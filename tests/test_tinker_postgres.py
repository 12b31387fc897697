"""`mmrl serve` on PostgreSQL (`serve.db_url=postgresql+psycopg://...`), against a real server that
this module starts (tests/_postgres.py): the store's contract, servers starting together on one
empty database, and two servers sharing one database and one `serve.store_dir` (a checkpoint saved
through one server samples through the other, for its own key only; a third server starting leaves
their work alone; a future run on one is long-polled through the other)."""
from __future__ import annotations

import os
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest
import tinker
from sqlalchemy import inspect
from tinker import types

from _postgres import new_database, postgres_server
from _tinker_server import KEY_A, KEY_B, running_server, serve_in_thread, service_client
from mmrl.serve import state
from mmrl.serve.auth import owner_id
from mmrl.serve.store import SERVER_STOPPED, STALE_S, Store, metadata
from test_tinker_store import check_old_futures_table, check_rows_private_and_restart, check_servers_and_futures

PROMPT = "the red square is red and the blue circle is blue"


@pytest.fixture(scope="module")
def pg_admin() -> Iterator[str]:
    with postgres_server() as url:
        yield url


@pytest.fixture
def pg_url(pg_admin: str) -> str:
    return new_database(pg_admin)


def test_store_contract_on_postgres(pg_url):
    check_rows_private_and_restart(pg_url)


def test_servers_and_their_futures_on_postgres(pg_admin, pg_url):
    check_servers_and_futures(pg_url)
    check_old_futures_table(new_database(pg_admin))


def test_servers_starting_together_create_the_tables_once(pg_url):
    """Servers started at the same moment on an empty database each create the tables: without the
    store's schema lock, all but one fail with a unique violation in pg_type."""
    n = 4
    barrier, stores, errors = threading.Barrier(n), [], []

    def start() -> None:
        barrier.wait()
        try:
            stores.append(Store(pg_url))
        except Exception as e:  # the failure is the assertion below, with its message
            errors.append(repr(e))

    threads = [threading.Thread(target=start) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == [] and len(stores) == n
        assert set(inspect(stores[0].engine).get_table_names()) == set(metadata.tables)
        a = owner_id("tml-a")
        sid = stores[0].add_session(a, "0.38.0")
        assert all(s.session(a, sid)["id"] == sid for s in stores)  # one database behind all of them
    finally:
        for s in stores:
            s.engine.dispose()


# ---- two servers, one database, one store_dir ---------------------------------------------------
@pytest.fixture(scope="module")
def shared(pg_admin, tmp_path_factory) -> tuple[str, Path]:
    """(the database URL, the store_dir) the servers of this module share."""
    return new_database(pg_admin), tmp_path_factory.mktemp("serve-shared")


@pytest.fixture(scope="module")
def two_servers(shared, tiny_model_dir) -> Iterator[tuple[str, str]]:
    """Servers A and B on the same PostgreSQL database and the same checkpoint folder."""
    url, store_dir = shared
    extra = (f"serve.db_url={url}",)
    start = contextmanager(serve_in_thread)
    with ExitStack() as stack:  # stops both, B first, even when one fails to start
        a, b = (stack.enter_context(start(tiny_model_dir, store_dir, sampler="trainer", extra=extra)) for _ in range(2))
        yield a, b


@pytest.fixture(scope="module")
def checkpoint_on_a(two_servers) -> tuple[str, list[int]]:
    """A LoRA trained one step through server A and saved for sampling: (its tinker:// path, the
    prompt's token ids)."""
    a, _ = two_servers
    tc = service_client(a).create_lora_training_client(base_model="tiny-vlm", rank=4, seed=0).result()
    ids = tc.get_tokenizer().encode(PROMPT)
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(ids[1:], dtype=np.int64)})
    fb = tc.forward_backward([datum], "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
    assert fb.result().metrics["loss:sum"] > 0 and opt.result().metrics["grad_norm"] > 0
    return tc.save_weights_for_sampler("shared").result().path, ids


def _logprobs(sampler, ids: list[int]) -> np.ndarray:
    return np.array(sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()[1:])


def test_checkpoint_saved_on_one_server_samples_on_the_other(two_servers, checkpoint_on_a):
    a, b = two_servers
    path, ids = checkpoint_on_a
    on_a = service_client(a).create_sampling_client(model_path=path).result()
    on_b = service_client(b).create_sampling_client(model_path=path).result()
    base = service_client(b).create_sampling_client(base_model="tiny-vlm").result()
    # B found A's row in the shared database and A's file in the shared store_dir: the trained
    # weights, not the base model's
    np.testing.assert_allclose(_logprobs(on_b, ids), _logprobs(on_a, ids), atol=1e-5)
    assert np.abs(_logprobs(on_b, ids) - _logprobs(base, ids)).max() > 1e-2
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    prompt = types.ModelInput.from_ints(ids[:3])
    seq_b = on_b.sample(prompt, 1, greedy).result().sequences[0]
    seq_a = on_a.sample(prompt, 1, greedy).result().sequences[0]
    assert len(seq_b.tokens) >= 1 and seq_b.tokens == seq_a.tokens


def test_another_key_cannot_sample_it_on_the_other_server(two_servers, checkpoint_on_a):
    _, b = two_servers
    path, ids = checkpoint_on_a
    with pytest.raises(tinker.NotFoundError, match="model_path") as err:
        service_client(b, KEY_B).create_sampling_client(model_path=path).result().sample(
            types.ModelInput.from_ints(ids[:3]), 1, types.SamplingParams(max_tokens=2)).result()
    assert err.value.status_code == 404  # the checkpoint is KEY_A's (service_client's default key)


def test_a_starting_server_leaves_the_work_of_live_servers_alone(two_servers, shared, tiny_model_dir):
    """While A and B run, server C starts on their database and store_dir: a future pending on a
    live server stays pending and a live server's partial save stays; those of a server whose
    heartbeat is stale, and a pending future with no server id (an older database), are cleaned up."""
    url, store_dir = shared
    store = Store(url)
    try:
        live = sorted(store.live_servers())
        assert len(live) == 2  # A and B, beating
        o, long_ago = owner_id(KEY_A), time.time() - 10 * STALE_S
        store.add_server("server-dead", now=long_ago)
        on_live = store.add_future(o, None, "forward_backward", live[0])
        on_dead = store.add_future(o, None, "forward_backward", "server-dead")
        no_server = store.add_future(o, None, "sample")
        weights = store_dir / "checkpoints" / "model-elsewhere" / "weights"
        saving = weights / f"{state.TMP_PREFIX}{live[0]}.aaaa"
        left = weights / f"{state.TMP_PREFIX}server-dead.bbbb"
        for folder in (saving, left):
            folder.mkdir(parents=True)
        os.utime(left, (long_ago, long_ago))  # nothing changed in it for longer than SWEEP_MIN_AGE_S

        with running_server(tiny_model_dir, store_dir, extra=(f"serve.db_url={url}",)):
            assert store.future(o, on_live)["status"] == "pending"
            assert [store.future(o, f)["status"] for f in (on_dead, no_server)] == ["failed", "failed"]
            assert store.future(o, on_dead)["error"] == SERVER_STOPPED
            assert saving.exists() and not left.exists()
            assert len(store.live_servers()) == 3
    finally:
        store.engine.dispose()


def test_a_future_run_on_one_server_is_long_polled_on_the_other(two_servers):
    """create_model submitted to A (plain httpx: the SDK has no public call that fetches a future by
    id), its result retrieved through B's /api/v1/retrieve_future: B reads the shared database until
    A stored the result (not `try_again` while it is pending)."""
    a, b = two_servers
    headers = {"X-API-Key": KEY_A}
    sid = httpx.post(f"{a}/api/v1/create_session", headers=headers, json={"sdk_version": "test"}).json()["session_id"]
    sub = httpx.post(f"{a}/api/v1/create_model", headers=headers,
                     json={"session_id": sid, "base_model": "tiny-vlm", "lora_config": {"rank": 4}}).json()
    answers = []
    while len(answers) < 10 and (not answers or answers[-1].get("type") == "try_again"):  # a hang guard
        r = httpx.post(f"{b}/api/v1/retrieve_future", headers=headers, json={"request_id": sub["request_id"]},
                       timeout=120)  # longer than the server's 20 s long-poll
        assert r.status_code == 200, r.text
        answers.append(r.json())
    assert answers[-1] == {"type": "create_model", "model_id": sub["model_id"]}
    info = httpx.post(f"{a}/api/v1/get_info", headers=headers, json={"model_id": sub["model_id"]}).json()
    assert info["lora_rank"] == 4  # the model lives on A, where the request ran
