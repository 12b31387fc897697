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
            for name, data in tar_members(stream):
                prefix, suffix = base_plus_ext(name)
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
                current[suffix] = data
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


# ------------------------------------------------------------------------------------ tar parsing

# Python's tarfile costs ~100 us per member in stream mode (half of it for PAX records), as much
# as decoding a small image; these few lines parse the same headers in a few microseconds.
# Compressed shards (.tar.gz and the like) still go through tarfile, which decompresses them.
_BLOCK = 512
_COMPRESSED_MAGIC = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ", b"\x28\xb5\x2f\xfd")
_FILE_TYPES = (b"0", b"\0", b"7")  # regular file (old and new flag), contiguous file


class _Prefixed:
    """A stream with bytes already read from it put back in front (for tarfile)."""

    def __init__(self, head: bytes, raw: Any):
        self.head, self.raw = head, raw

    def read(self, size: int = -1) -> bytes:
        if not self.head:
            return self.raw.read(size)
        if size < 0:
            out, self.head = self.head + self.raw.read(), b""
            return out
        out, self.head = self.head[:size], self.head[size:]
        return out + (self.raw.read(size - len(out)) if len(out) < size else b"")


def _read_exact(stream: Any, size: int) -> bytes:
    data = stream.read(size)
    while len(data) < size:  # pipes may return short reads
        more = stream.read(size - len(data))
        if not more:
            break
        data += more
    return data


def _number(field: bytes) -> int:
    """A numeric header field: octal text, or GNU base-256 when the high bit is set."""
    if field[0] & 0x80:
        value = int.from_bytes(field[1:], "big") | ((field[0] & 0x7F) << (8 * (len(field) - 1)))
        return value - (1 << (8 * len(field) - 1)) if field[0] & 0x40 else value
    text = field.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0


def _pax_records(data: bytes) -> dict[str, str]:
    """'LEN key=value\\n' records of a PAX extended header."""
    records, pos = {}, 0
    while pos < len(data) and data[pos:pos + 1] != b"\0":
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        key, _, value = data[space + 1:pos + length - 1].partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


def tar_members(stream: Any) -> Iterator[tuple[str, bytes]]:
    """(name, data) of each regular file in a tar stream, in order. Understands ustar, PAX (path,
    size) and GNU long-name headers; other member types (directories, links) are skipped. A bad
    header checksum or a stream that ends inside a member raises tarfile.ReadError, so a broken
    shard is never mistaken for a short one."""
    block = _read_exact(stream, _BLOCK)
    if block.startswith(_COMPRESSED_MAGIC):
        with tarfile.open(fileobj=_Prefixed(block, stream), mode="r|*") as tar:
            for info in tar:
                if info.isfile():
                    member = tar.extractfile(info)
                    yield info.name, member.read() if member is not None else b""
        return
    if not block:
        raise tarfile.ReadError("empty file")
    pending: dict[str, str] = {}
    last = "(none)"
    while True:
        if len(block) < _BLOCK:
            raise tarfile.ReadError(f"unexpected end of data: truncated header after member {last!r}")
        if block == bytes(_BLOCK):
            return  # end-of-archive marker
        try:
            kind, name, size = _header(block, pending)
        except ValueError as e:
            raise tarfile.ReadError(f"invalid tar header after member {last!r}: {e}") from None
        data = _read_exact(stream, -(-size // _BLOCK) * _BLOCK)
        if len(data) < size:
            raise tarfile.ReadError(f"unexpected end of data: member {name!r} is truncated")
        data = data[:size]
        if kind == b"x":
            pending.update(_pax_records(data))
        elif kind == b"L":
            pending["path"] = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
        elif kind not in (b"g", b"K"):  # global PAX defaults, GNU long link names: nothing a sample needs
            if kind in _FILE_TYPES and not (kind == b"\0" and name.endswith("/")):  # old-style directories
                yield name, data
            pending, last = {}, name
        block = _read_exact(stream, _BLOCK)


def _header(block: bytes, pending: dict[str, str]) -> tuple[bytes, str, int]:
    """(type flag, member name, data size) of one header block, with PAX/GNU overrides applied."""
    stored = _number(block[148:156])
    unsigned = sum(block) - sum(block[148:156]) + 8 * 32  # the checksum field counts as spaces
    signed = unsigned - 256 * sum(b > 127 for b in block[:148] + block[156:]) if stored != unsigned else unsigned
    if stored not in (unsigned, signed):  # old writers summed signed bytes
        raise ValueError("bad checksum (not a tar file, or a corrupt one)")
    size = int(pending["size"]) if "size" in pending else _number(block[124:136])
    name = pending.get("path")
    if name is None:
        name = block[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        prefix = block[345:500].split(b"\0", 1)[0] if block[257:263] == b"ustar\x00" else b""
        if prefix:
            name = prefix.decode("utf-8", "surrogateescape") + "/" + name
    return block[156:157], name, size


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
