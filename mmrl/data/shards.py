"""Where the bytes come from: shard URLs (brace lists, pipe:, file:, remote) and tar reading.

`read_shard` is the only code that touches a tar stream. It never raises for a broken shard: it
yields `BadSample` markers instead, so one bad file in a million-sample run is a line in the
quarantine report, not a crash.
"""
from __future__ import annotations

import os
import tarfile
import time
from typing import Any, Iterable, Iterator
from urllib.parse import urlparse

from mmrl.data.quarantine import BadSample

BUILD_HINT = "build one with `mmrl data build colors --out DIR` and pass DIR/train-{000000..000003}.tar " \
             "(DIR/dataset.json lists the exact shard patterns)"


class ShardNotFoundError(FileNotFoundError):
    """Local shard files named by the URLs do not exist. `missing` lists them all."""

    def __init__(self, message: str, missing: list[str]):
        super().__init__(message)
        self.missing = missing

    def __str__(self) -> str:  # FileNotFoundError's own __str__ would print "[Errno ...]" noise
        return str(self.args[0])


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


# -------------------------------------------------------------------------- reading (in workers)

def _close_quietly(stream: Any) -> None:
    try:
        stream.close()
    except Exception:  # a pipe: command killed by SIGPIPE when we stopped early, etc.
        pass


class _TimedReader:
    """A file wrapper that counts the bytes and seconds spent in read(): the I/O part of reading
    a shard (the rest of the time iterating the tar is parsing). Only used when profiling."""

    def __init__(self, raw: Any):
        self.raw, self.bytes, self.io_s = raw, 0, 0.0

    def read(self, size: int = -1) -> bytes:
        start = time.perf_counter()
        data = self.raw.read(size)
        self.io_s += time.perf_counter() - start
        self.bytes += len(data)
        return data

    def close(self) -> None:
        self.raw.close()


def read_shard(url: str, profile: bool = False) -> Iterator[dict[str, Any] | BadSample]:
    """Raw samples of one shard: {"__key__", "__url__", member suffix -> bytes}, members grouped
    by key the webdataset way ("KEY.0.jpg" -> key "KEY", member "0.jpg"). A shard that fails
    yields `BadSample`s (shard_open_error / shard_read_error, and truncated_sample for the sample
    being read when it broke) instead of raising.

    profile=True adds "__profile__" to each raw sample: {"read_start", "read_s" (reading and
    parsing its members), "io_s" (of that, inside the file's read()), "bytes", and on the shard's
    first sample "open_s" (opening it, included in read_s)}. Timings are time.perf_counter() seconds."""
    from webdataset.gopen import gopen
    from webdataset.tariterators import base_plus_ext

    opened_at = time.perf_counter()
    try:
        stream = gopen(url)
    except Exception as e:
        yield BadSample("shard_open_error", "", url, f"{type(e).__name__}: {e}")
        return
    reader: _TimedReader | None = None
    mark: dict[str, Any] = {}
    if profile:
        reader = stream = _TimedReader(stream)
        mark = {"read_start": opened_at, "open_s": time.perf_counter() - opened_at, "io_s": 0.0, "bytes": 0}
    current: dict[str, Any] | None = None
    duplicates: list[str] = []
    failure: Exception | None = None
    try:
        try:
            with tarfile.open(fileobj=stream, mode="r|*") as tar:
                for info in tar:
                    if not info.isfile():
                        continue
                    prefix, suffix = base_plus_ext(info.name)
                    if prefix is None or os.path.basename(prefix).startswith("."):  # no suffix, ._junk
                        continue
                    if current is not None and current["__key__"] != prefix:
                        if reader is not None:
                            _stamp(current, reader, mark)
                        yield _finish(current, duplicates)
                        current, duplicates = None, []
                        if reader is not None:  # the next sample's clock starts when we resume
                            mark = {"read_start": time.perf_counter(), "io_s": reader.io_s, "bytes": reader.bytes}
                    if current is None:
                        current = {"__key__": prefix, "__url__": url}
                    if suffix in current:
                        duplicates.append(suffix)
                    member = tar.extractfile(info)
                    current[suffix] = member.read() if member is not None else b""
            stream.close()  # a pipe: command reports its exit status here
        except Exception as e:  # GeneratorExit (consumer stopped) is not an Exception: it passes
            failure = e
    finally:
        _close_quietly(stream)
    if failure is None:
        if current is not None:
            if reader is not None:
                _stamp(current, reader, mark)
            yield _finish(current, duplicates)
        return
    if current is not None:
        yield BadSample("truncated_sample", current["__key__"], url,
                        f"the shard failed while this sample was being read: {type(failure).__name__}")
    yield BadSample("shard_read_error", "", url, f"{type(failure).__name__}: {failure}")


def _stamp(raw: dict[str, Any], reader: _TimedReader, mark: dict[str, Any]) -> None:
    """Turn `mark` (the reader's counters when `raw` began) into raw's read timings, attached as
    raw["__profile__"] (the same dict: one allocation per sample)."""
    mark["read_s"] = time.perf_counter() - mark["read_start"]
    mark["io_s"] = reader.io_s - mark["io_s"]
    mark["bytes"] = reader.bytes - mark["bytes"]
    raw["__profile__"] = mark


def _finish(raw: dict[str, Any], duplicates: list[str]) -> dict[str, Any] | BadSample:
    if duplicates:
        return BadSample("duplicate_member", raw["__key__"], raw["__url__"],
                         f"member(s) {', '.join(duplicates)} appear more than once")
    return raw
