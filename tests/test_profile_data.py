"""`mmrl profile-data`: stage timings from the real loader, processor and pickle; the bottleneck
and advice on data sets built to have a known bottleneck (and the advice, applied, must pay off);
report.json against its schema, the Chrome trace, the chart; the instrumentation itself."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from _data_media import encode_video, js, write_tar
from mmrl.cli import main
from mmrl.config import load_config
from mmrl.data.decode import DecodeOptions
from mmrl.data.stream import ShardStream
from mmrl.profiling import advice as adv
from mmrl.profiling.data_profile import profile_data
from mmrl.profiling.output import load_schema, validate_report
from mmrl.profiling.pipeline import build_config_processor, run_pipeline
from mmrl.utils.trace import load_trace

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "configs" / "colors_demo.yaml")
STAGES = ["shard_open", "shard_read", "tar_parse", "sample_parse", "image_decode", "video_decode",
          "handoff_latency", "handoff_wait", "processor", "serialise"]


def _base(model: Path, shards: str) -> list[str]:
    return [f"model.path={model}", f"data.train_shards={shards}", "data.heldout_shards=null"]


def _best_rates(cfg_overrides: list[list[str]], workers: int, samples: int, rounds: int = 3) -> list[float]:
    """Best-of-`rounds` samples/s per override set, the sets measured interleaved (A B A B) so
    load from other processes on the machine hits all of them alike."""
    setups = []
    for overrides in cfg_overrides:
        cfg = load_config(DEMO, overrides)
        setups.append((cfg, build_config_processor(cfg)))
    best = [0.0] * len(setups)
    for _ in range(rounds):
        for i, (cfg, processor) in enumerate(setups):
            best[i] = max(best[i], run_pipeline(cfg, processor, workers, samples).samples_per_s)
    return best


# ------------------------------------------------------------------------------------ data sets

def _scrolling_texture(n: int, width: int, height: int, seed: int) -> np.ndarray:
    """A textured frame scrolling sideways: every frame differs, so it decodes like real video."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = ((xx[..., None] * [3, 1, 2] + yy[..., None] * [1, 2, 3]) % 256).astype(np.uint8)
    noise = rng.integers(0, 24, (height, width + n, 3), dtype=np.uint8)
    return np.stack([base + noise[:, i:i + width] for i in range(n)])


@pytest.fixture(scope="module")
def video_shards(tmp_path_factory) -> str:
    """Long clips (16 s, 320 frames, a keyframe every 4) decoded at many frames per second:
    decoding dominates, and the decoded frames are small, so the processor is cheap."""
    out = tmp_path_factory.mktemp("videos")
    samples = [(f"v{k:03d}", {"json": js(prompt="Which way does the texture move?", answer="left", videos=["mp4"]),
                              "mp4": encode_video(_scrolling_texture(320, 160, 120, k), fps=20)}) for k in range(14)]
    return write_tar(out / "train-000000.tar", samples)


@pytest.fixture(scope="module")
def image_shards(tmp_path_factory) -> str:
    """Big JPEGs (2048²) and a processor budget of 4 MP (Qwen2.5-VL's own default is 12.8 MP): the
    processor, and pickling its output, dominate."""
    from mmrl.data.recipes.colors import build

    out = tmp_path_factory.mktemp("bigimages")
    info = build(str(out), train_size=16, heldout_size=2, image_size=2048, shard_size=16, image_format="jpg")
    return str(out / info["shards"]["train"])


VIDEO_OPTS = ["data.num_workers=0", "data.shuffle_buffer=0", "data.decode.fps=4", "data.decode.max_frames=64",
              "data.decode.max_pixels=3136", "processor.max_prompt_tokens=8192"]
# 0 workers (one process, no prefetching) keeps the before/after throughput comparable on a busy
# machine; test_cli_outputs_schema_trace_chart covers worker processes.
IMAGE_OPTS = ["data.num_workers=0", "data.shuffle_buffer=0", "processor.max_pixels=4194304",
              "processor.max_prompt_tokens=8192"]


# ------------------------------------------------------------------------------- the acceptance

