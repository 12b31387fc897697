"""webdataset shards -> `Sample`s, with an exact resume cursor and quarantined bad samples.

    stream = ShardStream("data/train-{000000..000063}.tar", shuffle_buffer=1000, num_workers=2,
                         rank=rank, world_size=world_size, quarantine_path="run/quarantine.jsonl")
    for sample in stream: ...                   # endless by default (epochs=None)
    ckpt["data"] = stream.state_dict()          # after any number of samples
    stream = ShardStream(..., resume=ckpt["data"])  # continues with the next unseen sample

How the order is made (and why it can be resumed exactly): everything is a function of
(seed, epoch). Per epoch the shard list is shuffled (or, with resample=True, drawn with
replacement) identically on every rank; the rank keeps shards rank, rank + world_size, ...; those
are dealt to S = max(1, num_workers) *streams* (stream s reads shards s, s + S, ...), each with its
own seeded shuffle buffer over raw samples. DataLoader worker s runs stream s, and the main
process merges the streams round-robin itself (it does not rely on the order in which workers
happen to deliver). The cursor is therefore (epoch, items taken from each stream, whose turn is
next): on resume each stream replays its raw tar members and drops the first `consumed[s]` before
anything is decoded, so a restart costs a re-read of the bytes, not a re-decode.

Where the work happens:
  main process   expand and check the URLs; per epoch the shard plan; merge the streams; count
                 good and bad samples, write the quarantine report, enforce max_bad_ratio
  each worker    its stream's shards -> tar members (bytes) -> shuffle buffer -> skip (resume)
                 -> decode (JSON, PIL, video decoders; mmrl.data.decode) -> Sample or BadSample
"""
from __future__ import annotations

import copy
import hashlib
import os
import random
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from mmrl.data.decode import IMAGE_EXTS, VIDEO_EXTS, DecodeOptions, decode_sample
from mmrl.data.handoff import PixelRing, RingChunk, RingHandle, pack, pixel_nbytes, unpack
from mmrl.data.quarantine import BadSample, BadSampleError, QuarantineLedger, TooManyBadSamples
from mmrl.data.sample import Sample
from mmrl.data.shards import ShardNotFoundError, expand_urls, read_shard

__all__ = ["ShardStream", "load_all", "expand_urls", "read_shard", "decode_sample", "DecodeOptions",
           "BadSample", "BadSampleError", "TooManyBadSamples", "ShardNotFoundError", "IMAGE_EXTS",
           "VIDEO_EXTS"]


STATE_VERSION = 1


def _mix(*parts: int) -> int:
    """A seed from several integers (stable across processes, unlike hash())."""
    import numpy as np
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


def _shuffled(items: Iterable[Any], bufsize: int, rng: random.Random) -> Iterator[Any]:
    """A shuffle buffer: once full, each new item swaps out a random resident one. Deterministic
    for a given rng and input order, which is all the resume cursor needs."""
    buffer: list[Any] = []
    for item in items:
        if len(buffer) < bufsize:
            buffer.append(item)
            continue
        i = rng.randrange(bufsize)
        buffer[i], item = item, buffer[i]
        yield item
    rng.shuffle(buffer)
    yield from buffer


@dataclass
class _EpochPlan:
    """What one epoch of this rank reads; pickled into the DataLoader workers."""
    shards: list[str]
    num_streams: int
    epoch: int
    seed: int
    rank: int
    shuffle_buffer: int
    skip: list[int]  # per stream: items already delivered before a resume
    options: DecodeOptions
    profile: bool = False  # send each decoded item as a _Timed pair with its stage timings
    rings: list[RingHandle] | None = None  # per stream: where its worker puts image pixels (handoff.py)


# Profiling only: (item, record) -- an item on its way to the main process with its per-stage
# timings (read, decode, per image/video; see mmrl.profiling). A plain tuple because it crosses
# the worker queue once per sample and pickles faster than any class; nothing else in a stream is
# a tuple. The merge counts it like the bare item.
_Timed = tuple


def _stream_items(plan: _EpochPlan, stream_id: int) -> Iterator[Any]:
    urls = plan.shards[stream_id::plan.num_streams]
    raw: Iterable[Any] = (item for url in urls for item in
                          (read_shard(url, profile=True) if plan.profile else read_shard(url)))
    if plan.shuffle_buffer > 1:
        rng = random.Random(_mix(plan.seed, plan.epoch, plan.rank, stream_id, 0x5A))
        raw = _shuffled(raw, plan.shuffle_buffer, rng)
    skip = plan.skip[stream_id]
    for position, item in enumerate(raw):
        if position < skip:
            continue  # delivered before the restart: drop the raw bytes, never decode them
        if isinstance(item, BadSample):
            yield item
        elif plan.profile:
            yield _decode_timed(item, plan.options, stream_id)
        else:
            yield _decode_or_bad(item, plan.options)


