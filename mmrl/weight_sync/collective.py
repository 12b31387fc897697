"""The collective transport, rank 0's side: a `WeightGroup` with the engines' vLLM workers
(formed once, kept across syncs) and a sender that broadcasts each bucket into it.

One sync: every engine pauses and opens a reload session (`begin_weight_update`); per bucket, the
engines are told the bucket's header (names, dtypes, shapes) by actor call and join the broadcast
of its flat buffer, then load it into the model at once; `finish_weight_update` closes the
session, resets the caches, sets the version and resumes. An engine never holds more than about
one bucket besides its own weights.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import ray
import torch

from mmrl.weight_sync.group import WeightGroup, open_store
from mmrl.weight_sync.packing import pack_bucket


def engine_ids(engines: Sequence[Any]) -> tuple[str, ...]:
    return tuple(e._actor_id.hex() for e in engines)


@dataclass
class CollectiveLink:
    """The group and the engines it was formed with (a replaced engine needs a new group)."""

    group: WeightGroup
    engines: tuple[str, ...]
    backend: str

    @classmethod
    def connect(cls, engines: Sequence[Any], worker_counts: Sequence[int], backend: str, host: str,
                timeout_s: float) -> "CollectiveLink":
        """Rank 0 hosts the rendezvous; each engine's workers join as ranks 1.. in engine order.
        The joins run while this process builds its own member (which waits for all of them)."""
        store = open_store(host, timeout_s)
        world = 1 + sum(worker_counts)
        name = uuid.uuid4().hex[:12]
        refs, first = [], 1
        for engine, count in zip(engines, worker_counts):
            refs.append(engine.join_weight_group.remote(host, store.port, first, world, backend, timeout_s, name))
            first += count
        group = WeightGroup(store, 0, world, backend, timeout_s, name)
        ray.get(refs, timeout=timeout_s)
        return cls(group, engine_ids(engines), backend)

    def close(self) -> None:
        self.group.close()


class CollectiveSender:
    def __init__(self, link: CollectiveLink, engines: Sequence[Any], timeout_s: float):
        self.link, self.engines, self.timeout_s = link, list(engines), timeout_s
        self.device = "cuda" if link.backend == "nccl" else "cpu"
        begin_engines(self.engines, timeout_s)

    def send(self, tensors: dict[str, torch.Tensor]) -> int:
        header, flat = pack_bucket(tensors, self.link.group.device)
        refs = [e.receive_bucket.remote(header.to_json()) for e in self.engines]
        work = self.link.group.start_broadcast(flat)
        # An engine that fails before it joins the broadcast would leave this one waiting for
        # the group's whole timeout: watch the engines' calls meanwhile and raise their error.
        pending = refs
        while pending and not work.is_completed():
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0.05)
            ray.get(ready)
        work.wait()
        # the engines have loaded this bucket before the next one is gathered: at most one
        # bucket is in flight
        ray.get(refs, timeout=self.timeout_s)
        return header.nbytes

    def finish(self, version: int) -> dict[str, float]:
        return finish_engines(self.engines, version, self.timeout_s)

    def abort(self) -> None:
        finish_engines(self.engines, None, self.timeout_s)


def begin_engines(engines: Sequence[Any], timeout_s: float) -> None:
    """Pause every engine and open its reload session before the first bucket. If one fails, the
    others resume (their sessions closed, version unchanged) before the error is raised."""
    try:
        ray.get([e.begin_weight_update.remote() for e in engines], timeout=timeout_s)
    except BaseException:
        try:
            finish_engines(engines, None, timeout_s)
        except Exception:
            pass  # the begin error is the one to report
        raise


def finish_engines(engines: Sequence[Any], version: int | None, timeout_s: float) -> dict[str, float]:
    """Close every engine's reload session (version None: an aborted sync, the version stays)
    and report the longest pause and the most any engine staged at once."""
    done = ray.get([e.finish_weight_update.remote(version) for e in engines], timeout=timeout_s)
    return {"apply_s": max(d["apply_seconds"] for d in done),
            "engine_peak_staged_mb": max(d["peak_staged_bytes"] for d in done) / 2**20,
            "engine_staged_tensors": float(max(d["staged_tensors"] for d in done))}
