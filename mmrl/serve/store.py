"""What the server records, in SQL through SQLAlchemy (a SQLite file by default, any SQLAlchemy
URL via `serve.db_url`): sessions, models (training runs), futures and their results, sampling
sessions and checkpoints. Every row carries the owner (a hash of the API key, never the key), and
every read filters by it, so one key cannot see another key's rows.
"""
from __future__ import annotations

import time
import uuid
from contextlib import contextmanager
from typing import Any, Iterator

from sqlalchemy import (BigInteger, Column, Float, Integer, LargeBinary, MetaData, String, Table, Text, create_engine,
                        func, inspect, insert, select, text, update)
from sqlalchemy.engine import Engine

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

    # futures
    def add_future(self, owner: str, model_id: str | None, kind: str) -> str:
        fid = new_id("req")
        self._insert(futures, id=fid, owner=owner, model_id=model_id, kind=kind, status="pending", created=time.time())
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

    def fail_pending(self, reason: str) -> int:
        """Futures left pending by a server that stopped: they will never finish."""
        with self.engine.begin() as c:
            r = c.execute(update(futures).where(futures.c.status == "pending").values(
                status="failed", error=reason, category="server", finished=time.time()))
        return r.rowcount

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
