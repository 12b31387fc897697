"""`mmrl profile-data`: stage timings from the real loader, processor and pickle; the bottleneck
and advice on data sets built to have a known bottleneck (the report must follow from its own
measurements, and the advised key, applied, must change what the advice says it changes);
report.json against its schema, the Chrome trace, the chart; the instrumentation itself.
Nothing here depends on timing or machine load: whether the advice pays off in samples/s is
measured by benchmarks/profile_advice.py."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from _data_media import encode_video, js, scrolling_texture, write_tar
from mmrl.cli import main
from mmrl.config import load_config
from mmrl.data.decode import DecodeOptions
from mmrl.data.stream import ShardStream
from mmrl.profiling import advice as adv
from mmrl.profiling import data_profile as dp
from mmrl.profiling import probes
from mmrl.profiling.data_profile import profile_data
from mmrl.profiling.output import load_schema, validate_report
from mmrl.profiling.pipeline import build_config_processor, run_pipeline
from mmrl.profiling.stats import fill_shares
from mmrl.utils.trace import load_trace

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "configs" / "colors_demo.yaml")
STAGES = ["shard_open", "shard_read", "tar_parse", "sample_parse", "image_decode", "video_decode",
          "handoff_latency", "handoff_wait", "processor", "serialise"]


def _base(model: Path, shards: str) -> list[str]:
    return [f"model.path={model}", f"data.train_shards={shards}", "data.heldout_shards=null"]


# ------------------------------------------------------------------------------------ data sets

@pytest.fixture(scope="module")
def video_shards(tmp_path_factory) -> str:
    """Long clips (16 s, 320 frames, a keyframe every 4) decoded at many frames per second:
    decoding dominates, and the decoded frames are small, so the processor is cheap."""
    out = tmp_path_factory.mktemp("videos")
    samples = [(f"v{k:03d}", {"json": js(prompt="Which way does the texture move?", answer="left", videos=["mp4"]),
                              "mp4": encode_video(scrolling_texture(320, 160, 120, k), fps=20)}) for k in range(14)]
    return write_tar(out / "train-000000.tar", samples)


@pytest.fixture(scope="module")
def image_shards(tmp_path_factory) -> str:
    """Big JPEGs (2048²) and a processor budget of 4 MP (Qwen2.5-VL's own default is 12.8 MP): the
    processor, and pickling its output, dominate."""
    from mmrl.plugins.data.recipes.colors import build

    out = tmp_path_factory.mktemp("bigimages")
    info = build(str(out), train_size=16, heldout_size=2, image_size=2048, shard_size=16, image_format="jpg")
    return str(out / info["shards"]["train"])


# 0 workers: one process does everything, so the bottleneck is the top share of all stages (limited_by
# "serial") however loaded the machine is; test_cli_outputs_schema_trace_chart covers worker processes.
VIDEO_OPTS = ["data.num_workers=0", "data.shuffle_buffer=0", "data.decode.fps=4", "data.decode.max_frames=64",
              "data.decode.max_pixels=3136", "processor.max_prompt_tokens=8192"]
IMAGE_OPTS = ["data.num_workers=0", "data.shuffle_buffer=0", "processor.max_pixels=4194304",
              "processor.max_prompt_tokens=8192"]


# ------------------------------------------------------------- what the advice was computed from

@dataclass
class Recorded:
    """What profile_data computed its advice from, kept by wrapping the real functions."""
    args: tuple = ()  # data_profile._advice(cfg, run, stages, runs, processor, limit, cpus, probe_samples, say)
    # candidate key -> (the candidate, what its probe measured)
    probes: dict[str, tuple[adv.Candidate, dict[str, Any]]] = field(default_factory=dict)


@pytest.fixture
def recorded(monkeypatch) -> Recorded:
    rec = Recorded()
    real_advice, real_advise = dp._advice, adv.advise

    def advice(*args):
        rec.args = args
        return real_advice(*args)

    def advise(ctx, candidates, probe, **kw):
        def keep(c: adv.Candidate) -> dict[str, Any]:
            rec.probes[c.key] = (c, probe(c))
            return rec.probes[c.key][1]
        return real_advise(ctx, candidates, keep, **kw)

    monkeypatch.setattr(dp, "_advice", advice)
    monkeypatch.setattr(adv, "advise", advise)
    return rec


def _profile(overrides: list[str], out: Path, rec: Recorded) -> tuple[dict[str, Any], dict[str, tuple]]:
    """report.json as written (0 workers, 10 samples) and the probes behind its advice."""
    profile_data(DEMO, overrides, samples=10, workers=[0], out_dir=out, probe_samples=2, bound=False)
    return json.loads((out / "report.json").read_text()), dict(rec.probes)


def _check_report_follows_its_measurements(report: dict[str, Any], probed: dict[str, tuple]) -> None:
    """The bottleneck is the stage the report's own shares rank first, and every advice number is
    what the advice module computes from the report's measurements and the probes behind them,
    whatever the timings of this run were."""
    assert report["bottleneck"]["limited_by"] == "serial"
    top = max((s for s in report["stages"] if s["work"]), key=lambda s: s["share"])
    assert (report["bottleneck"]["stage"], report["bottleneck"]["share"]) == (top["name"], top["share"])
    ctx = adv.Context({s["name"]: s for s in report["stages"]}, report["samples"]["measured"], report["workers"],
                      report["machine"]["cpus"], report["bottleneck"]["limited_by"],
                      [(p["workers"], p["samples_per_s"]) for p in report["scaling"]["points"]])
    entries = {a["key"]: a for a in report["advice"]}
    for key, (c, measured) in probed.items():
        ratios = {s: measured["new"][s] / t for s, t in measured["old"].items() if t > 0 and s in c.affects}
        gain = adv.predict_change(ctx, ratios)
        assert (key in entries) == (gain >= adv.MIN_SPEEDUP), (key, gain)  # a gain within noise is not advised
        if key in entries:
            e = entries[key]
            assert (e["rule"], e["stage"], e["current"], e["proposed"]) == (c.rule, c.stage, c.current, c.proposed)
            assert e["predicted_speedup"] == pytest.approx(gain)
            assert e["predicted_saving"] == pytest.approx(1 - 1 / gain)
    for e in report["advice"]:
        if e["key"] == "data.num_workers":
            assert e["predicted_speedup"] == pytest.approx(adv.predict_workers(ctx, e["proposed"])[0])
        elif e["key"] is None:  # a hint: nothing to apply, nothing predicted
            assert e["predicted_speedup"] is None
        else:
            assert e["key"] in probed  # no config change is advised without a probe behind it
    gains = [e["predicted_speedup"] or 0.0 for e in report["advice"]]
    assert gains == sorted(gains, reverse=True)


def _crafted_advice(rec: Recorded, monkeypatch, ms: dict[str, float], scale: dict[str, float]) -> list[dict[str, Any]]:
    """The profiler's advice step on its real run (config, samples, videos, images) with crafted
    measurements: `ms` of work per sample in the named stages, none in the others, and a probe that
    finds each stage in `scale` at that factor of its time with the proposed setting."""
    cfg, run, stages, runs, processor, _, _, probe_samples, say = rec.args
    rows = [{**s, "total_s": ms.get(s["name"], 0.0) * len(run.samples) / 1e3} for s in stages]
    fill_shares(rows)

    def probe(raws, options, processor, **changes) -> dict[str, Any]:
        old = dict.fromkeys(probes.PROBE_STAGES, 1e-3)
        return {"old": old, "new": {s: t * scale.get(s, 1.0) for s, t in old.items()}, "samples": len(raws)}

    monkeypatch.setattr(probes, "probe", probe)
    return dp._advice(cfg, run, rows, runs, processor, "serial", 2, probe_samples, say)


def _image_pixels(processor: Any, sample: Any) -> int:
    """Pixels of the sample's image that the processor feeds the vision tower (its patch grid)."""
    grid = processor(sample).mm_inputs["image_grid_thw"]
    return int(grid.prod()) * processor.hf.image_processor.patch_size ** 2


# ------------------------------------------------------------------------------- the acceptance

@pytest.mark.slow
def test_video_decode_bottleneck_and_fps_advice(video_shards, tiny_model_dir, tmp_path, recorded, monkeypatch):
    overrides = _base(tiny_model_dir, video_shards) + VIDEO_OPTS
    report, probed = _profile(overrides, tmp_path / "p", recorded)
    stages = {s["name"]: s for s in report["stages"]}
    assert stages["video_decode"]["count"] == 10
    assert report["decoders"][0]["backend"] == "decord" and report["decoders"][0]["frames"] == 10 * 64
    _check_report_follows_its_measurements(report, probed)
    # the frames rule is probed exactly when the measured video_decode share calls for it; nothing
    # else is (the frames are within data.decode.max_pixels already, and there are no images)
    assert set(probed) == ({"data.decode.fps"} if stages["video_decode"]["share"] >= adv.MIN_SHARE else set())

    # video decode 8 of 10 ms per sample, and halving the frames halves it: fps is the knob that binds
    advice = _crafted_advice(recorded, monkeypatch, {"video_decode": 8, "processor": 2}, {"video_decode": 0.5})
    fps = advice[0]
    assert (fps["key"], fps["stage"], fps["current"], fps["proposed"]) == ("data.decode.fps", "video_decode", 4.0, 2.0)
    assert "64→32" in fps["text"]
    assert fps["predicted_speedup"] == pytest.approx((8 + 2) / (4 + 2))  # 0 workers: W + M per sample
    if "data.decode.fps" in probed:  # the measured run proposed the same change
        assert probed["data.decode.fps"][0].proposed == fps["proposed"]

    # the key, applied, halves the frames every video decodes (and the video tokens with them)
    cfg = load_config(DEMO, overrides + [f"{fps['key']}={fps['proposed']}"])
    run = run_pipeline(cfg, build_config_processor(cfg), 0, 2)
    assert [v["frames"] for s in run.samples for v in s.worker["videos"]] == [32, 32]
    assert all(s.tokens < report["samples"]["mean_tokens"] for s in run.samples)


@pytest.mark.slow
def test_image_processing_bottleneck_and_max_pixels_advice(image_shards, tiny_model_dir, tmp_path, recorded,
                                                           monkeypatch):
    overrides = _base(tiny_model_dir, image_shards) + IMAGE_OPTS
    report, probed = _profile(overrides, tmp_path / "p", recorded)
    stages = {s["name"]: s for s in report["stages"]}
    assert stages["image_decode"]["count"] == stages["processor"]["count"] == 10
    _check_report_follows_its_measurements(report, probed)
    consumer_share = stages["processor"]["share"] + stages["serialise"]["share"]
    assert set(probed) == ({"processor.max_pixels"} if consumer_share >= adv.MIN_SHARE else set())

    # processor + pickling 9 of 10 ms per sample, and a quarter of the pixels quarters both
    advice = _crafted_advice(recorded, monkeypatch, {"image_decode": 1, "processor": 7, "serialise": 2},
                             {"processor": 0.25, "serialise": 0.25})
    assert [a["key"] for a in advice] == ["processor.max_pixels"]
    pix = advice[0]
    assert pix["stage"] == "processor" and pix["current"] == 4194304
    assert pix["proposed"] <= 4194304 // 4 and pix["proposed"] % (28 * 28) == 0
    assert pix["predicted_speedup"] == pytest.approx((1 + 9) / (1 + 9 / 4))  # 0 workers: W + M per sample
    if "processor.max_pixels" in probed:
        assert probed["processor.max_pixels"][0].proposed == pix["proposed"]

    # the key, applied, cuts what the processor feeds the vision tower to within the new budget
    cfg = load_config(DEMO, overrides + [f"{pix['key']}={pix['proposed']}"])
    processor = build_config_processor(cfg)
    run = run_pipeline(cfg, processor, 0, 2, keep=1)
    before, after = _image_pixels(recorded.args[4], run.kept[0]), _image_pixels(processor, run.kept[0])
    assert after <= pix["proposed"] and 4 * after <= before, (before, after)
    assert all(s.tokens < report["samples"]["mean_tokens"] for s in run.samples)


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
