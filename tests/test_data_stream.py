"""Shards -> Sample: real tar shards in tmp_path, real PNG/JPEG decoding, DataLoader workers."""
from __future__ import annotations

import io
import json
import os
import sys
from collections import Counter

import pytest
from PIL import Image

from _data_media import write_tar
from mmrl.plugins.data.recipes.colors import COLOURS, PROMPT, build
from mmrl.data.sample import Sample
from mmrl.data.stream import (BadSampleError, ShardNotFoundError, ShardStream, decode_sample,
                              expand_urls, load_all)

N_TRAIN, N_HELD, SHARD = 120, 12, 30  # 4 train shards


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("colors"))
    info = build(out, train_size=N_TRAIN, heldout_size=N_HELD, shard_size=SHARD, seed=0)
    train = os.path.join(out, info["shards"]["train"])
    held = os.path.join(out, info["shards"]["heldout"])
    return out, train, held


def train_keys() -> set[str]:
    return {f"train-{i:06d}" for i in range(N_TRAIN)}


def png(colour=(200, 30, 30), size=(24, 16), fmt="PNG", **kw) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, fmt, **kw)
    return buf.getvalue()



def js(**kw) -> bytes:
    return json.dumps(kw).encode()


# ---------------------------------------------------------------------------------- expand_urls

def test_expand_urls_forms(ds):
    out, train, _ = ds
    shards = [os.path.join(out, f"train-{i:06d}.tar") for i in range(4)]
    assert expand_urls(train) == shards
    assert expand_urls(f"{shards[0]}::{shards[2]}") == [shards[0], shards[2]]
    assert expand_urls([shards[1], os.path.join(out, "train-{000002..000003}.tar")]) == shards[1:]
    assert expand_urls("pipe:cat " + train) == ["pipe:cat " + s for s in shards]
    assert expand_urls("file:" + shards[0]) == ["file:" + shards[0]]
    assert expand_urls("https://example.org/x-{0..1}.tar") == ["https://example.org/x-0.tar",
                                                                "https://example.org/x-1.tar"]


def test_missing_shards_are_named(ds, tmp_path):
    out, _, _ = ds
    gone = str(tmp_path / "nothing-{000000..000001}.tar")
    with pytest.raises(ShardNotFoundError) as e:
        expand_urls(gone)
    assert isinstance(e.value, FileNotFoundError)
    msg = str(e.value)
    assert str(tmp_path / "nothing-000000.tar") in msg and str(tmp_path / "nothing-000001.tar") in msg
    assert "mmrl data build colors --out DIR" in msg
    # one missing among existing: that path is named, and the stream constructor fails the same way
    missing = str(tmp_path / "train-000009.tar")
    with pytest.raises(ShardNotFoundError, match="1 of 2") as e:
        ShardStream([os.path.join(out, "train-000000.tar"), missing])
    assert e.value.missing == [missing] and missing in str(e.value)
    with pytest.raises(ShardNotFoundError, match="directory"):
        expand_urls(out)


# ------------------------------------------------------------------------------------- stream

@pytest.mark.parametrize("num_workers", [0, 2])
def test_one_epoch_delivers_every_sample_once(ds, num_workers):
    _, train, _ = ds
    stream = ShardStream(train, epochs=1, num_workers=num_workers)
    samples = list(stream)
    keys = Counter(s.key for s in samples)
    assert set(keys) == train_keys() and set(keys.values()) == {1}
    assert not stream.bad_counts and stream.delivered == N_TRAIN
    s = samples[0]
    assert isinstance(s, Sample)
    assert len(s.images) == 1 and s.images[0].mode == "RGB" and s.images[0].size == (56, 56)
    assert s.messages == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    assert s.prompt_text == PROMPT and s.answer in COLOURS
    assert s.metadata["split"] == "train" and s.source.endswith(".tar")


def test_pipe_urls_with_workers(ds):
    _, train, _ = ds
    samples = list(ShardStream("pipe:cat " + train, epochs=1, num_workers=2))
    assert Counter(s.key for s in samples) == Counter(train_keys())
    assert all(s.source.startswith("pipe:cat ") for s in samples)


def test_unshuffled_finite_stream_keeps_order(ds):
    _, train, held = ds
    assert [s.key for s in ShardStream(train, epochs=1)] == sorted(train_keys())
    assert [s.key for s in load_all(held)] == [f"heldout-{i:06d}" for i in range(N_HELD)]


