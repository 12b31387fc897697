"""`mmrl serve`'s keys and SQL store, without a model: one key never reads another key's rows, and
a restarted server keeps finished futures and fails the ones it left pending. Servers sharing one
database (and store_dir): a starting server fails only the futures and sweeps only the partial
saves of servers whose heartbeat is stale, and long-polls a future another server runs. Times are
explicit timestamps, never sleeps."""
from __future__ import annotations

import asyncio
import json
import os

import pytest
from sqlalchemy import Column, Float, LargeBinary, MetaData, String, Table, Text, create_engine

from mmrl.serve import state
from mmrl.serve.auth import AuthError, KeyConfigError, Keys, load_keys, owner_id
from mmrl.serve.futures import DB_POLL_S, FutureQueue
from mmrl.serve.store import SERVER_STOPPED, STALE_S, ServerHeartbeat, Store


def test_keys_need_the_tml_prefix_and_are_checked(tmp_path):
    with pytest.raises(KeyConfigError, match="tml-"):
        load_keys(env="tml-good,sk-bad")
    with pytest.raises(KeyConfigError, match="no API keys"):
        load_keys(env="")
    f = tmp_path / "keys.txt"
    f.write_text("# team keys\ntml-from-file  # alice\n")
    keys = load_keys(str(f), env="tml-from-env")
    assert keys == ["tml-from-env", "tml-from-file"]
    k = Keys(keys)
    assert k.check("tml-from-file") == owner_id("tml-from-file")
    assert k.check("Bearer tml-from-env") == owner_id("tml-from-env")
    for bad in (None, "", "tml-unknown"):
        with pytest.raises(AuthError):
            k.check(bad)


def test_rows_are_private_to_their_key_and_survive_a_restart(tmp_path):
    check_rows_private_and_restart(f"sqlite:///{tmp_path / 'serve.db'}")


def check_rows_private_and_restart(url: str) -> None:
    """The store's contract on an empty database at `url` (tests/test_tinker_postgres.py runs it on
    PostgreSQL): rows scoped per key, results kept and pending futures failed across a restart."""
    store = Store(url)
    a, b = owner_id("tml-a"), owner_id("tml-b")
    sid = store.add_session(a, "0.38.0")
    mid = store.add_model(a, sid, "tiny", 4, "{}")
    done = store.add_future(a, mid, "optim_step")
    store.finish_future(done, result=b'{"metrics": {}}', content_type="application/json")
    pending = store.add_future(a, mid, "forward_backward")
    big = 5 * 2 ** 30  # a state checkpoint of a large adapter: past a 32-bit column
    store.add_checkpoint(a, f"tinker://{mid}/sampler_weights/x", mid, "sampler", "x", "/tmp/x", size_bytes=big)
    sampler = store.add_sampling_session(a, f"tinker://{mid}/sampler_weights/x", "tiny")
    assert store.session(b, sid) is None and not store.heartbeat(b, sid)
    assert store.model(b, mid) is None and store.future(b, done) is None
    assert store.checkpoint(b, f"tinker://{mid}/sampler_weights/x") is None
    assert store.sampling_session(b, sampler) is None and store.list_checkpoints(b) == []

    restarted = Store(url)
    assert restarted.fail_abandoned() == 1  # recorded with no server: no live server runs it
    result = restarted.future(a, done)["result"]
    assert type(result) is bytes and result == b'{"metrics": {}}'  # bytes, as the route sends them
    row = restarted.future(a, pending)
    assert (row["status"], row["error"], row["category"]) == ("failed", SERVER_STOPPED, "server")
    assert [(c["name"], c["size_bytes"]) for c in restarted.list_checkpoints(a, mid)] == [("x", big)]


# ---- servers sharing one database ---------------------------------------------------------------
T = 1_000_000.0  # an explicit clock for the heartbeats


def test_servers_and_their_futures(tmp_path):
    check_servers_and_futures(f"sqlite:///{tmp_path / 'serve.db'}")


