"""SIGTERM (a scheduler's kill) as a clean stop for a process that drives Ray actors."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def sigterm_unwinds() -> Iterator[list[int]]:
    """While the block runs, SIGTERM raises KeyboardInterrupt in the main thread, so the stack
    unwinds as on Ctrl-C (`finally` blocks run: engines shut down, shared memory is released).
    The list it yields gets the signal's number: it tells a SIGTERM from a Ctrl-C afterwards.

    Not SystemExit: a signal that lands while the main thread waits inside ray.get runs from
    Ray's own signal check, which passes a KeyboardInterrupt on but turns a SystemExit into
    SystemExit(1), so the exit status would depend on where the signal happened to land. The
    handler before the block is put back after it (a notebook's, a test's)."""
    received: list[int] = []

    def on_sigterm(signum: int, _frame: object) -> None:
        received.append(signum)
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def reclaim_sigterm(handler: Any = None) -> None:
    """After Ray started in this process: make SIGTERM run `handler` (default: the Python-level
    handler in place now) again. ray.init replaces a main thread's handler, and its core worker
    installs a C-level crash handler that aborts the process on SIGTERM (status -6, the
    process's own cleanup skipped: engines, trainer ranks and shared-memory buffers left behind),
    also when Ray was started from another thread. Setting the handler again from the main
    thread puts Python's back; from any other thread nothing can be done, and nothing is."""
    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGTERM) if handler is None else handler
    if callable(handler) or handler in (signal.SIG_DFL, signal.SIG_IGN):
        signal.signal(signal.SIGTERM, handler)