@pytest.mark.slow
def test_video_decode_bottleneck_and_fps_advice_pays_off(video_shards, tiny_model_dir, tmp_path):
    overrides = _base(tiny_model_dir, video_shards) + VIDEO_OPTS
    report = profile_data(DEMO, overrides, samples=10, workers=[0], out_dir=tmp_path / "p", probe_samples=4,
                          bound=False)
    assert report["bottleneck"]["stage"] == "video_decode", report["bottleneck"]
    stages = {s["name"]: s for s in report["stages"]}
    assert stages["video_decode"]["count"] == 10 and stages["video_decode"]["share"] > 0.5
    assert report["decoders"][0]["backend"] == "decord" and report["decoders"][0]["frames"] == 10 * 64
    fps = next(a for a in report["advice"] if a["key"] == "data.decode.fps")
    assert (fps["stage"], fps["current"], fps["proposed"]) == ("video_decode", 4.0, 2.0)
    assert "64→32" in fps["text"] and fps["predicted_speedup"] >= 1.3, fps
    before, after = _best_rates([overrides, overrides + [f"{fps['key']}={fps['proposed']}"]], 0, 8)
    print(f"fps {fps['current']}→{fps['proposed']}: predicted {fps['predicted_speedup']:.2f}×, "
          f"measured {before:.2f}→{after:.2f} samples/s = {after / before:.2f}×")
    assert after >= 1.3 * before, (before, after, fps)


@pytest.mark.slow
def test_image_processing_bottleneck_and_max_pixels_advice_pays_off(image_shards, tiny_model_dir, tmp_path):
    overrides = _base(tiny_model_dir, image_shards) + IMAGE_OPTS
    report = profile_data(DEMO, overrides, samples=10, workers=[0], out_dir=tmp_path / "p", probe_samples=4,
                          bound=False)
    assert report["bottleneck"]["stage"] == "processor", report["bottleneck"]
    assert report["bottleneck"]["limited_by"] == "serial"
    pix = next(a for a in report["advice"] if a["key"] == "processor.max_pixels")
    assert pix["stage"] == "processor" and pix["current"] == 4194304
    assert pix["proposed"] <= 4194304 // 4 and pix["proposed"] % (28 * 28) == 0
    assert pix["predicted_speedup"] >= 1.3, pix
    # the hint that no config key fixes: images are decoded far above what the processor keeps
    hint = [a for a in report["advice"] if a["rule"] == "image_size_hint"]
    assert not hint or hint[0]["key"] is None
    before, after = _best_rates([overrides, overrides + [f"{pix['key']}={pix['proposed']}"]], 0, 8)
    print(f"max_pixels {pix['current']}→{pix['proposed']}: predicted {pix['predicted_speedup']:.2f}×, "
          f"measured {before:.2f}→{after:.2f} samples/s = {after / before:.2f}×")
    assert after >= 1.3 * before, (before, after, pix)


# ----------------------------------------------------------------------- outputs, via the CLI

def test_cli_outputs_schema_trace_chart(colors_dir, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "prof"
    shards = str(colors_dir / "train-{000000..000001}.tar")
    rc = main(["profile-data", DEMO, *_base(tiny_model_dir, shards), "--samples", "40", "--workers", "1,2",
               "--out", str(out), "data.num_workers=2"])  # an override after the options works too
    assert rc == 0
    printed = capsys.readouterr().out
    assert "bottleneck:" in printed and "worker sweep" in printed and "decode-only bound" in printed

    report = json.loads((out / "report.json").read_text())
    validate_report(report)
    assert report["workers"] == 2 and report["config"]["overrides"][-1] == "data.num_workers=2"
    assert [s["name"] for s in report["stages"]] == STAGES
    stages = {s["name"]: s for s in report["stages"]}
    assert stages["image_decode"]["count"] == stages["processor"]["count"] == 40
    assert stages["shard_read"]["bytes"] > 40 * 1000 and stages["serialise"]["bytes"] > 0
    assert abs(sum(s["share"] for s in report["stages"] if s["work"]) - 1.0) < 1e-9
    assert all(s["share"] is None for s in report["stages"] if not s["work"])
    assert [p["workers"] for p in report["scaling"]["points"]] == [1, 2]
    assert report["scaling"]["baseline_workers"] == 1 and report["scaling"]["points"][0]["efficiency"] == 1.0
    assert report["decode_bound"]["samples_per_s"] > 0 and 0 < report["decode_bound"]["pipeline_efficiency"]
    e2e = report["end_to_end"]
    assert e2e["samples_per_s"] == min(e2e["consumer_samples_per_s"], e2e["loader_samples_per_s"])
    if report["bottleneck"]["limited_by"] != "cpu":  # otherwise the slower side names the bound
        loader_slower = e2e["loader_samples_per_s"] < e2e["consumer_samples_per_s"]
        assert report["bottleneck"]["limited_by"] == ("loader" if loader_slower else "consumer")

    events = load_trace(out / "trace.json")
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"worker 0", "worker 1", "main"} <= tracks
    spans = [e for e in events if e["ph"] == "X"]
    assert sum(e["name"] == "processor" for e in spans) == 40 and sum(e["name"] == "read" for e in spans) == 40
    assert min(e["ts"] for e in spans) == 0.0
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Stages" in (out / "report.md").read_text()