def check_servers_and_futures(url: str) -> None:
    """On an empty database at `url` (tests/test_tinker_postgres.py runs it on PostgreSQL): a
    starting server fails the pending futures of stale servers and of no server, not those of a
    live one; the heartbeat reaps a server that went stale once; a clean stop fails its own."""
    store = Store(url)
    o = owner_id("tml-a")
    store.add_server("server-live", now=T)
    store.add_server("server-dead", now=T - 3 * STALE_S)
    store.beat_server("server-dead", now=T - 2 * STALE_S)  # its last beat, long ago
    on_live = store.add_future(o, None, "forward_backward", "server-live")
    on_dead = store.add_future(o, None, "forward_backward", "server-dead")
    finished = store.add_future(o, None, "optim_step", "server-dead")
    store.finish_future(finished, result=b"{}", content_type="application/json")
    no_server = store.add_future(o, None, "sample")  # as a server from before server ids left it
    unknown = store.add_future(o, None, "sample", "server-never-registered")

    now = T + STALE_S - 1  # server-live beat STALE_S - 1 ago: still live
    store.add_server("server-new", now=now)
    assert store.live_servers(now) == {"server-live", "server-new"}
    assert store.fail_abandoned(now) == 3
    status = {f: store.future(o, f)["status"] for f in (on_live, on_dead, finished, no_server, unknown)}
    assert status == {on_live: "pending", on_dead: "failed", finished: "done", no_server: "failed", unknown: "failed"}
    row = store.future(o, on_dead)
    assert (row["error"], row["category"], row["server_id"]) == (SERVER_STOPPED, "server", "server-dead")
    assert "server running this request stopped" in row["error"]

    # server-live goes silent; server-new keeps beating: its heartbeat reaps server-live once
    later = T + STALE_S + 1
    beat = ServerHeartbeat(store, server_id="server-new")
    assert beat.beat(now=later) == 1 and store.future(o, on_live)["status"] == "failed"
    assert store.reap_stale_servers(now=later + 1) == 0  # marked stopped: not reaped again
    assert store.live_servers(later) == {"server-new"}
    # a server taken for stopped that beats again is told so, and is live again
    assert store.beat_server("server-live", now=later + 2) is False
    assert store.beat_server("server-live", now=later + 3) is True
    assert "server-live" in store.live_servers(later + 3)

    mine = store.add_future(o, None, "forward_backward", "server-new")
    assert store.server_stopped("server-new", now=later + 4) == 1
    assert store.future(o, mine)["status"] == "failed" and "server-new" not in store.live_servers(later + 4)


def test_heartbeat_thread_registers_and_a_stop_is_recorded(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'serve.db'}")
    beat = ServerHeartbeat(store, interval_s=3600)  # the thread's own beats never come in this test
    beat.start()
    assert beat.server_id.startswith("server-") and beat.server_id in store.live_servers()
    o = owner_id("tml-a")
    fid = store.add_future(o, None, "sample", beat.server_id)
    assert beat.stop() == 1
    assert store.future(o, fid)["error"] == SERVER_STOPPED and beat.server_id not in store.live_servers()
    assert ServerHeartbeat(store).server_id != beat.server_id  # each process its own id


def test_an_old_database_gets_server_ids_and_its_pending_futures_fail(tmp_path):
    check_old_futures_table(f"sqlite:///{tmp_path / 'old.db'}")


def check_old_futures_table(url: str) -> None:
    """A futures table as servers before server ids made it (no server_id column), one future
    pending: the store adds the column, and a starting server fails that future."""
    old = MetaData()
    Table("futures", old, Column("id", String(64), primary_key=True), Column("owner", String(64), nullable=False),
          Column("model_id", String(64)), Column("kind", String(32), nullable=False),
          Column("status", String(16), nullable=False), Column("content_type", String(64)),
          Column("result", LargeBinary), Column("error", Text), Column("category", String(16)),
          Column("created", Float, nullable=False), Column("finished", Float))
    engine = create_engine(url)
    old.create_all(engine)
    with engine.begin() as c:
        c.execute(old.tables["futures"].insert().values(id="req-old", owner="o", kind="sample", status="pending",
                                                        created=1.0))
    engine.dispose()
    store = Store(url)
    store.add_server("server-new", now=T)
    assert store.future("o", "req-old")["server_id"] is None
    assert store.fail_abandoned(now=T) == 1
    assert (store.future("o", "req-old")["status"], store.future("o", "req-old")["error"]) == ("failed", SERVER_STOPPED)
    fid = store.add_future("o", None, "sample", "server-new")
    assert store.future("o", fid)["server_id"] == "server-new"
    store.engine.dispose()