def test_shuffle_changes_order_not_multiset(ds):
    _, train, _ = ds
    a = [s.key for s in ShardStream(train, epochs=1, shuffle_buffer=40, seed=1)]
    b = [s.key for s in ShardStream(train, epochs=1, shuffle_buffer=40, seed=1)]
    c = [s.key for s in ShardStream(train, epochs=1, shuffle_buffer=40, seed=2)]
    assert a != sorted(a) and sorted(a) == sorted(train_keys()) == sorted(c)
    assert a == b  # deterministic for a seed
    assert a != c
    # one worker process gives the same order as decoding in this process
    d = [s.key for s in ShardStream(train, epochs=1, shuffle_buffer=40, seed=1, num_workers=1)]
    assert d == a


def test_epochs_reshuffle_and_forever(ds):
    _, train, _ = ds
    two = [s.key for s in ShardStream(train, epochs=2, shuffle_buffer=10, seed=0)]
    assert Counter(two) == Counter({k: 2 for k in train_keys()})
    assert two[:N_TRAIN] != two[N_TRAIN:]
    with ShardStream(train, shuffle_buffer=10, num_workers=2) as forever:  # epochs=None
        got = forever.take(2 * N_TRAIN + 5)
        got += forever.take(N_TRAIN - 5)  # take() continues where the last call stopped
    assert len(got) == 3 * N_TRAIN
    assert Counter(s.key for s in got) == Counter({k: 3 for k in train_keys()})
    finite = ShardStream(train, epochs=1)
    assert len(finite.take(N_TRAIN - 1)) == N_TRAIN - 1
    assert [s.key for s in finite.take(10)] == [f"train-{N_TRAIN - 1:06d}"]  # then it ends
    assert finite.take(10) == []


def test_split_by_node(ds):
    _, train, _ = ds
    parts = [[s.key for s in ShardStream(train, epochs=1, rank=r, world_size=2, shuffle_buffer=5)]
             for r in (0, 1)]
    assert not set(parts[0]) & set(parts[1])
    assert set(parts[0]) | set(parts[1]) == train_keys()
    assert len(parts[0]) == len(parts[1]) == N_TRAIN // 2
    with pytest.raises(ValueError, match="no shard"):
        ShardStream(train, rank=4, world_size=5)


# ---------------------------------------------------------------------------------- bad samples

@pytest.fixture()
def mixed(tmp_path):
    good = [(f"good{i}", {"json": js(prompt="colour?", answer="red", metadata={"i": i}), "png": png()})
            for i in range(6)]
    bad = [
        ("truncpng", {"json": js(prompt="p"), "png": png()[:40]}),
        ("badjson", {"json": b'{"prompt": "p", ', "png": png()}),
        ("nojson", {"png": png()}),
        ("noprompt", {"json": js(answer="red"), "png": png()}),
        ("garbage", {"json": js(prompt="p"), "jpg": b"definitely not a jpeg"}),
    ]
    # interleave good and bad over two shards
    a = write_tar(tmp_path / "mixed-0.tar", [good[0], bad[0], good[1], bad[1], good[2]])
    b = write_tar(tmp_path / "mixed-1.tar", [bad[2], good[3], bad[3], good[4], bad[4], good[5]])
    return [a, b], {k for k, _ in good}


EXPECTED_BAD = {"corrupt_image": 2, "bad_json": 1, "missing_json": 1, "missing_field": 1}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bad_samples_skipped_and_counted(mixed, num_workers):
    urls, good = mixed
    stream = ShardStream(urls, epochs=1, num_workers=num_workers)
    samples = list(stream)
    assert sorted(s.key for s in samples) == sorted(good)
    assert dict(stream.bad_counts) == EXPECTED_BAD
    assert all(s.answer == "red" and s.metadata["i"] == int(s.key[4:]) for s in samples)
    assert {b.key for b in stream.bad_examples} == {"truncpng", "badjson", "nojson", "noprompt", "garbage"}


def test_truncated_shard_is_not_fatal(ds, tmp_path):
    out, _, _ = ds
    src = os.path.join(out, "train-000000.tar")
    broken = tmp_path / "broken.tar"
    with open(src, "rb") as f:
        broken.write_bytes(f.read()[:50_000])  # cut inside the 5th sample
    other = os.path.join(out, "train-000001.tar")
    stream = ShardStream([str(broken), other, "pipe:cat " + str(tmp_path / "gone.tar")], epochs=1)
    keys = [s.key for s in stream]
    assert keys[-SHARD:] == [f"train-{i:06d}" for i in range(SHARD, 2 * SHARD)]
    assert 0 < len(keys) - SHARD < SHARD  # the complete samples before the cut
    assert stream.bad_counts["shard_read_error"] == 2  # the cut shard, the failing pipe
    assert stream.bad_counts["truncated_sample"] == 1  # the one being read at the cut


