"""webdataset shards -> `Sample`s.

    stream = ShardStream("data/colors/train-{000000..000003}.tar", shuffle_buffer=1000,
                         num_workers=2, rank=rank, world_size=world_size)
    for sample in stream: ...                   # endless by default (epochs=None)
    heldout = load_all("data/colors/heldout-{000000..000000}.tar")

Where the work happens:
  main process   expand and check the URLs; per epoch, shuffle the shard list with (seed, epoch)
                 (the same order on every rank), then count and drop bad-sample markers
  each worker    its share of this rank's shards (webdataset node/worker split) -> tar members
                 -> shuffle buffer on the raw bytes -> decode (JSON, PIL) -> Sample or marker
A bad sample (bad JSON, undecodable image, no prompt, unreadable shard ...) is never fatal: the
worker yields a small `_Bad` marker in its place, and the main-process iterator counts it in
`stream.bad_counts` by reason and drops it, so the counts cover all workers.
"""
from __future__ import annotations

import io
import itertools
import json
import logging
import os
import random
import tarfile
import warnings
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Iterable, Iterator
from urllib.parse import urlparse

from PIL import Image, ImageOps

from mmrl.data.sample import Sample, messages_from_prompt

logger = logging.getLogger(__name__)

IMAGE_EXTS = ("png", "jpg", "jpeg", "webp")
VIDEO_EXTS = ("mp4", "webm", "avi", "mkv", "mov")
BUILD_HINT = "build one with `mmrl data build colors --out DIR` and pass DIR/train-{000000..000003}.tar " \
             "(DIR/dataset.json lists the exact shard patterns)"


class ShardNotFoundError(FileNotFoundError):
    """Local shard files named by the URLs do not exist. `missing` lists them all."""

    def __init__(self, message: str, missing: list[str]):
        super().__init__(message)
        self.missing = missing

    def __str__(self) -> str:  # FileNotFoundError's own __str__ would print "[Errno ...]" noise
        return str(self.args[0])


class BadSampleError(ValueError):
    """A sample that cannot be used. `reason` is a short category (the key of `bad_counts`)."""

    def __init__(self, reason: str, detail: str = "", key: str = "", url: str = ""):
        self.reason, self.detail, self.key, self.url = reason, detail, key, url
        where = f"sample {key!r}" + (f" in {url}" if url else "")
        super().__init__(f"{where}: {reason}" + (f" ({detail})" if detail else ""))


# ------------------------------------------------------------------------------------------- URLs

def _local_path(url: str) -> str | None:
    """The file path of a local URL (plain path or file:), None for pipe:/http:/s3: ... URLs."""
    if url.startswith("pipe:"):
        return None
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return parsed.path
    if parsed.scheme == "" or len(parsed.scheme) == 1:  # plain path (or a Windows drive letter)
        return url
    return None


