"""A real PostgreSQL server for the tests that run `mmrl serve`'s store on it: a throwaway cluster
(initdb) in a temporary folder, on 127.0.0.1 and a free port, trust auth, stopped and removed at
the end. Needs the server binaries (Debian: `apt-get install postgresql`; `.ci/run` installs them
when missing); without them the tests fail saying so.
"""
from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

USER = "postgres"  # the cluster's superuser (initdb -U), and the system user it runs as under root
START_TIMEOUT_S = 120  # a hang guard for a loaded 2-core machine (a start takes ~1 s idle)
# test-only settings: the cluster is thrown away, so durability buys nothing and costs fsyncs
FAST = "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"


class PostgresMissing(RuntimeError):
    pass


def server_bin_dir() -> Path:
    """The folder of initdb / pg_ctl / postgres: on PATH, else Debian's newest /usr/lib/postgresql/N/bin."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(os.path.realpath(found)).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parent.parent.name))
    if versions:
        return Path(versions[-1]).parent
    raise PostgresMissing("the PostgreSQL server (initdb, pg_ctl) is not installed: `apt-get install postgresql` "
                          "(Debian/Ubuntu) or put a PostgreSQL bin folder on PATH; .ci/run installs it on CI")


def _as_server_user(cmd: list[str]) -> list[str]:
    # postgres refuses to run as root: under root (CI, these machines) run it as the postgres user
    return ["runuser", "-u", USER, "--", *cmd] if os.geteuid() == 0 else cmd


def _run(cmd: list[str], timeout: float = START_TIMEOUT_S) -> None:
    # cwd /: the server user may not be allowed into the test's working folder
    out = subprocess.run(_as_server_user(cmd), capture_output=True, text=True, timeout=timeout, cwd="/")
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_root() -> Path:
    """A temporary folder the server user can own: mkdtemp under /tmp (pytest's own tmp folders are
    root's, mode 0700, which the postgres user cannot enter)."""
    root = Path(tempfile.mkdtemp(prefix="mmrl-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, USER, USER)
    return root


def _start(bindir: Path, data: Path, root: Path) -> int:
    """Start the cluster on a free port and return it; a port taken between the probe and the start
    is retried on another."""
    for attempt in range(3):
        port = _free_port()
        opts = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} {FAST}"
        try:
            _run([str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log"), "-o", opts,
                  "-t", str(START_TIMEOUT_S), "-w", "start"])
            return port
        except RuntimeError:
            if attempt == 2:
                log = root / "server.log"
                raise RuntimeError(f"PostgreSQL did not start:\n{log.read_text() if log.exists() else ''}")
    raise AssertionError("unreachable")


def _stop(bindir: Path, data: Path) -> None:
    try:
        _run([str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"], timeout=60)
    except (RuntimeError, subprocess.TimeoutExpired):
        # a fast stop waits for open transactions to roll back; immediate ends the server regardless
        _run([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"], timeout=60)


@contextmanager
def postgres_server() -> Iterator[str]:
    """A running throwaway PostgreSQL; yields the SQLAlchemy URL of its `postgres` database (the
    admin database: make one per test with `new_database`)."""
    bindir = server_bin_dir()
    root = _make_root()
    data = root / "data"
    try:
        _run([str(bindir / "initdb"), "-D", str(data), "-U", USER, "--auth=trust", "-E", "UTF8", "--no-sync"])
        port = _start(bindir, data, root)
        yield f"postgresql+psycopg://{USER}@127.0.0.1:{port}/postgres"
    finally:
        try:
            if (data / "postmaster.pid").exists():  # running, or a start that timed out may still come up
                _stop(bindir, data)
        finally:
            shutil.rmtree(root, ignore_errors=True)


def new_database(admin_url: str, prefix: str = "mmrl") -> str:
    """Create an empty database on the server of `admin_url`; its SQLAlchemy URL."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    engine = create_engine(admin_url, isolation_level="AUTOCOMMIT")  # CREATE DATABASE cannot run in a transaction
    try:
        with engine.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
    finally:
        engine.dispose()
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)
