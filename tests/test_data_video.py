"""Video decoding: frame sampling rules, decord and PyAV on real MP4/WebM bytes, fallback after a
failure or a hang, frame downscaling, the pixel limit, and videos inside samples and shards."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from _data_media import encode_video, gray_frames, image_bytes, js, write_tar

from mmrl.data import video as video_mod
from mmrl.data.decode import DecodeOptions, decode_sample
from mmrl.data.quarantine import BadSampleError
from mmrl.data.stream import ShardStream
from mmrl.data.video import VideoDecodeError, decode_video, sample_frame_indices

N_FRAMES, FPS = 20, 10  # a 2 s clip; frame i is gray level 16 + 8 i


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    frames = gray_frames(N_FRAMES)
    return {"webm": encode_video(frames, FPS, fmt="webm"), "mp4": encode_video(frames, FPS),
            "big": encode_video(gray_frames(6, width=128, height=96), FPS)}


def source_index(frames: np.ndarray) -> list[int]:
    """Which source frame each decoded frame is, from its gray level."""
    return [int(round((m - 16) / 8)) for m in frames.reshape(len(frames), -1).mean(axis=1)]


@pytest.mark.parametrize("total, src_fps, kw, expected", [
    (20, 10, dict(fps=2.0), [0, 6, 13, 19]),                # 2 s x 2 fps = 4
    (20, 10, dict(fps=3.0), [0, 4, 8, 11, 15, 19]),         # 6
    (20, 10, dict(fps=2.5), [0, 4, 8, 11, 15, 19]),         # 5 -> rounded UP to 6 (even T)
    (100, 10, dict(fps=2.0, max_frames=9), list(np.linspace(0, 99, 8).round().astype(int))),  # cap 9 -> 8
    (20, 10, dict(fps=0.5, min_frames=4), [0, 6, 13, 19]),  # 1 frame wanted, min_frames wins
    (3, 10, dict(fps=2.0, min_frames=4), [0, 1, 2, 2]),     # too short: last frame repeated
    (1, 10, dict(fps=2.0, min_frames=1), [0, 0]),           # a one-frame video still gives a pair
    (20, 10, dict(num_frames=3, min_frames=1), [0, 6, 13, 19]),  # 3 -> 4 (even)
    (40, 10, dict(fps=10.0, max_frames=64), list(range(40))),  # never more than the source has
])
def test_sample_frame_indices(total, src_fps, kw, expected):
    indices, fps = sample_frame_indices(total, src_fps, DecodeOptions(**kw))
    assert indices == [int(i) for i in expected]
    assert len(indices) % 2 == 0
    assert fps == pytest.approx(len(indices) / (total / src_fps))  # len(frames) / fps = duration


def test_sample_frame_indices_without_frame_rate():
    with pytest.raises(VideoDecodeError, match="num_frames"):
        sample_frame_indices(10, 0.0, DecodeOptions())
    assert sample_frame_indices(10, 0.0, DecodeOptions(num_frames=4))[0] == [0, 3, 6, 9]


def test_decode_options_validate():
    with pytest.raises(ValueError, match="min_frames") as e:
        DecodeOptions(min_frames=8, max_frames=4, decoders=("ffmpeg-cli",))
    assert "decoders" in str(e.value)  # every problem at once
    assert DecodeOptions(decoders=["pyav"]).decoders == ("pyav",)


@pytest.mark.parametrize("fmt", ["mp4", "webm"])
@pytest.mark.parametrize("decoder", ["decord", "pyav"])
def test_decoders_sample_the_right_frames(clips, fmt, decoder):
    video = decode_video(clips[fmt], DecodeOptions(fps=3.0, decoders=(decoder,)))
    assert video.backend == decoder
    assert video.frames.dtype == np.uint8 and video.frames.shape == (6, 24, 32, 3)
    assert video.frame_indices == [0, 4, 8, 11, 15, 19]
    assert source_index(video.frames) == video.frame_indices
    assert video.source_fps == pytest.approx(FPS) and video.total_num_frames == N_FRAMES
    assert video.fps == pytest.approx(3.0) and video.duration == pytest.approx(2.0)
    meta = video.vllm_metadata()
    assert meta["total_num_frames"] == 6 and meta["duration"] == pytest.approx(2.0)


@pytest.mark.parametrize("decoder", ["decord", "pyav"])
def test_frames_downscaled_to_max_pixels(clips, decoder):
    video = decode_video(clips["big"], DecodeOptions(num_frames=2, max_pixels=64 * 48, decoders=(decoder,)))
    assert video.frames.shape == (2, 48, 64, 3)  # 128x96 -> aspect kept, even sides
    native = decode_video(clips["big"], DecodeOptions(num_frames=2, max_pixels=None, decoders=(decoder,)))
    assert native.frames.shape == (2, 96, 128, 3)


def test_fallback_after_failure_and_after_hang(clips, monkeypatch):
    calls = []
    release = threading.Event()  # the "hung" decoder stays hung until the test ends: no clock races

    def broken(data, options, resize):
        calls.append("broken")
        raise RuntimeError("cannot")

    def hangs(data, options, resize):
        calls.append("hangs")
        release.wait(600)  # a decoder stuck in native code; the thread is abandoned, not joined
        raise AssertionError("unreachable for the caller")

    monkeypatch.setitem(video_mod.VIDEO_BACKENDS, "broken", broken)
    monkeypatch.setitem(video_mod.VIDEO_BACKENDS, "hangs", hangs)
    monkeypatch.setattr(video_mod, "_hung", {})
    try:
        # 3 s: room for pyav's real decode on a busy machine; only "hangs" is meant to run out of time
        options = DecodeOptions(fps=2.0, decoders=("broken", "hangs", "pyav"), timeout_s=3.0)
        t0 = time.perf_counter()
        video = decode_video(clips["mp4"], options)
        assert time.perf_counter() - t0 >= 3.0  # it waited out the timeout (a lower bound: load-proof)
        assert video.backend == "pyav" and source_index(video.frames) == [0, 6, 13, 19]
        assert calls == ["broken", "hangs"]
        assert set(video_mod._hung) == {"hangs"}  # skipped while its abandoned call still runs
        assert decode_video(clips["mp4"], options).backend == "pyav"
        assert calls == ["broken", "hangs", "broken"]  # no second wait on the hung decoder

        # every decoder out of time -> video_timeout; every decoder failing -> corrupt_video
        monkeypatch.setattr(video_mod, "_hung", {})
        raw = {"__key__": "v", "json": js(prompt="what moves?"), "mp4": clips["mp4"]}
        with pytest.raises(BadSampleError) as e:
            decode_sample(raw, DecodeOptions(decoders=("hangs",), timeout_s=0.5))
        assert e.value.reason == "video_timeout"
        with pytest.raises(BadSampleError) as e:
            decode_sample(raw, DecodeOptions(decoders=("broken",)))
        assert e.value.reason == "corrupt_video" and "broken: RuntimeError: cannot" in e.value.detail
    finally:
        release.set()


@pytest.mark.parametrize("data, reason", [
    (b"\x00\x00\x00\x18ftypmp42 this is not a video at all", "corrupt_video"),
    ("truncated", "corrupt_video"),
    ("big", "too_many_pixels"),
])
def test_bad_videos_have_reasons(clips, data, reason):
    data = clips["mp4"][: len(clips["mp4"]) // 2] if data == "truncated" else clips.get(data, data)
    raw = {"__key__": "v", "__url__": "s.tar", "json": js(prompt="what moves?"), "mp4": data}
    with pytest.raises(BadSampleError) as e:
        decode_sample(raw, DecodeOptions(pixel_limit=100 * 80))
    assert e.value.reason == reason and e.value.key == "v"


def test_video_samples_in_a_shard_with_workers(clips, tmp_path):
    """Videos decode in the DataLoader workers and arrive as numpy frames; mixed media and inline
    placeholders keep their order."""
    samples = [
        ("vid", {"json": js(prompt="What happens?", answer="it brightens"), "mp4": clips["mp4"]}),
        ("both", {"json": js(prompt="Is <image> the first frame of <video>?", answer="yes"),
                  "jpg": image_bytes(fmt="JPEG"), "webm": clips["webm"]}),
        ("two", {"json": js(messages=[{"role": "user", "content": [
            {"type": "video"}, {"type": "text", "text": "vs"}, {"type": "video"}]}], videos=["1.mp4", "0.webm"]),
            "0.webm": clips["webm"], "1.mp4": clips["mp4"]}),
        ("text", {"json": js(prompt="No media at all.", answer="fine")}),
    ]
    url = write_tar(tmp_path / "video-000000.tar", samples)
    got = {s.key: s for s in ShardStream(url, epochs=1, num_workers=1, decode=DecodeOptions(fps=2.0))}
    assert sorted(got) == ["both", "text", "two", "vid"]
    vid = got["vid"].videos[0]
    assert isinstance(vid.frames, np.ndarray) and vid.frames.shape == (4, 24, 32, 3)
    assert source_index(vid.frames) == vid.frame_indices == [0, 6, 13, 19]
    assert got["both"].messages[0]["content"] == [
        {"type": "text", "text": "Is "}, {"type": "image"}, {"type": "text", "text": " the first frame of "},
        {"type": "video"}, {"type": "text", "text": "?"}]
    assert len(got["both"].images) == 1 and len(got["both"].videos) == 1
    assert [v.backend for v in got["two"].videos] == ["decord", "decord"]
    assert got["two"].videos[0].total_num_frames == N_FRAMES and got["text"].videos == []