def test_schema_rejects_a_malformed_report(colors_dir, tiny_model_dir, tmp_path):
    import jsonschema

    report = profile_data(DEMO, _base(tiny_model_dir, str(colors_dir / "train-000000.tar")) + ["data.num_workers=0"],
                          samples=8, workers=[0], out_dir=tmp_path, bound=False)
    validate_report(report)
    assert load_schema()["properties"]["schema_version"] == {"const": 1}
    for broken in ({**report, "stages": report["stages"][:3]}, {**report, "extra": 1},
                   {**report, "bottleneck": {**report["bottleneck"], "limited_by": "unknown"}}):
        with pytest.raises(jsonschema.ValidationError):
            validate_report(broken)


# ---------------------------------------------------------------------------- instrumentation

def test_stream_profile_records_are_complete_and_change_nothing(colors_dir):
    shard = str(colors_dir / "train-000000.tar")
    plain = ShardStream(shard, epochs=1, num_workers=0, max_bad_ratio=None)
    timed = ShardStream(shard, epochs=1, num_workers=0, max_bad_ratio=None, profile=True)
    keys = [s.key for s in plain]
    assert plain.profile_records == []
    assert [s.key for s in timed] == keys
    records = timed.profile_records
    assert [r["key"] for r in records] == keys
    assert sum("open_s" in r for r in records) == 1  # one shard opened
    # every byte of the tar is counted once, by the sample whose members it carried
    size = os.path.getsize(shard)
    assert 0.95 * size <= sum(r["bytes"] for r in records) <= size
    for r in records:
        assert r["io_s"] <= r["read_s"] and len(r["images"]) == 1 and r["images"][0]["pixels"] == 56 * 56
        assert r["decode_start"] >= r["read_start"] and r["delivered"] >= r["decode_start"] + r["decode_s"]


def test_worker_records_carry_worker_ids_and_send_times(colors_dir):
    stream = ShardStream(str(colors_dir / "train-{000000..000001}.tar"), epochs=1, num_workers=2,
                         max_bad_ratio=None, profile=True)
    samples = stream.take(40)
    stream.close()
    records = stream.profile_records
    assert [r["key"] for r in records] == [s.key for s in samples]
    assert {r["worker"] for r in records} == {0, 1}
    assert all(r["decode_start"] + r["decode_s"] <= r["sent"] <= r["delivered"] for r in records)


def test_video_records_name_the_decoder_and_frames(video_shards):
    stream = ShardStream(video_shards, epochs=1, num_workers=0, max_bad_ratio=None, profile=True,
                         decode=DecodeOptions(fps=2, max_frames=32))
    sample = stream.take(1)[0]
    stream.close()
    video = stream.profile_records[0]["videos"][0]
    assert video["backend"] == sample.videos[0].backend == "decord"
    assert video["frames"] == 32 and video["total_frames"] == 320 and video["source_fps"] == pytest.approx(20)
    assert video["pixels"] == sample.videos[0].frames.shape[1] * sample.videos[0].frames.shape[2]


# ------------------------------------------------------------------------------- advice maths

