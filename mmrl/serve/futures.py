"""Futures: every Tinker call answers at once with a request id; the work runs later and its result
is fetched with `retrieve_future`.

Calls of one model run in submission order on that model's lane (an asyncio task draining a
queue), so `forward_backward` + `optim_step` can be queued back to back. Model work (torch) runs on
one worker thread: training clients share the machine's cores, and a tiny model gains nothing from
running two at once. Results and failures are written to the store, so a finished future survives
a server restart; `retrieve_future` long-polls (up to `POLL_S`) before answering `try_again`. A future
another server runs (servers sharing one database) is long-polled in the database.
"""
from __future__ import annotations

import asyncio
import json
import logging
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable

from mmrl.serve.store import Store

POLL_S = 20.0
# How often a long-poll re-reads a future another server runs: one primary-key SELECT per waiting
# call, and a result reaches the client at most this late.
DB_POLL_S = 0.5
log = logging.getLogger("mmrl.serve")

# A job returns (payload, content type): JSON-able dicts become application/json.
Job = Callable[[], Awaitable[tuple[Any, str] | dict[str, Any]]]


class JobError(Exception):
    """A failure to report to the client as-is (category "user": the request was wrong)."""

    def __init__(self, message: str, category: str = "user"):
        super().__init__(message)
        self.category = category


class FutureQueue:
    def __init__(self, store: Store, server_id: str | None = None,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep):
        self.store = store
        self.server_id = server_id  # recorded on each future: who runs it
        self._sleep = sleep  # between database reads of another server's future
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmrl-serve-model")
        self._lanes: dict[str, asyncio.Queue] = {}
        self._lane_tasks: dict[str, asyncio.Task] = {}
        self._events: dict[str, asyncio.Event] = {}
        self._loose: set[asyncio.Task] = set()

    async def in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def submit(self, owner: str, model_id: str | None, kind: str, job: Job, lane: str | None = None) -> str:
        """Record a pending future and schedule `job`: on `lane` (in order with the lane's other
        jobs) or, with no lane, at once."""
        fid = self.store.add_future(owner, model_id, kind, self.server_id)
        self._events[fid] = asyncio.Event()
        if lane is None:
            task = asyncio.get_running_loop().create_task(self._run(fid, job))
            self._loose.add(task)
            task.add_done_callback(self._loose.discard)
        else:
            if lane not in self._lanes:
                self._lanes[lane] = asyncio.Queue()
                self._lane_tasks[lane] = asyncio.get_running_loop().create_task(self._drain(lane))
            self._lanes[lane].put_nowait((fid, job))
        return fid

    async def _drain(self, lane: str) -> None:
        queue = self._lanes[lane]
        while True:
            fid, job = await queue.get()
            await self._run(fid, job)

    async def _run(self, fid: str, job: Job) -> None:
        try:
            out = await job()
            payload, ctype = (out, "application/json") if isinstance(out, dict) else out
            if ctype == "application/json":
                payload = json.dumps(payload).encode()
            self.store.finish_future(fid, result=payload, content_type=ctype)
        except JobError as e:
            self.store.finish_future(fid, error=str(e), category=e.category)
        except Exception as e:  # a bug or an engine failure: the client sees it, the server stays up
            log.error("request %s failed:\n%s", fid, traceback.format_exc())
            self.store.finish_future(fid, error=f"{type(e).__name__}: {e}", category="server")
        finally:
            event = self._events.pop(fid, None)
            if event is not None:
                event.set()

    async def wait(self, owner: str, fid: str, timeout: float = POLL_S) -> dict[str, Any] | None:
        """The future's row once finished (or still pending after `timeout`); None if not the owner's."""
        row = self.store.future(owner, fid)
        if row is None or row["status"] != "pending":
            return row
        event = self._events.get(fid)
        if event is None:  # another server runs it (or it finished just now)
            return await self._poll(owner, fid, timeout)
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return self.store.future(owner, fid)

    async def _poll(self, owner: str, fid: str, timeout: float) -> dict[str, Any] | None:
        """Re-read the future every `DB_POLL_S` until it is no longer pending or `timeout` passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            row = self.store.future(owner, fid)
            left = deadline - loop.time()
            if row is None or row["status"] != "pending" or left <= 0:
                return row
            await self._sleep(min(DB_POLL_S, left))

    async def close(self) -> None:
        for task in [*self._lane_tasks.values(), *self._loose]:
            task.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)
