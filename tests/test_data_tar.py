"""mmrl's tar header parser (mmrl.data.shards.tar_members) against Python's tarfile: ustar, GNU and
PAX archives (long and non-ASCII names, empty members, directories), compressed shards, and broken
files, which must raise rather than end early."""
from __future__ import annotations

import bz2
import gzip
import io
import tarfile

import pytest

from mmrl.plugins.data.recipes._common import ShardSink
from mmrl.data.shards import tar_members

MEMBERS = [("a.json", b"{}"), ("d" * 120 + "/k.0.jpg", b"x" * 1000), ("ünï.txt", b"hi"), ("empty.bin", b""),
           ("big.bin", bytes(range(256)) * 40)]


def _archive(fmt: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, payload in MEMBERS:
            if fmt == tarfile.USTAR_FORMAT and not name.isascii():
                continue
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(payload), (1.5 if fmt == tarfile.PAX_FORMAT else 7)
            tar.addfile(info, io.BytesIO(payload))
        folder = tarfile.TarInfo("folder/")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        link = tarfile.TarInfo("link.txt")
        link.type, link.linkname = tarfile.SYMTYPE, "a.json"
        tar.addfile(link)
    return buf.getvalue()


def _reference(data: bytes) -> list[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|*") as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_same_members_as_tarfile(fmt: int) -> None:
    data = _archive(fmt)
    got = list(tar_members(io.BytesIO(data)))
    assert got == _reference(data)
    assert ("d" * 120 + "/k.0.jpg", b"x" * 1000) in got and ("empty.bin", b"") in got


@pytest.mark.parametrize("compress", [gzip.compress, bz2.compress])
def test_compressed_shards_go_through_tarfile(compress) -> None:
    data = _archive(tarfile.PAX_FORMAT)
    assert list(tar_members(io.BytesIO(compress(data)))) == _reference(data)


def test_shards_written_by_mmrl_have_no_pax_records(tmp_path) -> None:
    """An int mtime keeps webdataset's TarWriter from adding a PAX record to every member."""
    with ShardSink(str(tmp_path / "s-%06d.tar")) as sink:
        sink.write({"__key__": "k0", "json": b"{}", "png": b"\x89PNG"})
    with tarfile.open(tmp_path / "s-000000.tar") as tar:
        assert [(m.name, m.pax_headers) for m in tar] == [("k0.json", {}), ("k0.png", {})]
    assert list(tar_members(open(tmp_path / "s-000000.tar", "rb"))) == [("k0.json", b"{}"), ("k0.png", b"\x89PNG")]


@pytest.mark.parametrize("cut, message", [(None, "invalid tar header"), (5000, "truncated"), (1636, "truncated"),
                                          (0, "empty file")])
def test_broken_files_raise(cut, message) -> None:
    data = _archive(tarfile.GNU_FORMAT)
    broken = b"garbage!" * 100 if cut is None else data[:cut]
    with pytest.raises(tarfile.ReadError, match=message):
        list(tar_members(io.BytesIO(broken)))
