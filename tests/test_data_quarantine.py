"""Quarantine: a generated corpus of good samples and >= 50 bad ones of >= 10 kinds (real JPEG,
PNG and MP4 bytes). Nothing crashes, every bad sample is reported once with the right reason,
every good sample is delivered exactly once, and a mostly-bad corpus stops with a clear error."""
from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from _data_media import (ACCEPTED_ODD_IMAGE_SIZES, REFUSED_IMAGE_SIZES, bomb_png, encode_video, gray_frames,
                         image_bytes, js, write_tar)

from mmrl.data.decode import DecodeOptions
from mmrl.data.quarantine import REASONS
from mmrl.data.stream import ShardStream, TooManyBadSamples
from mmrl.plugins.processors.qwen_vl import qwen_media_limits

PER_KIND = 5
# with the limits a Qwen2.5-VL run puts into its stream (checked in the workers)
DECODE = DecodeOptions(fps=2.0, max_frames=8, decoders=("decord", "pyav"), media_limits=qwen_media_limits("qwen2_5_vl"))


def _bad_kinds(mp4: bytes, jpg: bytes, png: bytes) -> dict[str, list[tuple[str, list[tuple[str, bytes]]]]]:
    """reason -> member lists (as (suffix, bytes) pairs, so a duplicate member is expressible)."""
    prompt = js(prompt="What is shown?", answer="x")
    two_images = js(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                           {"type": "text", "text": "same?"}]}])
    return {
        "corrupt_image": [("truncated jpeg", [("json", prompt), ("jpg", jpg[: len(jpg) // 2])]),
                          ("garbage png", [("json", prompt), ("png", b"\x89PNG\r\n\x1a\n" + b"\x07" * 300)])],
        "corrupt_video": [("garbage mp4", [("json", prompt), ("mp4", b"\x00\x00\x00\x18ftypisom" + b"\xab" * 500)]),
                          ("truncated mp4", [("json", prompt), ("mp4", mp4[: len(mp4) // 3])])],
        "bad_json": [("invalid", [("json", b'{"prompt": "x",'), ("jpg", jpg)]),
                     ("not an object", [("json", b'["prompt"]'), ("jpg", jpg)])],
        "missing_json": [("no json", [("jpg", jpg), ("txt", b"caption")])],
        "missing_field": [("no prompt", [("json", js(answer="red")), ("jpg", jpg)])],
        "bad_field": [("metadata list", [("json", js(prompt="p", metadata=[1])), ("jpg", jpg)]),
                      ("images not a list", [("json", js(prompt="p", images="0.jpg")), ("0.jpg", jpg)])],
        "empty_member": [("zero-byte jpg", [("json", prompt), ("jpg", b"")]),
                         ("zero-byte json", [("json", b""), ("png", png)])],
        "too_many_pixels": [("bomb png", [("json", prompt), ("png", bomb_png(9000, 8000))])],
        "unsupported_media": [("gif", [("json", prompt), ("gif", b"GIF89a" + b"\x00" * 30)]),
                              ("audio", [("json", prompt), ("jpg", jpg), ("wav", b"RIFF....WAVE")])],
        "missing_media": [("named but absent", [("json", js(prompt="p", images=["0.jpg", "1.jpg"])),
                                                ("0.jpg", jpg)])],
        "media_count_mismatch": [("two placeholders one image", [("json", two_images), ("jpg", jpg)]),
                                 ("video placeholder, no video", [("json", js(prompt="see <video>")),
                                                                 ("jpg", jpg)])],
        "duplicate_member": [("json twice", [("json", prompt), ("jpg", jpg), ("json", prompt)])],
        "processor_limit": [(f"{w}x{h} image", [("json", prompt), ("png", image_bytes(size=(w, h)))])
                            for w, h in REFUSED_IMAGE_SIZES]
        + [("202:1 video", [("json", prompt), ("mp4", encode_video(gray_frames(8, 404, 2), fps=4))])],
    }


def _good(i: int, mp4: bytes, jpg: bytes, png: bytes) -> list[tuple[str, bytes]]:
    kind = i % 6
    if kind == 0:
        return [("json", js(prompt=f"good {i}", answer=str(i))), ("jpg", jpg)]
    if kind == 1:
        return [("json", js(prompt=f"good {i}", answer=str(i), images=["1.png", "0.jpg"])),
                ("0.jpg", jpg), ("1.png", png)]
    if kind == 2:
        return [("json", js(prompt=f"what moves {i}?", answer=str(i))), ("mp4", mp4)]
    if kind == 3:
        return [("json", js(prompt=f"text only {i}", answer=str(i)))]
    if kind == 5:  # odd sizes the processor still accepts
        size = ACCEPTED_ODD_IMAGE_SIZES[(i // 6) % len(ACCEPTED_ODD_IMAGE_SIZES)]
        return [("json", js(prompt=f"odd {i}", answer=str(i))), ("png", image_bytes(size=size))]
    return [("json", js(messages=[{"role": "user", "content": [
        {"type": "image"}, {"type": "video"}, {"type": "text", "text": f"good {i}"}]}], answer=str(i))),
        ("png", png), ("mp4", mp4)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """6 shards; returns (urls, good keys, {bad key: reason})."""
    out = tmp_path_factory.mktemp("quarantine")
    mp4 = encode_video(gray_frames(8), fps=4)
    jpg, png = image_bytes(fmt="JPEG", size=(32, 24)), image_bytes((10, 200, 10), size=(20, 20))
    samples, expected_bad = [], {}
    for reason, variants in _bad_kinds(mp4, jpg, png).items():
        for n in range(max(PER_KIND, len(variants))):
            label, members = variants[n % len(variants)]
            key = f"bad-{reason}-{n}"
            samples.append((key, members))
            expected_bad[key] = reason
    good = [f"good-{i:03d}" for i in range(60)]
    samples += [(key, _good(i, mp4, jpg, png)) for i, key in enumerate(good)]
    random.Random(0).shuffle(samples)
    urls = [write_tar(out / f"mixed-{s:06d}.tar", samples[s::6]) for s in range(6)]
    return urls, set(good), expected_bad


def test_corpus_is_big_and_varied(corpus):
    _, good, bad = corpus
    assert len(bad) >= 50 and len(set(bad.values())) >= 10 and set(bad.values()) <= set(REASONS)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bad_samples_quarantined_good_ones_delivered_once(corpus, tmp_path, num_workers):
    urls, good, expected_bad = corpus
    report = tmp_path / "q" / "quarantine-{rank}.jsonl"
    stream = ShardStream(urls, epochs=1, shuffle_buffer=16, num_workers=num_workers, decode=DECODE,
                         quarantine_path=report, max_bad_ratio=None)
    samples = list(stream)
    assert Counter(s.key for s in samples) == Counter({k: 1 for k in good})
    assert dict(stream.bad_counts) == dict(Counter(expected_bad.values()))
    records = [json.loads(line) for line in (tmp_path / "q" / "quarantine-0.jsonl").read_text().splitlines()]
    assert {r["key"]: r["reason"] for r in records} == expected_bad and len(records) == len(expected_bad)
    assert all(r["url"] in urls and r["detail"] and r["epoch"] == 0 for r in records)
    # the good ones are whole: media matched to placeholders, in the JSON's order
    by_key = {s.key: s for s in samples}
    two = by_key["good-001"]
    assert [im.size for im in two.images] == [(20, 20), (32, 24)]  # images=["1.png", "0.jpg"]
    mixed = by_key["good-004"]
    assert len(mixed.images) == 1 and mixed.videos[0].frames.shape == (4, 24, 32, 3)
    assert by_key["good-003"].images == [] and by_key["good-003"].prompt_text == "text only 3"
    assert {s.images[0].size for k, s in by_key.items() if int(k[5:]) % 6 == 5} == set(ACCEPTED_ODD_IMAGE_SIZES)
    limit_details = [r["detail"] for r in records if r["reason"] == "processor_limit"]
    assert all("aspect ratio" in d and "qwen_vl processor" in d for d in limit_details), limit_details


def test_too_many_bad_samples_stops_with_a_clear_error(corpus, tmp_path):
    urls, good, expected_bad = corpus
    report = tmp_path / "quarantine.jsonl"
    stream = ShardStream(urls, epochs=1, decode=DECODE, quarantine_path=report, max_bad_ratio=0.05,
                         min_samples_for_ratio=20)
    got = []
    with pytest.raises(TooManyBadSamples) as e:
        for s in stream:
            got.append(s)
    err = e.value
    msg = str(err)
    assert err.seen >= 20 and err.ratio > 0.05 and err.bad == sum(stream.bad_counts.values())
    assert "max_bad_ratio 5.0%" in msg and str(report) in msg
    top = Counter(stream.bad_counts).most_common(1)[0][0]
    assert top in msg and len(report.read_text().splitlines()) == err.bad
    # below min_samples_for_ratio the check is off: the whole corpus is read
    lenient = ShardStream(urls, epochs=1, decode=DECODE, max_bad_ratio=0.05, min_samples_for_ratio=10_000)
    assert len(list(lenient)) == len(good)