def expand_urls(spec: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    """Shard URLs from a spec: brace patterns ("train-{000000..000003}.tar"), "::"-separated lists,
    Python lists of either, `pipe:CMD` URLs (kept as is, braces expanded), remote URLs.

    Local paths are checked: missing files raise `ShardNotFoundError` naming each of them.
    """
    from webdataset.shardlists import expand_urls as _wds_expand  # '::' split, $WDS_ vars, braces

    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    urls: list[str] = []
    for s in specs:
        s = os.fspath(s)
        if not isinstance(s, str):
            raise TypeError(f"shard url must be a string or a path, got {s!r}")
        for url in _wds_expand(s):
            url = url.strip()
            if not url:
                continue
            path = _local_path(url)
            if path is not None and path.startswith("~"):
                url = os.path.expanduser(path)
            urls.append(url)
    if not urls:
        raise ValueError(f"no shard urls in {spec!r}; {BUILD_HINT}")

    missing, dirs = [], []
    for url in urls:
        path = _local_path(url)
        if path is not None and not os.path.isfile(path):
            (dirs if os.path.isdir(path) else missing).append(path)
    if dirs:
        raise ShardNotFoundError(
            f"shard url(s) name a directory, not .tar shard files: {', '.join(dirs[:5])}. Give the shard "
            f"files, e.g. {os.path.join(dirs[0], 'train-{000000..000003}.tar')} (see dataset.json there)",
            dirs + missing)
    if missing:
        shown = ", ".join(missing[:50]) + (f" ... and {len(missing) - 50} more" if len(missing) > 50 else "")
        msg = f"{len(missing)} of {len(urls)} shard file(s) not found: {shown}"
        if len(missing) == len(urls):
            msg += f". No shard matches {spec!r}: {BUILD_HINT}"
        raise ShardNotFoundError(msg, missing)
    return urls


# ----------------------------------------------------------------------------------------- decode

def _member_order(name: str) -> tuple[int, int, str]:
    """"png" first, then "0.png", "1.png", ... numerically, then other prefixes by name."""
    prefix = name.rpartition(".")[0]
    if not prefix:
        return (0, 0, name)
    if prefix.isdigit():
        return (1, int(prefix), name)
    return (2, 0, name)


def _decode_image(data: bytes) -> Image.Image:
    with Image.open(io.BytesIO(data)) as im:
        im.load()  # PIL is lazy: force the full decode here so a truncated file fails now
        im = ImageOps.exif_transpose(im)
        return im.convert("RGB")  # always a fresh in-memory image, detached from the buffer


def _count_placeholders(messages: list[dict[str, Any]], kind: str) -> int:
    n = 0
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            n += sum(1 for c in content if isinstance(c, dict) and c.get("type") == kind)
    return n


def decode_sample(raw: dict[str, Any]) -> Sample:
    """A webdataset raw sample (`__key__`, `__url__`, `json` bytes, image members) -> `Sample`.

    Images: members ending in png/jpg/jpeg/webp ("png", or "0.png", "1.png", ... in index order),
    decoded with PIL, EXIF-transposed, RGB. JSON: "prompt" (messages are built with one image
    placeholder per image, optional "system") or "messages" (its image placeholders must match
    the images); "answer" and "metadata" pass through. Raises `BadSampleError` with a reason.
    """
    key = str(raw.get("__key__", "?"))
    url = str(raw.get("__url__", ""))

    def bad(reason: str, detail: str = "") -> BadSampleError:
        return BadSampleError(reason, detail, key, url)

    members = sorted(k for k in raw if not k.startswith("__"))
    if "json" not in raw:
        raise bad("missing json", f"members: {', '.join(members) or '(none)'}")
    meta = raw["json"]
    if isinstance(meta, (bytes, bytearray, memoryview, str)):
        try:
            meta = json.loads(bytes(meta).decode("utf-8") if not isinstance(meta, str) else meta)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad("invalid json", str(e)) from None
    if not isinstance(meta, dict):
        raise bad("invalid json", f"top level must be an object, got {type(meta).__name__}")

    videos = [k for k in members if k.rpartition(".")[2] in VIDEO_EXTS]
    if videos:
        raise bad("unsupported video", f"members {', '.join(videos)}: video decoding is not wired "
                                       f"into decode_sample yet")
    image_keys = sorted((k for k in members if k.rpartition(".")[2] in IMAGE_EXTS), key=_member_order)
    images = []
    for k in image_keys:
        try:
            images.append(_decode_image(raw[k]))
        except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError ...
            raise bad("undecodable image", f"{k}: {type(e).__name__}: {e}") from None

    if meta.get("messages") is not None:
        messages = meta["messages"]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and "role" in m for m in messages):
            raise bad("invalid messages", "'messages' must be a non-empty list of {'role', 'content'} objects")
        n_placeholders = _count_placeholders(messages, "image")
        if n_placeholders != len(images):
            raise bad("image count mismatch",
                      f"{n_placeholders} image placeholder(s) in messages, {len(images)} image member(s)")
        if _count_placeholders(messages, "video"):
            raise bad("unsupported video", "video placeholders in messages")
    elif isinstance(meta.get("prompt"), str) and meta["prompt"].strip():
        system = meta.get("system")
        messages = messages_from_prompt(meta["prompt"], n_images=len(images),
                                        system=system if isinstance(system, str) else None)
    else:
        raise bad("no prompt", "json has neither a non-empty 'prompt' nor 'messages'")

    metadata = meta.get("metadata")
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict):
        raise bad("invalid json", f"'metadata' must be an object, got {type(metadata).__name__}")
    return Sample(key=key, messages=messages, images=images, answer=meta.get("answer"),
                  metadata=metadata, source=url)


# ------------------------------------------------------------------- pipeline pieces (picklable)

@dataclass
class _Bad:
    """Stands in for a bad sample on its way from a worker to the main process."""
    reason: str
    key: str = ""
    url: str = ""
    detail: str = ""


def _identity(x: Any) -> Any:
    return x


def _decode_or_bad(raw: dict[str, Any] | _Bad) -> Sample | _Bad:
    if isinstance(raw, _Bad):
        return raw
    try:
        return decode_sample(raw)
    except BadSampleError as e:
        return _Bad(e.reason, e.key, e.url, e.detail)
    except Exception as e:  # a bug or an exotic input: still never fatal, but visible
        return _Bad("decode error", str(raw.get("__key__", "?")), str(raw.get("__url__", "")),
                    f"{type(e).__name__}: {e}")


def _mix(*parts: int) -> int:
    """A seed from several integers (stable across processes, unlike hash())."""
    import numpy as np
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