def _tmp_folder(weights, name: str, mtime: float):
    folder = weights / name
    folder.mkdir(parents=True)
    (folder / "adapter.safetensors").write_bytes(b"half a file")
    for p in (folder / "adapter.safetensors", folder):
        os.utime(p, (mtime, mtime))
    return folder


def test_sweep_removes_only_partial_saves_of_dead_servers(tmp_path):
    weights = tmp_path / "checkpoints" / "model-x" / "weights"
    old = T - 2 * state.SWEEP_MIN_AGE_S
    live_writing = _tmp_folder(weights, ".tmp-server-live.aaaa", T)
    live_old = _tmp_folder(weights, ".tmp-server-live.bbbb", old)  # a live server's long save
    dead_old = _tmp_folder(weights, ".tmp-server-dead.cccc", old)
    dead_fresh = _tmp_folder(weights, ".tmp-server-dead.dddd", T)  # just written: maybe taken for dead wrongly
    before_ids = _tmp_folder(weights, ".tmp-eeee", T)  # a name from before server ids
    done = _tmp_folder(weights, "step1.ffff", old)  # a finished checkpoint
    assert state.tmp_server(live_writing) == "server-live" and state.tmp_server(before_ids) is None
    assert state.sweep_partial(tmp_path / "checkpoints", {"server-live"}, now=T) == 2
    assert [f.exists() for f in (live_writing, live_old, dead_old, dead_fresh, before_ids, done)] == \
        [True, True, False, True, False, True]
    # once nothing changed in it for SWEEP_MIN_AGE_S, the dead server's fresh folder goes too
    assert state.sweep_partial(tmp_path / "checkpoints", {"server-live"}, now=T + state.SWEEP_MIN_AGE_S) == 1
    assert not dead_fresh.exists() and live_writing.exists()


def test_a_future_another_server_runs_is_long_polled_in_the_database(tmp_path):
    url = f"sqlite:///{tmp_path / 'serve.db'}"
    asyncio.run(_long_poll_across_servers(Store(url), Store(url)))


async def _long_poll_across_servers(store_a: Store, store_b: Store) -> None:
    """Server A runs a job held by a gate; server B waits for it. B's first read finds it pending;
    B's poll interval (its injected sleep) opens the gate and lets A finish; B's next read returns
    the result. Steps, not timings."""
    o = owner_id("tml-a")
    gate, naps = asyncio.Event(), []
    a = FutureQueue(store_a, "server-a")

    async def job() -> dict:
        await gate.wait()
        return {"type": "done-on-a"}

    async def nap(seconds: float) -> None:
        naps.append(seconds)
        gate.set()
        await a.wait(o, fid, timeout=3600)  # A's own wait: returns once A stored the result

    b = FutureQueue(store_b, "server-b", sleep=nap)
    try:
        fid = a.submit(o, None, "sample", job)
        assert store_b.future(o, fid)["server_id"] == "server-a"
        row = await b.wait(o, fid, timeout=3600)
        assert row["status"] == "done" and json.loads(row["result"]) == {"type": "done-on-a"}
        assert naps == [DB_POLL_S]  # pending on the first read, done on the second
        assert await b.wait(owner_id("tml-b"), fid) is None  # another key's: not found
        never = store_a.add_future(o, None, "sample", "server-a")  # pending for good
        assert (await b.wait(o, never, timeout=0))["status"] == "pending"  # the deadline answers try_again
        assert naps == [DB_POLL_S]
    finally:
        await a.close()
        await b.close()