def _decode_timed(raw: dict[str, Any], options: DecodeOptions, stream_id: int) -> tuple[Any, dict[str, Any]]:
    record: dict[str, Any] = raw.pop("__profile__", None) or {}
    record["key"], record["worker"] = raw.get("__key__", "?"), stream_id
    start = time.perf_counter()
    item = _decode_or_bad(raw, options, record)
    record["decode_start"], record["decode_s"] = start, time.perf_counter() - start
    if isinstance(item, BadSample):
        record["bad"] = item.reason
    return item, record


def _decode_or_bad(raw: dict[str, Any], options: DecodeOptions,
                   timings: dict[str, Any] | None = None) -> Sample | BadSample:
    try:
        return decode_sample(raw, options) if timings is None else decode_sample(raw, options, timings)
    except BadSampleError as e:
        return BadSample.from_error(e)
    except Exception as e:  # a bug or an exotic input: still never fatal, but visible
        return BadSample("decode_error", str(raw.get("__key__", "?")), str(raw.get("__url__", "")),
                         f"{type(e).__name__}: {e}")


class _StreamEnd:
    """Last item of every stream, so the main-process merge knows a stream is done."""


# Items a worker sends per message: one queue round trip (DataLoader bookkeeping, pipe, poll) per
# item costs more than decoding a small image, so workers send chunks of up to WORKER_CHUNK items
# or CHUNK_PIXEL_BYTES of pixels, whichever comes first (the cursor still counts single items).
WORKER_CHUNK = 64
CHUNK_PIXEL_BYTES = 32 << 20


def _iterate_epoch_source(plan: _EpochPlan) -> Iterator[tuple[int, Any]]:
    """What DataLoader worker w yields: stream w's items tagged with w (in chunks of up to
    WORKER_CHUNK items when in a worker process), then its end marker."""
    import torch.utils.data
    info = torch.utils.data.get_worker_info()
    if info is None:
        for item in _stream_items(plan, 0):
            yield 0, item
        yield 0, _StreamEnd()
        return
    ring = PixelRing(plan.rings[info.id]) if plan.rings else None
    chunk: list[Any] = []
    pixel_bytes = 0
    for item in _stream_items(plan, info.id):
        chunk.append(item)
        pixel_bytes += pixel_nbytes(item)
        if len(chunk) == WORKER_CHUNK or pixel_bytes >= CHUNK_PIXEL_BYTES:
            yield info.id, pack(_stamp_sent(chunk) if plan.profile else chunk, ring)  # pixels via shared memory
            chunk, pixel_bytes = [], 0
    if chunk:
        yield info.id, pack(_stamp_sent(chunk) if plan.profile else chunk, ring)
    yield info.id, _StreamEnd()


def _stamp_sent(chunk: list[Any]) -> list[Any]:
    """Profiling: when each item left its worker (items wait in the chunk until it is full)."""
    now = time.perf_counter()
    for item in chunk:
        if type(item) is _Timed:
            item[1]["sent"] = now
    return chunk


def __getattr__(name: str) -> Any:
    """`_EpochSource` (a torch IterableDataset) is made on first use, so importing this module
    (config validation, `mmrl data inspect`) does not import torch. Being reachable by module
    attribute keeps it picklable for spawn-started DataLoader workers."""
    if name != "_EpochSource":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _epoch_source_class()


def _epoch_source_class() -> type:
    if "_EpochSource" in globals():
        return globals()["_EpochSource"]
    from torch.utils.data import IterableDataset

    class _EpochSource(IterableDataset):  # type: ignore[type-arg]
        def __init__(self, plan: _EpochPlan):
            self.plan = plan

        def __iter__(self) -> Iterator[tuple[int, Any]]:
            return _iterate_epoch_source(self.plan)

    _EpochSource.__module__, _EpochSource.__qualname__ = __name__, "_EpochSource"
    globals()["_EpochSource"] = _EpochSource
    return _EpochSource


def _identity(x: Any) -> Any:
    return x


# ---------------------------------------------------------------------------- merge (main process)