def _worker_id() -> int:
    import torch.utils.data
    info = torch.utils.data.get_worker_info()
    return 0 if info is None else info.id


class _NodeSplit:
    """Keep shards rank, rank + world_size, ... (explicit rank, not read from the environment)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def __call__(self, src: Iterable[Any]) -> Iterator[Any]:
        return itertools.islice(src, self.rank, None, self.world_size)


class _Shuffle:
    """Shuffle buffer over raw samples, seeded per (seed, epoch, rank, worker)."""

    def __init__(self, bufsize: int, seed: int, epoch: int, rank: int):
        self.bufsize, self.seed, self.epoch, self.rank = bufsize, seed, epoch, rank

    def __call__(self, src: Iterable[Any]) -> Iterator[Any]:
        from webdataset.filters import _shuffle
        rng = random.Random(_mix(self.seed, self.epoch, self.rank, _worker_id(), 0x5A))
        return _shuffle(iter(src), bufsize=self.bufsize, initial=self.bufsize, rng=rng)


class _ErrorSink:
    """webdataset's exception handler for shard-level failures (open, tar read, grouping): it
    records a marker and lets the pipeline go on; `_Quarantine` puts the markers in the stream."""

    def __init__(self) -> None:
        self.pending: list[_Bad] = []
        self.failed_urls: set[str] = set()

    def __call__(self, exn: Exception) -> bool:
        if isinstance(exn, (FileNotFoundError, PermissionError, IsADirectoryError)):
            reason = "shard open error"
        elif isinstance(exn, ValueError) and "duplicate file name" in str(exn):
            reason = "duplicate member"
        elif isinstance(exn, (tarfile.TarError, EOFError, OSError, ValueError)):
            reason = "shard read error"
        else:
            reason = "shard error"
        # tar_file_expander appends (stream, url) to the args; open errors carry a filename
        urls = [a for a in getattr(exn, "args", ())[1:] if isinstance(a, str)]
        url = urls[-1] if urls else str(getattr(exn, "filename", "") or "")
        bad = _Bad(reason, "", url, f"{type(exn).__name__}: {exn.args[0] if exn.args else exn}")
        if url:
            self.failed_urls.add(url)
        last = self.pending[-1] if self.pending else None
        if last is not None and last.reason == reason and not last.url and url:
            self.pending[-1] = bad  # one broken tar stream is reported twice (member, then shard)
        else:
            self.pending.append(bad)
        return True

    def drain(self) -> list[_Bad]:
        out, self.pending = self.pending, []
        return out


class _Quarantine:
    """Right after tar grouping: emit shard-error markers into the stream, and replace the sample
    that was being assembled when its shard broke (it may lack members) by a marker."""

    def __init__(self, sink: _ErrorSink):
        self.sink = sink

    def __call__(self, src: Iterable[Any]) -> Iterator[Any]:
        for raw in src:
            failed, self.sink.failed_urls = self.sink.failed_urls, set()
            yield from self.sink.drain()
            if raw.get("__url__") in failed:
                yield _Bad("truncated sample", str(raw.get("__key__", "?")), str(raw.get("__url__")),
                           "its shard failed while this sample was being read")
            else:
                yield raw
        yield from self.sink.drain()


# ----------------------------------------------------------------------------------------- stream

class ShardStream:
    """An iterable of `Sample`s from webdataset shards.

    Args:
        urls: shard spec (see `expand_urls`).
        shuffle_buffer: sample shuffle buffer size per worker (0 = no sample shuffling).
        seed: seeds the shard order per epoch and the shuffle buffers.
        num_workers: DataLoader worker processes decoding in parallel (0 = decode in this process).
        epochs: passes over the shards; None = loop forever, reshuffling shard order each epoch.
        split_by_node: give this rank only shards rank, rank + world_size, ... of each epoch's order.
        rank, world_size: this process's place among the data-parallel consumers.
        shuffle_shards: reshuffle the shard order every epoch (the same order on every rank).
            Default: on when shuffle_buffer > 0 or epochs is None; a finite, unshuffled stream
            reads the shards in the given order.
        mp_context: DataLoader multiprocessing context ("fork", "spawn", "forkserver"; None = default).

    Bad samples are dropped and counted in `bad_counts` (reason -> count); the last few are in
    `bad_examples`. Deterministic for a seed when num_workers <= 1.
    """

    def __init__(self, urls: Any, *, shuffle_buffer: int = 0, seed: int = 0, num_workers: int = 0,
                 epochs: int | None = None, split_by_node: bool = True, rank: int = 0,
                 world_size: int = 1, shuffle_shards: bool | None = None, mp_context: str | None = None):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if shuffle_buffer < 0 or num_workers < 0:
            raise ValueError("shuffle_buffer and num_workers must be >= 0")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None (forever), got {epochs}")
        self.urls = expand_urls(urls)
        self.shuffle_buffer, self.seed, self.num_workers = shuffle_buffer, seed, num_workers
        self.epochs = epochs
        self.split_by_node = split_by_node and world_size > 1
        self.rank, self.world_size = rank, world_size
        self.shuffle_shards = (shuffle_buffer > 0 or epochs is None) if shuffle_shards is None else shuffle_shards
        self.mp_context = mp_context
        self.bad_counts: Counter[str] = Counter()
        self.bad_examples: deque[_Bad] = deque(maxlen=20)
        self.delivered = 0
        self._cursor: Iterator[Sample] | None = None

        n_mine = len(self.urls[rank::world_size]) if self.split_by_node else len(self.urls)
        if n_mine == 0:
            raise ValueError(
                f"rank {rank} of {world_size} gets no shard: only {len(self.urls)} shard(s). Write at "
                f"least one shard per rank (a smaller shard size), or set split_by_node=False")
        if num_workers > n_mine:
            warnings.warn(f"{num_workers} data workers but only {n_mine} shard(s) for this rank: "
                          f"{num_workers - n_mine} worker(s) will idle. Write more, smaller shards.",
                          stacklevel=2)

    def _pipeline(self, epoch: int, sink: _ErrorSink) -> Any:
        import webdataset as wds

        urls = list(self.urls)
        if self.shuffle_shards:
            random.Random(_mix(self.seed, epoch, 0x5D)).shuffle(urls)
        ds = wds.WebDataset(
            urls,
            shardshuffle=False,  # the order was drawn above, identically on every rank
            nodesplitter=_NodeSplit(self.rank, self.world_size) if self.split_by_node else None,
            workersplitter=wds.split_by_worker,
            handler=sink,
            empty_check=False,  # an idle worker is fine; an empty epoch is checked in __iter__
            seed=self.seed,
        ).compose(_Quarantine(sink))
        if self.shuffle_buffer > 1:
            ds = ds.compose(_Shuffle(self.shuffle_buffer, self.seed, epoch, self.rank))
        return ds.map(_decode_or_bad)

    def _epoch(self, epoch: int) -> Iterator[Sample | _Bad]:
        ds = self._pipeline(epoch, _ErrorSink())
        if self.num_workers == 0:
            yield from ds
            return
        import torch.utils.data
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=self.num_workers,
                                             collate_fn=_identity, multiprocessing_context=self.mp_context)
        it = iter(loader)
        try:
            yield from it
        finally:
            del it  # shuts the workers down now, also when the consumer stops early

    def _count(self, bad: _Bad) -> None:
        self.bad_counts[bad.reason] += 1
        self.bad_examples.append(bad)
        first = self.bad_counts[bad.reason] == 1
        (logger.warning if first else logger.debug)(
            "skipping bad sample (%s): key=%r url=%s %s%s", bad.reason, bad.key, bad.url, bad.detail,
            " [first of this reason; later ones are logged at debug level; see stream.bad_counts]"
            if first else "")

    def __iter__(self) -> Iterator[Sample]:
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            good = 0
            for item in self._epoch(epoch):
                if isinstance(item, _Bad):
                    self._count(item)
                    continue
                good += 1
                self.delivered += 1
                yield item
            if good == 0:
                raise RuntimeError(
                    f"epoch {epoch} of {len(self.urls)} shard(s) gave no usable sample on rank {self.rank}; "
                    f"bad samples so far: {dict(self.bad_counts) or 'none'}")
            epoch += 1

    def take(self, n: int) -> list[Sample]:
        """The next `n` samples from this stream's own running iterator (started on first use,
        kept between calls, so successive calls continue where the last one stopped; fewer than
        `n` when a finite stream ends). `for s in stream` always starts a fresh pass instead."""
        if self._cursor is None:
            self._cursor = iter(self)
        return list(itertools.islice(self._cursor, n))

    def close(self) -> None:
        """Stop the running `take` iterator and its worker processes."""
        if self._cursor is not None:
            self._cursor.close()  # type: ignore[attr-defined]
            self._cursor = None

    def __enter__(self) -> "ShardStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def load_all(urls: Any) -> list[Sample]:
    """Every sample of a (small) split, in shard and tar order, decoded in this process."""
    stream = ShardStream(urls, epochs=1, shuffle_buffer=0, num_workers=0, split_by_node=False,
                         shuffle_shards=False)
    samples = list(stream)
    if stream.bad_counts:
        warnings.warn(f"load_all({urls!r}) skipped bad samples: {dict(stream.bad_counts)}", stacklevel=2)
    return samples