def test_cost_model_and_amdahl_fit():
    assert adv.model_time(0.1, 0.05, 0, 2) == pytest.approx(0.15)  # one process: the sum
    assert adv.model_time(0.1, 0.01, 1, 2) == pytest.approx(0.1)  # the worker sets the pace
    assert adv.model_time(0.1, 0.01, 4, 2) == pytest.approx(0.055)  # 2 cores cap 4 workers
    serial = 0.2
    points = [(w, 10 * adv.amdahl_speedup(serial, w)) for w in (1, 2, 4)]
    assert adv.amdahl_serial_fraction(points) == pytest.approx(serial)
    assert adv.amdahl_serial_fraction([(2, 5.0)]) is None  # no 1-worker baseline
    # which side sets the pace: 0 workers is one process; all cores busy; else the slower rate
    assert adv.limited_by(0, 2, 1.0, 1.0, 10.0, None) == "serial"
    assert adv.limited_by(1, 2, 1.9, 1.0, 10.0, 12.0) == "cpu"
    assert adv.limited_by(1, 2, 1.0, 1.0, 10.0, 6.0) == "loader"
    assert adv.limited_by(1, 2, 1.0, 1.0, 10.0, 30.0) == "consumer"


def _context(limit: str, workers: int, sweep: list[tuple[int, float]]) -> adv.Context:
    """Stage rows as the profiler writes them: 8 ms per sample in the workers, 2 ms in the consumer."""
    rows = {"video_decode": ("worker", 0.8), "processor": ("consumer", 0.2)}
    stages = {n: {"name": n, "side": side, "work": True, "count": 100, "total_s": t, "share": t}
              for n, (side, t) in rows.items()}
    return adv.Context(stages, 100, workers, 2, limit, sweep)


def test_worker_advice_follows_the_measured_sweep():
    more = adv.advise(_context("loader", 1, [(1, 10.0), (2, 18.0)]), [], probe=lambda c: {})
    assert [(a["key"], a["current"], a["proposed"]) for a in more] == [("data.num_workers", 1, 2)]
    assert more[0]["predicted_speedup"] == pytest.approx(1.8) and more[0]["basis"].startswith("measured")
    # consumer-bound: more workers measured to slow it down -> a hint, no key
    hint = adv.advise(_context("consumer", 1, [(1, 10.0), (2, 9.0)]), [], probe=lambda c: {})
    assert [(a["rule"], a["key"]) for a in hint] == [("consumer_bound", None)] and "0.90×" in hint[0]["text"]
    # fewer workers measured faster (on 2 cores the workers compete with the main process's threads)
    fewer = adv.advise(_context("consumer", 1, [(0, 8.1), (1, 5.7), (2, 5.0)]), [], probe=lambda c: {})
    assert (fewer[0]["key"], fewer[0]["proposed"]) == ("data.num_workers", 0) and "lowering" in fewer[0]["text"]
    # loader-bound at 0 workers, nothing measured beyond: the cost model predicts (W + M) / W
    serial = adv.advise(_context("serial", 0, [(0, 100.0)]), [], probe=lambda c: {})
    assert serial[0]["proposed"] == 1 and serial[0]["predicted_speedup"] == pytest.approx(10 / 8)


def test_frame_advice_uses_the_knob_that_binds():
    long = [{"total_frames": 600, "source_fps": 30.0}]  # 20 s
    c = adv.video_frames_candidate(long, DecodeOptions(fps=2, max_frames=64))  # 40 frames: fps binds
    assert (c.key, c.current, c.proposed, c.decode) == ("data.decode.fps", 2, 1, {"fps": 1})
    c = adv.video_frames_candidate(long, DecodeOptions(fps=8, max_frames=32))  # capped at 32
    assert (c.key, c.proposed) == ("data.decode.max_frames", 16)
    c = adv.video_frames_candidate(long, DecodeOptions(num_frames=16))
    assert (c.key, c.proposed) == ("data.decode.num_frames", 8)
    short = [{"total_frames": 8, "source_fps": 8.0}]  # 1 s: min_frames binds, no knob halves it
    assert adv.video_frames_candidate(short, DecodeOptions(fps=2, min_frames=4)) is None


def test_pixel_advice_only_when_images_exceed_the_new_budget():
    c = adv.processor_pixels_candidate([1536 * 1536] * 3, 1048576, None, 1048576)
    assert c.key == "processor.max_pixels" and c.proposed == 334 * 784 and c.processor == {"max_pixels": 334 * 784}
    assert adv.processor_pixels_candidate([56 * 56] * 3, 50176, None, None) is None  # small images: nothing to cut