@dataclass
class _Cursor:
    """Where this rank's stream stands: the resume state without the bookkeeping."""
    epoch: int
    consumed: list[int]  # items (good or bad) taken from each stream this epoch
    turn: int = 0  # the stream the round-robin merge reads next
    good_in_epoch: int = 0
    delivered: int = 0  # good samples handed out in all epochs

    def next_epoch(self) -> None:
        self.epoch += 1
        self.consumed = [0] * len(self.consumed)
        self.turn = self.good_in_epoch = 0


def _merge(tagged: Iterator[tuple[int, Any]], cursor: _Cursor,
           rings: list[PixelRing] | None = None) -> Iterator[Any]:
    """Round-robin over the streams starting at cursor.turn, one item per turn, skipping ended
    streams; advances the cursor BEFORE handing an item out, so a state taken right after
    receiving it already counts it. Items that arrive early wait in per-stream queues."""
    n = len(cursor.consumed)
    queues: list[deque[Any]] = [deque() for _ in range(n)]
    ended = [False] * n
    while not all(ended):
        s = cursor.turn
        if ended[s]:
            cursor.turn = (s + 1) % n
            continue
        while not queues[s]:
            try:
                source, item = next(tagged)
            except StopIteration:
                raise RuntimeError(f"data stream {s} ended without its end marker (a worker died?)") from None
            if isinstance(item, (list, RingChunk)):  # a worker's chunk
                queues[source].extend(unpack(item, rings[source] if rings else None))
            else:
                queues[source].append(item)
        item = queues[s].popleft()
        cursor.turn = (s + 1) % n
        if isinstance(item, _StreamEnd):
            ended[s] = True
            continue
        cursor.consumed[s] += 1
        yield item


# ----------------------------------------------------------------------------------------- stream

# Imported once by the forkserver, so each epoch's workers fork from a process that already has
# torch and mmrl's decoders: a worker then starts in well under a second instead of importing
# torch again (seconds per worker, every epoch). No native video library is among them, so the
# server stays as clean as the reason for using it requires.
FORKSERVER_PRELOAD = ("torch.utils.data", "mmrl.data.stream")


def worker_start_method(requested: str | None = None, default: str | None = None) -> str | None:
    """The multiprocessing start method for decode workers: `requested` if given, else forkserver
    when a native video decoder (decord, FFmpeg) is live in this process -- a forked child would
    inherit its threads and state half-initialised and abort -- else `default`. A forkserver is
    told to preload FORKSERVER_PRELOAD (no effect once the server runs)."""
    method = requested
    if method is None:
        native = any(m in sys.modules for m in ("decord", "av", "torchcodec"))
        method = "forkserver" if native else default
    if method == "forkserver":
        import multiprocessing

        multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return method