def test_all_bad_epoch_raises_instead_of_spinning(tmp_path):
    url = write_tar(tmp_path / "bad.tar", [("x", {"png": png()})])
    with pytest.raises(RuntimeError, match="no usable sample"):
        ShardStream(url).take(1)  # epochs=None would otherwise loop forever


# -------------------------------------------------------------------------------- decode_sample

def test_decode_multi_image_messages_and_exif():
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90
    raw = {
        "__key__": "k", "__url__": "u.tar",
        "json": js(messages=[{"role": "system", "content": "sys"},
                             {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"},
                                                          {"type": "image"}, {"type": "image"}]}],
                   answer=[1, 2], metadata={"m": 1}),
        "10.png": png((0, 0, 200)), "2.jpg": png((0, 200, 0), size=(40, 20), fmt="JPEG", exif=exif),
        "0.png": png((200, 0, 0)), "txt": b"ignored",
    }
    s = decode_sample(raw)
    assert s.key == "k" and s.source == "u.tar" and s.answer == [1, 2] and s.metadata == {"m": 1}
    assert [im.getpixel((0, 0))[:3].index(max(im.getpixel((0, 0)))) for im in s.images] == [0, 1, 2]
    assert s.images[1].size == (20, 40)  # EXIF-transposed
    assert s.prompt_text == "a"
    # prompt form with several images: as many placeholders as images
    s2 = decode_sample({"__key__": "p", "json": js(prompt="two?"), "0.png": png(), "1.webp": png(fmt="WEBP")})
    assert s2.messages[0]["content"] == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "two?"}]
    assert all(im.mode == "RGB" for im in s2.images)
    # text-only prompt is fine
    assert decode_sample({"__key__": "t", "json": js(prompt="hi")}).images == []


@pytest.mark.parametrize("raw, reason", [
    ({"json": js(messages=[{"role": "user", "content": [{"type": "image"}]}])}, "media_count_mismatch"),
    ({"json": b"[1, 2]", "png": png()}, "bad_json"),
    ({"json": b"\xff\xfe", "png": png()}, "bad_json"),
    ({"json": js(prompt="  "), "png": png()}, "missing_field"),
    ({"json": js(prompt="p", metadata=[1]), "png": png()}, "bad_field"),
    ({"json": js(prompt="p"), "mp4": b"\x00"}, "corrupt_video"),
])
def test_decode_rejects_with_reason(raw, reason):
    with pytest.raises(BadSampleError) as e:
        decode_sample({"__key__": "bad1", "__url__": "s.tar", **raw})
    assert e.value.reason == reason and isinstance(e.value, ValueError)
    assert "bad1" in str(e.value) and reason in str(e.value)


def test_decode_image_modes_and_pixel_limit():
    import numpy as np

    from mmrl.data.decode import decode_image
    def encoded(im: Image.Image) -> bytes:
        buf = io.BytesIO()
        im.save(buf, "PNG")
        return buf.getvalue()

    transparent_red = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # shows as white, not red or black
    assert decode_image(encoded(transparent_red)).getpixel((0, 0)) == (255, 255, 255)
    deep = Image.fromarray(np.full((4, 4), 0x8000, np.uint16))  # 16-bit gray: scaled, not clipped
    assert decode_image(encoded(deep)).getpixel((0, 0)) == (128, 128, 128)
    assert decode_image(png(size=(100, 100)), pixel_limit=10_000).size == (100, 100)
    with pytest.raises(BadSampleError) as e:
        decode_image(png(size=(101, 100)), pixel_limit=10_000)
    assert e.value.reason == "too_many_pixels" and "10100" in e.value.detail
    # the pixel limit travels with DecodeOptions into decode_sample
    from mmrl.data.decode import DecodeOptions
    with pytest.raises(BadSampleError, match="too_many_pixels"):
        decode_sample({"__key__": "b", "json": js(prompt="p"), "png": png(size=(50, 50))},
                      DecodeOptions(pixel_limit=2_000))


def test_a_live_video_decoder_moves_workers_to_a_forkserver_that_preloads_torch(monkeypatch):
    """With decord/FFmpeg live, workers start from a forkserver (a fork would inherit the decoder's
    threads); the server imports torch once, so each epoch's workers do not import it again."""
    import multiprocessing.forkserver as forkserver

    import av  # noqa: F401  (a native video decoder is now live in this process)

    from mmrl.data.stream import FORKSERVER_PRELOAD, worker_start_method
    assert worker_start_method("spawn") == "spawn"  # an explicit choice wins
    monkeypatch.setattr(forkserver._forkserver, "_preload_modules", ["__main__"])
    assert worker_start_method() == "forkserver"
    assert forkserver._forkserver._preload_modules == list(FORKSERVER_PRELOAD)
    for name in ("decord", "av", "torchcodec"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert worker_start_method(default="fork") == "fork"
