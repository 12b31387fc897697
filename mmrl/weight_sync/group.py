"""A process group for the weight sync: trainer rank 0 (group rank 0, the sender) and the rollout
engines' vLLM workers (ranks 1..), formed over a TCP rendezvous that rank 0 hosts.

It lives beside whatever default process group a member already has (the trainer ranks' ZeRO-3
group, vLLM's own world group inside an engine): the backend object is built directly on a
prefixed store, never through `init_process_group`, so neither side's global state changes.
Collectives go through the backend object with group ranks (the functional `dist.broadcast`
would want global ranks of the default group).
"""
from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


def open_store(host: str, timeout_s: float) -> Any:
    """Rank 0's rendezvous: a TCPStore on a port the kernel picks in this process (`.port`), so
    nothing can take the port between choosing and binding it."""
    return dist.TCPStore(host, 0, None, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


class WeightGroup:
    """One member's handle on the group. Building it blocks until every member has joined."""

    def __init__(self, store: Any, rank: int, world_size: int, backend: str, timeout_s: float, name: str):
        if backend not in BACKENDS:
            raise ValueError(f"weight-sync group backend must be one of {BACKENDS}, got {backend!r}")
        self.rank, self.world_size, self.backend, self.name = rank, world_size, backend, name
        self._store = store  # the group's connections were made through it; keep it alive
        prefixed = dist.PrefixStore(f"mmrl-weight-sync/{name}", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "gloo":
            self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)

    @classmethod
    def join(cls, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
             name: str) -> "WeightGroup":
        """A receiving member: connect to rank 0's store at host:port."""
        store = dist.TCPStore(host, port, None, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        return cls(store, rank, world_size, backend, timeout_s, name)

    @property
    def device(self) -> torch.device:
        """Where tensors must be for this backend (NCCL moves GPU memory only)."""
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def start_broadcast(self, tensor: torch.Tensor, src: int = 0) -> Any:
        """Rank `src` sends `tensor`; every other member receives into its own `tensor` (same
        size). Returns the work handle (`is_completed()`, `wait()`)."""
        options = dist.BroadcastOptions()
        options.rootRank = src
        return self._pg.broadcast([tensor], options)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.start_broadcast(tensor, src).wait()

    def close(self) -> None:
        shutdown = getattr(self._pg, "shutdown", None)
        if callable(shutdown):
            shutdown()