class ShardStream:
    """An iterable of `Sample`s from webdataset shards (see the module docstring for the order).

    Args:
        urls: shard spec (see `expand_urls`).
        shuffle_buffer: raw-sample shuffle buffer per stream (0 = no sample shuffling).
        seed: seeds the shard order per epoch and the shuffle buffers.
        num_workers: DataLoader worker processes reading and decoding in parallel (0 = in this
            process). Also the number of interleaved streams (0 and 1 both mean one), so it is
            part of the order: resume with the same value.
        epochs: passes over the shards; None = loop forever, reshuffling shard order each epoch.
        resample: each epoch draws len(urls) shards WITH replacement (seeded by seed and epoch)
            instead of a permutation: for mixing sources by shard count, or very large corpora.
        split_by_node: give this rank only shards rank, rank + world_size, ... of each epoch's order.
        rank, world_size: this process's place among the data-parallel consumers.
        shuffle_shards: reshuffle the shard order every epoch (the same order on every rank).
            Default: on when shuffle_buffer > 0 or epochs is None; a finite, unshuffled stream
            reads the shards in the given order.
        decode: `DecodeOptions` (image pixel limit, video frame sampling, decoders, timeout).
        quarantine_path: append every bad sample to this JSONL file ("{rank}" is filled in).
        max_bad_ratio: raise `TooManyBadSamples` when bad / read exceeds this (None = never),
            checked once min_samples_for_ratio samples have been read.
        resume: a `state_dict()` to continue from (same urls, seed, shuffle and worker layout).
        mp_context: DataLoader multiprocessing context ("fork", "spawn", "forkserver"; None = default).
        profile: time every stage in the workers (shard open/read, image and video decode) and
            append one record per item read to `profile_records` (drain it as you go; see
            mmrl.profiling.data_profile). Off: no timing code runs.

    Bad samples are dropped and counted in `bad_counts` (reason -> count); the last few are in
    `bad_examples`. The order is a function of the arguments alone (any num_workers).
    """

    def __init__(self, urls: Any, *, shuffle_buffer: int = 0, seed: int = 0, num_workers: int = 0,
                 epochs: int | None = None, resample: bool = False, split_by_node: bool = True,
                 rank: int = 0, world_size: int = 1, shuffle_shards: bool | None = None,
                 decode: DecodeOptions | None = None, quarantine_path: str | os.PathLike | None = None,
                 max_bad_ratio: float | None = 0.05, min_samples_for_ratio: int = 1000,
                 resume: dict[str, Any] | None = None, mp_context: str | None = None, profile: bool = False):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if shuffle_buffer < 0 or num_workers < 0:
            raise ValueError("shuffle_buffer and num_workers must be >= 0")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None (forever), got {epochs}")
        self.urls = expand_urls(urls)
        self.shuffle_buffer, self.seed, self.num_workers = shuffle_buffer, seed, num_workers
        self.epochs, self.resample = epochs, resample
        self.split_by_node = split_by_node and world_size > 1
        self.rank, self.world_size = rank, world_size
        self.shuffle_shards = (shuffle_buffer > 0 or epochs is None) if shuffle_shards is None else shuffle_shards
        self.decode = decode or DecodeOptions()
        self.mp_context = mp_context
        self.profile = profile
        self.profile_records: list[dict[str, Any]] = []  # filled only when profile=True
        self.quarantine = QuarantineLedger(quarantine_path, max_bad_ratio, min_samples_for_ratio, rank)
        self.num_streams = max(1, num_workers)
        self._start = _Cursor(epoch=0, consumed=[0] * self.num_streams)
        self._live: _Cursor | None = None  # cursor of the most recently started iterator
        self._taker: Iterator[Sample] | None = None

        n_mine = len(self.urls[rank::world_size]) if self.split_by_node else len(self.urls)
        if n_mine == 0:
            raise ValueError(
                f"rank {rank} of {world_size} gets no shard: only {len(self.urls)} shard(s). Write at "
                f"least one shard per rank (a smaller shard size), or set split_by_node=False")
        if num_workers > n_mine:
            warnings.warn(f"{num_workers} data workers but only {n_mine} shard(s) for this rank: "
                          f"{num_workers - n_mine} worker(s) will idle. Write more, smaller shards.",
                          stacklevel=2)
        if resume is not None:
            self.load_state_dict(resume)

    # ---- bookkeeping views
    @property
    def bad_counts(self) -> Any:
        """reason -> count of bad samples skipped so far (a Counter; carried across resume)."""
        return self.quarantine.counts

    @property
    def bad_examples(self) -> deque[BadSample]:
        return self.quarantine.examples

    @property
    def delivered(self) -> int:
        """Good samples handed out so far (carried across resume)."""
        return (self._live or self._start).delivered

    # ---- order
    def epoch_shards(self, epoch: int) -> list[str]:
        """This rank's shards for `epoch`, in reading order (before the split into streams)."""
        urls = list(self.urls)
        rng = random.Random(_mix(self.seed, epoch, 0x5D))
        if self.resample:
            urls = rng.choices(urls, k=len(urls))
        elif self.shuffle_shards:
            rng.shuffle(urls)
        return urls[self.rank::self.world_size] if self.split_by_node else urls

    def _epoch_items(self, cursor: _Cursor) -> Iterator[Sample | BadSample]:
        plan = _EpochPlan(self.epoch_shards(cursor.epoch), self.num_streams, cursor.epoch, self.seed,
                          self.rank, self.shuffle_buffer, list(cursor.consumed), self.decode, self.profile)
        if self.num_workers == 0:
            yield from _merge(_iterate_epoch_source(plan), cursor)
            return
        import torch.utils.data
        context = worker_start_method(self.mp_context)
        rings = self._make_rings(context)
        plan.rings = [r.handle for r in rings] if rings else None
        source = _epoch_source_class()(plan)
        loader = torch.utils.data.DataLoader(source, batch_size=None, num_workers=self.num_workers,
                                             collate_fn=_identity, multiprocessing_context=context)
        it = iter(loader)
        try:
            yield from _merge(it, cursor, rings)
        finally:
            del it  # shuts the workers down now, also when the consumer stops early
            for ring in rings or []:
                ring.close(unlink=True)

    def _make_rings(self, context: str | None) -> list[PixelRing] | None:
        """One pixel ring per worker for this epoch; None (pickle everything) where shared-memory
        files cannot be made."""
        import multiprocessing

        try:
            ctx = multiprocessing.get_context(context)
            return [PixelRing.create(ctx) for _ in range(self.num_streams)]
        except OSError as e:
            warnings.warn(f"image hand-off through shared memory is off ({e}); images are pickled instead")
            return None

    def __iter__(self) -> Iterator[Sample]:
        cursor = self._live = copy.deepcopy(self._start)
        while self.epochs is None or cursor.epoch < self.epochs:
            for item in self._epoch_items(cursor):
                if type(item) is _Timed:
                    item, record = item
                    record["delivered"] = time.perf_counter()
                    self.profile_records.append(record)
                if isinstance(item, BadSample):
                    self.quarantine.record_bad(item, cursor.epoch)
                    continue
                self.quarantine.record_good()
                cursor.good_in_epoch += 1
                cursor.delivered += 1
                yield item
            if cursor.good_in_epoch == 0:
                raise RuntimeError(
                    f"epoch {cursor.epoch} of {len(self.urls)} shard(s) gave no usable sample on rank "
                    f"{self.rank}; bad samples so far: {dict(self.bad_counts) or 'none'}")
            cursor.next_epoch()

    # ---- resume
    def _layout(self) -> dict[str, Any]:
        """What the order depends on; a resume state only fits a stream with the same layout."""
        digest = hashlib.sha1("\n".join(self.urls).encode()).hexdigest()[:16]
        return {"urls_sha1": digest, "num_urls": len(self.urls), "seed": self.seed,
                "shuffle_buffer": self.shuffle_buffer, "streams": self.num_streams,
                "shuffle_shards": self.shuffle_shards, "resample": self.resample,
                "split_by_node": self.split_by_node, "rank": self.rank, "world_size": self.world_size}

    def state_dict(self) -> dict[str, Any]:
        """The exact position after the last sample handed out (JSON-serialisable). A stream built
        with `resume=` this state continues with the next sample the uninterrupted stream would
        have given: no repeat, no skip. Take it between samples of one running iterator."""
        cursor = self._live or self._start
        return {"version": STATE_VERSION, "layout": self._layout(), "epoch": cursor.epoch,
                "consumed": list(cursor.consumed), "turn": cursor.turn,
                "good_in_epoch": cursor.good_in_epoch, "delivered": cursor.delivered,
                "quarantine": self.quarantine.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` on the next iteration (and in `take`)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a ShardStream state (version {STATE_VERSION}): "
                             f"{str(state)[:200]}")
        mine, theirs = self._layout(), state.get("layout", {})
        differ = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if differ:
            shown = ", ".join(f"{k}: state {a!r} vs stream {b!r}" for k, (a, b) in differ.items())
            raise ValueError(f"resume state does not fit this stream ({shown}). The sample order depends "
                             f"on the shard list, seed, shuffle_buffer, num_workers (0 and 1 are the "
                             f"same), resample, shuffle_shards and rank/world_size: resume with the same")
        consumed = [int(c) for c in state["consumed"]]
        self._start = _Cursor(int(state["epoch"]), consumed, int(state["turn"]) % len(consumed),
                              int(state.get("good_in_epoch", 0)), int(state.get("delivered", 0)))
        self._live = None
        self.quarantine.load_state_dict(state.get("quarantine", {}))
        self.close()

    # ---- convenience
    def take(self, n: int) -> list[Sample]:
        """The next `n` samples from this stream's own running iterator (started on first use,
        kept between calls, so successive calls continue where the last one stopped; fewer than
        `n` when a finite stream ends). `for s in stream` always starts a fresh pass instead
        (from the beginning, or from the resume state)."""
        if self._taker is None:
            self._taker = iter(self)
        out = []
        for _ in range(n):
            try:
                out.append(next(self._taker))
            except StopIteration:
                break
        return out

    def close(self) -> None:
        """Stop the running `take` iterator and its worker processes."""
        if self._taker is not None:
            self._taker.close()  # type: ignore[attr-defined]
            self._taker = None

    def __enter__(self) -> "ShardStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def load_all(urls: Any, decode: DecodeOptions | None = None) -> list[Sample]:
    """Every sample of a (small) split, in shard and tar order, decoded in this process."""
    stream = ShardStream(urls, epochs=1, shuffle_buffer=0, num_workers=0, split_by_node=False,
                         shuffle_shards=False, decode=decode, max_bad_ratio=None)
    samples = list(stream)
    if stream.bad_counts:
        warnings.warn(f"load_all({urls!r}) skipped bad samples: {dict(stream.bad_counts)}", stacklevel=2)
    return samples
