"""What the server records, in SQL through SQLAlchemy (a SQLite file by default, any SQLAlchemy
URL via `serve.db_url`): sessions, models (training runs), futures and their results, sampling
sessions and checkpoints. Every row carries the owner (a hash of the API key, never the key), and
every read filters by it, so one key cannot see another key's rows.

Several servers may share one database. Each server process has an id and a row in `servers` whose
heartbeat it refreshes (`ServerHeartbeat`); each future records the server that runs it. A future is
failed as abandoned only when its server's heartbeat went stale (the process died), never because
another server started.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Any, Iterator

from sqlalchemy import (BigInteger, Column, Float, Integer, LargeBinary, MetaData, String, Table, Text, create_engine,
                        func, inspect, insert, or_, select, text, update)
from sqlalchemy.engine import Engine

log = logging.getLogger("mmrl.serve")

# A server refreshes its heartbeat every HEARTBEAT_S: one single-row UPDATE, nothing for the
# database, and a dead server's requests are failed within about STALE_S + HEARTBEAT_S.
HEARTBEAT_S = 5.0
# A server is taken for dead after STALE_S without a heartbeat: 12 missed beats, so a live server
# is not failed for one slow beat (a loaded machine, a database failover, a long call holding the
# GIL). Heartbeats are each host's wall clock, so hosts must agree to well within STALE_S (NTP does).
# Taking a live server for dead fails its running requests; waiting a minute longer for a dead one
# only keeps its clients long-polling, so the bound errs on the long side.
STALE_S = 60.0
SERVER_STOPPED = "the server running this request stopped before it finished"

metadata = MetaData()

sessions = Table(
    "sessions", metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(64), index=True, nullable=False),
    Column("sdk_version", String(64)),
    Column("created", Float, nullable=False),
    Column("last_heartbeat", Float, nullable=False),
)
models = Table(
    "models", metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(64), index=True, nullable=False),
    Column("session_id", String(64)),
    Column("base_model", Text, nullable=False),
    Column("lora_rank", Integer, nullable=False),
    Column("config_json", Text, nullable=False),
    Column("status", String(16), nullable=False),  # creating | ready | failed | unloaded
    Column("created", Float, nullable=False),
)
futures = Table(
    "futures", metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(64), index=True, nullable=False),
    Column("model_id", String(64)),
    Column("kind", String(32), nullable=False),
    Column("status", String(16), nullable=False),  # pending | done | failed
    Column("content_type", String(64)),
    Column("result", LargeBinary),
    Column("error", Text),
    Column("category", String(16)),
    Column("created", Float, nullable=False),
    Column("finished", Float),
    Column("server_id", String(64)),  # the server that runs it; null in a database from before server ids
)
servers = Table(
    "servers", metadata,
    Column("id", String(64), primary_key=True),
    Column("host", String(255)),
    Column("pid", Integer),
    Column("started", Float, nullable=False),
    Column("last_heartbeat", Float, nullable=False),
    Column("stopped", Float),  # when it stopped or was found stale; cleared by its next heartbeat
)
sampling_sessions = Table(
    "sampling_sessions", metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(64), index=True, nullable=False),
    Column("checkpoint", Text),  # tinker:// path of the weights; null = the base model
    Column("base_model", Text, nullable=False),
    Column("created", Float, nullable=False),
)
checkpoints = Table(
    "checkpoints", metadata,
    Column("path", String(512), primary_key=True),  # tinker://<model_id>/<kind>/<name>
    Column("owner", String(64), index=True, nullable=False),
    Column("model_id", String(64), nullable=False),
    Column("kind", String(16), nullable=False),  # sampler | state
    Column("name", String(256), nullable=False),
    Column("file", Text, nullable=False),  # a safetensors file (sampler) or a folder (state)
    Column("created", Float, nullable=False),
    Column("size_bytes", BigInteger),  # 64-bit: PostgreSQL's INTEGER stops at 2 GiB
    Column("user_metadata", Text),  # JSON object, as the client sent it
)

# the PostgreSQL advisory lock (per database) held while a server creates or upgrades the tables
SCHEMA_LOCK_KEY = 0x6D6D726C  # "mmrl"


@contextmanager
def schema_lock(engine: Engine) -> Iterator[None]:
    """Serialise schema setup between servers sharing one PostgreSQL database: two servers starting
    together would both see a table missing, and the second CREATE TABLE fails (a unique violation
    in pg_type). Other dialects: no lock (SQLite is one server's file)."""
    if engine.dialect.name != "postgresql":
        yield
        return
    with engine.connect() as c:
        c.execute(text("SELECT pg_advisory_lock(:k)"), {"k": SCHEMA_LOCK_KEY})
        try:
            yield
        finally:
            c.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": SCHEMA_LOCK_KEY})


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


class Store:
    def __init__(self, url: str):
        kwargs: dict[str, Any] = {}
        if url.startswith("sqlite"):
            kwargs["connect_args"] = {"check_same_thread": False}
        self.engine = create_engine(url, **kwargs)
        with schema_lock(self.engine):
            metadata.create_all(self.engine)
            self._add_missing_columns()

    def _add_missing_columns(self) -> None:
        """A database made by an older server lacks the nullable columns added since: add them
        (create_all only makes missing tables)."""
        db = inspect(self.engine)
        for table in metadata.sorted_tables:
            have = {c["name"] for c in db.get_columns(table.name)}
            for col in table.columns:
                if col.name not in have and col.nullable:
                    kind = col.type.compile(dialect=self.engine.dialect)
                    with self.engine.begin() as c:
                        c.execute(text(f"ALTER TABLE {table.name} ADD COLUMN {col.name} {kind}"))

    def _insert(self, table: Table, **row: Any) -> None:
        with self.engine.begin() as c:
            c.execute(insert(table).values(**row))

    def _one(self, table: Table, owner: str, key: str, value: str) -> dict[str, Any] | None:
        with self.engine.connect() as c:
            row = c.execute(select(table).where(table.c[key] == value, table.c.owner == owner)).mappings().first()
        return dict(row) if row else None

    # sessions
    def add_session(self, owner: str, sdk_version: str | None) -> str:
        sid, now = new_id("session"), time.time()
        self._insert(sessions, id=sid, owner=owner, sdk_version=sdk_version, created=now, last_heartbeat=now)
        return sid

    def heartbeat(self, owner: str, session_id: str) -> bool:
        with self.engine.begin() as c:
            r = c.execute(update(sessions).where(sessions.c.id == session_id, sessions.c.owner == owner)
                          .values(last_heartbeat=time.time()))
        return r.rowcount > 0

    def finish_session(self, owner: str, session_id: str) -> bool:
        """The session ended: its last heartbeat is set to the epoch, as silent as a session can be."""
        with self.engine.begin() as c:
            r = c.execute(update(sessions).where(sessions.c.id == session_id, sessions.c.owner == owner)
                          .values(last_heartbeat=0.0))
        return r.rowcount > 0

    def session(self, owner: str, session_id: str) -> dict[str, Any] | None:
        return self._one(sessions, owner, "id", session_id)

    # models
    def add_model(self, owner: str, session_id: str, base_model: str, rank: int, config_json: str,
                  model_id: str | None = None) -> str:
        mid = model_id or new_id("model")
        self._insert(models, id=mid, owner=owner, session_id=session_id, base_model=base_model, lora_rank=rank,
                     config_json=config_json, status="creating", created=time.time())
        return mid

    def set_model_status(self, model_id: str, status: str) -> None:
        with self.engine.begin() as c:
            c.execute(update(models).where(models.c.id == model_id).values(status=status))

    def model(self, owner: str, model_id: str) -> dict[str, Any] | None:
        return self._one(models, owner, "id", model_id)

    def list_models(self, owner: str) -> list[dict[str, Any]]:
        with self.engine.connect() as c:
            return [dict(r) for r in c.execute(select(models).where(models.c.owner == owner)
                                               .order_by(models.c.created)).mappings()]

    def last_request(self, model_id: str) -> float | None:
        """When the model's newest request was submitted (None before any)."""
        with self.engine.connect() as c:
            return c.execute(select(func.max(futures.c.created)).where(futures.c.model_id == model_id)).scalar()

    # servers
    def add_server(self, server_id: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self._insert(servers, id=server_id, host=socket.gethostname()[:255], pid=os.getpid(), started=now,
                     last_heartbeat=now)

    def beat_server(self, server_id: str, now: float | None = None) -> bool:
        """Refresh the server's heartbeat; False when it had been taken for stopped (its row marked
        by another server, or gone), so its running requests were failed meanwhile."""
        now = time.time() if now is None else now
        with self.engine.begin() as c:
            # FOR UPDATE (PostgreSQL): a reaper marking this row waits for the beat, or the beat for it
            row = c.execute(select(servers.c.stopped).where(servers.c.id == server_id).with_for_update()).first()
            if row is None:
                c.execute(insert(servers).values(id=server_id, host=socket.gethostname()[:255], pid=os.getpid(),
                                                 started=now, last_heartbeat=now))
                return False
            c.execute(update(servers).where(servers.c.id == server_id).values(last_heartbeat=now, stopped=None))
        return row.stopped is None

    def live_servers(self, now: float | None = None) -> set[str]:
        """Ids of the servers whose heartbeat is fresh."""
        cutoff = (time.time() if now is None else now) - STALE_S
        with self.engine.connect() as c:
            return set(c.execute(select(servers.c.id).where(servers.c.last_heartbeat >= cutoff,
                                                            servers.c.stopped.is_(None))).scalars())

    def fail_abandoned(self, now: float | None = None) -> int:
        """At a server's start: fail every pending future that no live server runs (its server's
        heartbeat is stale, its server is unknown, or it has no server id: a database from before
        server ids). Futures of live servers are left running. How many were failed."""
        now = time.time() if now is None else now
        live = select(servers.c.id).where(servers.c.last_heartbeat >= now - STALE_S, servers.c.stopped.is_(None))
        with self.engine.begin() as c:
            self._mark_stale(c, now)  # first, as in reap_stale_servers: the same lock order
            r = c.execute(update(futures).where(
                futures.c.status == "pending", or_(futures.c.server_id.is_(None), futures.c.server_id.not_in(live))
            ).values(status="failed", error=SERVER_STOPPED, category="server", finished=now))
        return r.rowcount

    def reap_stale_servers(self, now: float | None = None) -> int:
        """Periodically, from every live server: fail the pending futures of the servers whose
        heartbeat went stale since the last look, and mark those servers stopped (so the next look
        reads only the small servers table). How many futures were failed."""
        now = time.time() if now is None else now
        with self.engine.begin() as c:
            stale = self._mark_stale(c, now)
            if not stale:
                return 0
            r = c.execute(update(futures).where(futures.c.status == "pending", futures.c.server_id.in_(stale))
                          .values(status="failed", error=SERVER_STOPPED, category="server", finished=now))
        return r.rowcount

    @staticmethod
    def _mark_stale(c: Any, now: float) -> list[str]:
        """Mark the servers found stale (and not marked yet) stopped; their ids. The rows are locked
        in id order: a server beating meanwhile is re-read, and two servers reaping never deadlock."""
        stale = list(c.execute(select(servers.c.id).where(servers.c.last_heartbeat < now - STALE_S,
                                                          servers.c.stopped.is_(None))
                               .order_by(servers.c.id).with_for_update()).scalars())
        if stale:
            c.execute(update(servers).where(servers.c.id.in_(stale)).values(stopped=now))
        return stale

    def server_stopped(self, server_id: str, now: float | None = None) -> int:
        """A server stopping cleanly: mark it stopped and fail the requests it was still running
        (they will never finish). How many."""
        now = time.time() if now is None else now
        with self.engine.begin() as c:
            c.execute(update(servers).where(servers.c.id == server_id).values(stopped=now))
            r = c.execute(update(futures).where(futures.c.status == "pending", futures.c.server_id == server_id)
                          .values(status="failed", error=SERVER_STOPPED, category="server", finished=now))
        return r.rowcount

    # futures
    def add_future(self, owner: str, model_id: str | None, kind: str, server_id: str | None = None) -> str:
        fid = new_id("req")
        self._insert(futures, id=fid, owner=owner, model_id=model_id, kind=kind, status="pending", created=time.time(),
                     server_id=server_id)
        return fid

    def finish_future(self, future_id: str, *, result: bytes | None = None, content_type: str | None = None,
                      error: str | None = None, category: str | None = None) -> None:
        status = "failed" if error is not None else "done"
        with self.engine.begin() as c:
            c.execute(update(futures).where(futures.c.id == future_id).values(
                status=status, result=result, content_type=content_type, error=error, category=category,
                finished=time.time()))

    def future(self, owner: str, future_id: str) -> dict[str, Any] | None:
        return self._one(futures, owner, "id", future_id)

    # sampling sessions
    def add_sampling_session(self, owner: str, checkpoint: str | None, base_model: str) -> str:
        sid = new_id("sampler")
        self._insert(sampling_sessions, id=sid, owner=owner, checkpoint=checkpoint, base_model=base_model,
                     created=time.time())
        return sid

    def sampling_session(self, owner: str, sid: str) -> dict[str, Any] | None:
        return self._one(sampling_sessions, owner, "id", sid)

    # checkpoints
    def add_checkpoint(self, owner: str, path: str, model_id: str, kind: str, name: str, file: str,
                       size_bytes: int | None = None, user_metadata: str | None = None) -> dict[str, Any] | None:
        """Record a checkpoint (replacing one saved under the same path, which is returned, so its
        files can go once the new row is committed)."""
        with self.engine.begin() as c:
            old = c.execute(select(checkpoints).where(checkpoints.c.path == path)).mappings().first()
            c.execute(checkpoints.delete().where(checkpoints.c.path == path))
            c.execute(insert(checkpoints).values(path=path, owner=owner, model_id=model_id, kind=kind, name=name,
                                                 file=file, created=time.time(), size_bytes=size_bytes,
                                                 user_metadata=user_metadata))
        return dict(old) if old else None

    def delete_checkpoint(self, owner: str, path: str) -> dict[str, Any] | None:
        """Remove the owner's checkpoint row; the removed row, or None if there was none."""
        with self.engine.begin() as c:
            row = c.execute(select(checkpoints).where(checkpoints.c.path == path, checkpoints.c.owner == owner)
                            ).mappings().first()
            if row is not None:
                c.execute(checkpoints.delete().where(checkpoints.c.path == path))
        return dict(row) if row else None

    def checkpoint(self, owner: str, path: str) -> dict[str, Any] | None:
        return self._one(checkpoints, owner, "path", path)

    def list_checkpoints(self, owner: str, model_id: str | None = None,
                         newest_first: bool = False) -> list[dict[str, Any]]:
        q = select(checkpoints).where(checkpoints.c.owner == owner)
        if model_id is not None:
            q = q.where(checkpoints.c.model_id == model_id)
        order = checkpoints.c.created.desc() if newest_first else checkpoints.c.created
        with self.engine.connect() as c:
            return [dict(r) for r in c.execute(q.order_by(order)).mappings()]


class ServerHeartbeat:
    """This server process in the `servers` table: registered with a fresh id, its heartbeat kept
    fresh, and the requests of servers that died failed, by a daemon thread (not the event loop: a
    long call in the loop must not make a live server look dead)."""

    def __init__(self, store: Store, interval_s: float = HEARTBEAT_S, server_id: str | None = None):
        self.store = store
        self.server_id = server_id or new_id("server")  # new at each process start
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.store.add_server(self.server_id)
        self._thread = threading.Thread(target=self._run, name="mmrl-serve-heartbeat", daemon=True)
        self._thread.start()

    def beat(self, now: float | None = None) -> int:
        """One heartbeat, then fail the requests of servers found stale since; how many."""
        if not self.store.beat_server(self.server_id, now):
            log.warning("server %s was taken for stopped (no heartbeat for over %.0f s): requests it was running "
                        "were failed", self.server_id, STALE_S)
        reaped = self.store.reap_stale_servers(now)
        if reaped:
            log.warning("%d requests of servers that stopped were failed", reaped)
        return reaped

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except Exception as e:  # the database may be down for a moment: the next beat retries
                log.warning("server heartbeat failed: %s", e)

    def stop(self) -> int:
        """Stop beating and record the stop; how many pending requests of this server were failed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.store.server_stopped(self.server_id)
