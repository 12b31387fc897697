"""`mmrl serve` on PostgreSQL (`serve.db_url=postgresql+psycopg://...`), against a real server that
this module starts (tests/_postgres.py): the store's contract, servers starting together on one
empty database, and two servers sharing one database and one `serve.store_dir` (a checkpoint saved
through one server samples through the other, for its own key only)."""
from __future__ import annotations

import threading
from contextlib import ExitStack, contextmanager
from typing import Iterator

import numpy as np
import pytest
import tinker
from sqlalchemy import inspect
from tinker import types

from _postgres import new_database, postgres_server
from _tinker_server import KEY_B, serve_in_thread, service_client
from mmrl.serve.auth import owner_id
from mmrl.serve.store import Store, metadata
from test_tinker_store import check_rows_private_and_restart

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
def two_servers(pg_admin, tiny_model_dir, tmp_path_factory) -> Iterator[tuple[str, str]]:
    """Servers A and B on the same PostgreSQL database and the same checkpoint folder. Both start
    before any request: a server's start fails the futures it finds pending (see the report of
    issue 23), so B starting while A works would fail A's requests."""
    url, store_dir = new_database(pg_admin), tmp_path_factory.mktemp("serve-shared")
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
