"""Does the advice of `mmrl profile-data` pay off? On two data sets built to have a known
bottleneck (the ones tests/test_profile_data.py profiles), profile, apply each advised config
change and measure samples/s before and after, side by side in one run.

    .venv/bin/python benchmarks/profile_advice.py [--samples 10] [--rate-samples 8] [--repeats 3]

Data sets (small, in a temp dir), with the tiny random Qwen2.5-VL (mmrl.models.tiny_vlm):
  video  14 clips of 16 s (320 textured frames of 160x120, a keyframe every 4) decoded at
         data.decode.fps=4, at most 64 frames: video decoding dominates; expected advice
         data.decode.fps 4 -> 2 (64 -> 32 frames per video);
  image  16 JPEGs of 2048x2048 and processor.max_pixels=4194304 (4 MP): the processor and pickling
         its output dominate; expected advice processor.max_pixels -> a quarter.
Both use 0 loader workers (one process), as the tests do. Every advice entry with a config key is
applied as `key=proposed`; before and after are measured with the profiler's own measured pass
(mmrl.profiling.pipeline.run_pipeline, --rate-samples samples after a warm-up), interleaved
(A B A B ...) so load from other processes hits both, best of --repeats each. Printed: the
predicted speedup next to the measured one. Goal: the bottleneck's own advice measured >= 1.3x.
Results: benchmarks/results/profile_advice.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the media helpers the profiler tests build the same sets with
from _data_media import encode_video, scrolling_texture  # noqa: E402
DEMO = str(REPO / "configs" / "colors_demo.yaml")
GOAL = 1.3
SETS = {  # name -> (the set's own overrides, the key its bottleneck's advice should change)
    "video": (["data.num_workers=0", "data.shuffle_buffer=0", "data.decode.fps=4", "data.decode.max_frames=64",
               "data.decode.max_pixels=3136", "processor.max_prompt_tokens=8192"], "data.decode.fps"),
    "image": (["data.num_workers=0", "data.shuffle_buffer=0", "processor.max_pixels=4194304",
               "processor.max_prompt_tokens=8192"], "processor.max_pixels"),
}


# ------------------------------------------------------------------------------------ data sets

def build_video_set(out: Path, clips: int = 14) -> str:
    from mmrl.plugins.data.recipes._common import ShardSink

    out.mkdir(parents=True)
    record = json.dumps({"prompt": "Which way does the texture move?", "answer": "left", "videos": ["mp4"]}).encode()
    with ShardSink(str(out / "train-%06d.tar")) as sink:
        for k in range(clips):
            sink.write({"__key__": f"v{k:03d}", "json": record, "mp4": encode_video(scrolling_texture(320, 160, 120, k), fps=20)})
    return sink.shards[0]


def build_image_set(out: Path) -> str:
    from mmrl.plugins.data.recipes.colors import build

    info = build(str(out), train_size=16, heldout_size=2, image_size=2048, shard_size=16, image_format="jpg")
    return str(out / info["shards"]["train"])


# ---------------------------------------------------------------------------------- measurement

def best_rates(overrides: list[list[str]], samples: int, repeats: int) -> list[list[float]]:
    """samples/s of each override set, `repeats` times, the sets measured interleaved (A B A B)
    so load from other processes on the machine hits all of them alike."""
    from mmrl.config import load_config
    from mmrl.profiling.pipeline import build_config_processor, run_pipeline

    setups = [(cfg, build_config_processor(cfg)) for cfg in (load_config(DEMO, o) for o in overrides)]
    rates: list[list[float]] = [[] for _ in setups]
    for _ in range(repeats):
        for i, (cfg, processor) in enumerate(setups):
            rates[i].append(run_pipeline(cfg, processor, cfg.data.num_workers, samples).samples_per_s)
    return rates


def run_set(name: str, base: list[str], tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Profile one set, then measure every advice entry that names a config key."""
    from mmrl.profiling.data_profile import profile_data

    own, goal_key = SETS[name]
    overrides = base + own
    report = profile_data(DEMO, overrides, samples=args.samples, workers=[0], out_dir=tmp / f"profile-{name}",
                          probe_samples=args.probe_samples, bound=False)
    neck = report["bottleneck"]
    print(f"{name}: bottleneck {neck['stage']} ({neck['share']:.0%} of work, {neck['limited_by']})", flush=True)
    applied = []
    for a in (a for a in report["advice"] if a["key"] is not None):
        before, after = best_rates([overrides, overrides + [f"{a['key']}={a['proposed']}"]],
                                   args.rate_samples, args.repeats)
        measured = max(after) / max(before)
        applied.append({"key": a["key"], "current": a["current"], "proposed": a["proposed"], "rule": a["rule"],
                        "predicted_speedup": a["predicted_speedup"], "measured_speedup": measured,
                        "before_samples_per_s": before, "after_samples_per_s": after})
        print(f"  {a['key']} {a['current']}→{a['proposed']}: predicted {a['predicted_speedup']:.2f}×, measured "
              f"{max(before):.2f}→{max(after):.2f} samples/s = {measured:.2f}× (best of {args.repeats})", flush=True)
    goal = next((x for x in applied if x["key"] == goal_key), None)
    verdict = "not advised" if goal is None else f"{goal['measured_speedup']:.2f}× (goal ≥ {GOAL}×)"
    print(f"  {goal_key}: {verdict}", flush=True)
    return {"overrides": own, "bottleneck": neck, "stages": {s["name"]: s["share"] for s in report["stages"]},
            "advice": applied, "goal_key": goal_key,
            "goal_met": goal is not None and goal["measured_speedup"] >= GOAL}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", choices=sorted(SETS), default=["video", "image"])
    ap.add_argument("--samples", type=int, default=10, help="samples the profile measures")
    ap.add_argument("--probe-samples", type=int, default=4)
    ap.add_argument("--rate-samples", type=int, default=8, help="samples per before/after throughput run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "profile_advice.json"))
    args = ap.parse_args()
    from mmrl.models.tiny_vlm import build_tiny_vlm
    from mmrl.utils.paths import repo_relative

    results = {}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = build_tiny_vlm("qwen2_5_vl", tmp / "tiny", seed=0)
        shards = {"video": build_video_set, "image": build_image_set}
        for name in args.sets:
            base = [f"model.path={model}", f"data.train_shards={shards[name](tmp / name)}", "data.heldout_shards=null"]
            results[name] = run_set(name, base, tmp, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # the output path relative to the checkout: committed results must not name the machine
    recorded = {**vars(args), "out": repo_relative(args.out, REPO)}
    out.write_text(json.dumps({"args": recorded, "goal": GOAL, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
