"""mmrl against TRL's GRPOTrainer on the same task, one after the other, in one command.

    .venv/bin/python benchmarks/vs_trl.py [--regimes demo long] [--seed 0]

Both train the colours demo (configs/colors_demo.yaml: the model folder, the shards, 16 prompts x
16 samples, the reward shape_colour + 0.1 x first_word_in, lr 5e-4, Adam betas (0.9, 0.99), grad
clip 1, clip 0.2, entropy bonus 0.1, token-mean loss, group-normalised advantages, no KL; the
config's lr and entropy schedules start at step 150, after the demo reaches 0.95), from the same
random initialisation, on this machine's CPUs:
- `mmrl train` as shipped (vLLM engine in Ray, 2 DeepSpeed ZeRO-3 ranks, weight sync every step),
  with checkpoints and the stability guard off (TRL has neither here);
- TRL 1.16's GRPOTrainer with plain HF `generate`, one process, fp32 (benchmarks/trl_grpo.py, run
  in its own venv, `work/trl-venv`, made here if missing: TRL pinned, sharing this venv's torch
  and transformers through a .pth file).
Regimes: `demo` (the tiny model, 2 new tokens, until 0.95 held-out or --max-steps) and `long` (a
~35 M-parameter model of the same family, 128 new tokens, --long-steps steps: throughput).
Held-out greedy accuracy every 5 steps on both sides, its time left out of the training seconds.
Prints, per regime: completions/s (median step), seconds from launch to the end of the first
step, steps and training seconds to 0.95, and mmrl / TRL ratios; writes
benchmarks/results/vs_trl.json and vs_trl.png (accuracy vs training seconds).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from _plots import accuracy_axes, panels, save  # noqa: E402
TRL = "trl==1.16.0"
TRL_VENV = REPO / "work" / "trl-venv"
DATA = REPO / "work" / "data" / "colors"
PROMPTS, GROUP = 16, 16
REGIMES = {  # model folder (built if missing: hidden size, layers), max new tokens
    "demo": ("work/tiny-vlm", (128, 2), 2),
    "long": ("work/bench-vlm-1024x4", (1024, 4), 128),
}


def ensure_trl_venv() -> Path:
    python = TRL_VENV / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import trl"], capture_output=True).returncode == 0:
        return python
    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    ours = subprocess.run([sys.executable, "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    theirs = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                            capture_output=True, text=True, check=True).stdout.strip()
    # the same torch / transformers as mmrl's (nothing to download twice, the same kernels)
    Path(theirs, "mmrl-venv.pth").write_text(ours + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", TRL], check=True)
    return python


def ensure_assets(regime: str) -> Path:
    from mmrl.models.tiny_vlm import build_tiny_vlm

    folder, (hidden, layers), _ = REGIMES[regime]
    model = REPO / folder
    if not (model / "config.json").exists():
        build_tiny_vlm("qwen2_5_vl", model, hidden_size=hidden, num_layers=layers)
    if not (DATA / "dataset.json").exists():
        subprocess.run([sys.executable, "-m", "mmrl.cli", "data", "build", "colors", "--out", str(DATA)],
                       cwd=REPO, check=True)
    return model


def _first_step_watch(metrics: Path, t0: float, seen: dict) -> threading.Event:
    """Poll metrics.jsonl until a training step is written; note when (launcher's clock)."""
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            if metrics.exists() and any(json.loads(line).get("step", 0) >= 1 for line in
                                        metrics.read_text().splitlines() if line.endswith("}")):
                seen["first_step_s"] = time.time() - t0
                return
            time.sleep(0.1)

    threading.Thread(target=poll, daemon=True).start()
    return stop


def run_mmrl(regime: str, model: Path, steps: int, target: float | None, seed: int, out: Path) -> dict:
    run_dir = out / f"mmrl-{regime}"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [f"model.path={model}", f"data.train_shards={DATA}/train-{{000000..000003}}.tar",
                 f"data.heldout_shards={DATA}/heldout-000000.tar", f"run.output_dir={run_dir}", f"run.seed={seed}",
                 f"run.max_steps={steps}", "run.time_limit_s=null", f"rollout.max_new_tokens={REGIMES[regime][2]}",
                 "eval.every_steps=5", "checkpoint.every_steps=0", "stability.enabled=false",
                 "logging.progress_bar=false"]
    if target is not None:
        overrides.append(f"run.stop_at_heldout_accuracy={target}")
    seen: dict = {}
    t0 = time.time()
    stop = _first_step_watch(run_dir / "metrics.jsonl", t0, seen)
    proc = subprocess.run([sys.executable, "-m", "mmrl.cli", "train", str(REPO / "configs" / "colors_demo.yaml"),
                           *overrides], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    stop.set()
    (out / f"mmrl-{regime}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"mmrl ({regime}) failed, see {out}/mmrl-{regime}.log")
    return mmrl_summary(run_dir, seen.get("first_step_s"), target, overrides)


def mmrl_summary(run_dir: Path, first_step_s: float | None, target: float | None, overrides: list[str]) -> dict:
    """An mmrl run's record from its metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve, train_s, step_s = [], 0.0, []
    for r in rows:
        if r["step"] >= 1:  # the step itself: its eval (and any checkpoint) left out, as on TRL's side
            s = r["time/step_s"] - r.get("time/eval_s", 0.0) - r.get("time/checkpoint_s", 0.0)
            train_s += s
            step_s.append(s)
        if "eval/heldout_accuracy" in r:
            curve.append((r["step"], r["eval/heldout_accuracy"], train_s))
    record = summarise("mmrl", curve, step_s, first_step_s, target,
                       "mmrl train configs/colors_demo.yaml " + " ".join(o for o in overrides if "=" in o and
                                                                           not o.startswith(("run.output_dir",)))
                       .replace(str(REPO) + "/", ""))
    record["profile"] = profile(run_dir)
    return record


def profile(run_dir: Path) -> dict:
    """Where mmrl's step and start-up time went (`mmrl report`'s numbers): per span seconds per
    step, share of the step and cores busy; start-up phases."""
    from mmrl.controller.report import load_metrics, summarize

    summary = summarize(run_dir, load_metrics(run_dir))
    spans = [{k: s[k] for k in ("name", "mean_s", "share", "p50_s", "cores")} for s in summary["spans"]]
    other = {k: summary["other"][k] for k in ("mean_s", "share", "p50_s")}
    return {"spans": spans, "other": other, "startup": summary["startup"], "startup_cpu": summary["startup_cpu"],
            "cores_available": summary["cores_available"]}


def profile_line(prof: dict) -> str:
    top = sorted((s for s in prof["spans"] if "/" not in s["name"]), key=lambda s: -s["mean_s"])
    def cores(s: dict) -> str:
        return "" if s["cores"] is None else f", {s['cores']:.1f} cores"
    return ", ".join(f"{s['name']} {s['mean_s']:.2f} s ({s['share']:.0%}{cores(s)})" for s in top) + \
        f", other {prof['other']['mean_s']:.2f} s"


def run_trl(python: Path, regime: str, model: Path, steps: int, target: float | None, seed: int, out: Path) -> dict:
    metrics = out / f"trl-{regime}.jsonl"
    metrics.unlink(missing_ok=True)
    args = ["--model", str(model), "--train-shards", f"{DATA}/train-{{000000..000003}}.tar",
            "--heldout-shards", f"{DATA}/heldout-000000.tar", "--steps", str(steps), "--prompts", str(PROMPTS),
            "--group", str(GROUP), "--max-new-tokens", str(REGIMES[regime][2]), "--seed", str(seed),
            "--eval-every", "5", "--target", str(target if target is not None else 2.0)]
    t0 = time.time()
    proc = subprocess.run([str(python), str(REPO / "benchmarks" / "trl_grpo.py"), *args, "--t0", str(t0),
                           "--out", str(metrics)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    (out / f"trl-{regime}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"TRL ({regime}) failed, see {out}/trl-{regime}.log")
    return trl_summary(metrics, target, args)


def trl_summary(metrics: Path, target: float | None, args: list[str]) -> dict:
    """A TRL run's record from the JSONL benchmarks/trl_grpo.py writes."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    curve = [(r["step"], r["heldout_accuracy"], r["train_s"]) for r in rows if "heldout_accuracy" in r]
    first = next((r["wall"] for r in rows if r["step"] >= 1), None)
    return summarise("trl", curve, [r["step_s"] for r in rows if r["step"] >= 1], first, target,
                     "benchmarks/trl_grpo.py " + " ".join(args).replace(str(REPO) + "/", ""))


def summarise(side: str, curve: list, step_s: list[float], first_step_s: float | None, target: float | None,
              command: str) -> dict:
    hit = next(((s, t) for s, a, t in curve if target is not None and a >= target), None)
    median = statistics.median(step_s)
    return {"side": side, "command": command, "curve": curve, "steps": len(step_s), "median_step_s": median,
            "completions_per_s": PROMPTS * GROUP / median, "first_step_s": first_step_s,
            "steps_to_target": hit[0] if hit else None, "train_s_to_target": hit[1] if hit else None,
            "final_accuracy": curve[-1][1] if curve else None}


def plot(results: dict, path: Path) -> None:
    fig, axes = panels(1, len(results))
    for ax, (regime, sides) in zip(axes[0], results.items()):
        for side, r in ((k, v) for k, v in sides.items() if k in ("mmrl", "trl")):
            _, acc, secs = zip(*r["curve"])
            ax.plot(secs, acc, marker=".", label=f"{side}: {r['completions_per_s']:.0f} completions/s")
        accuracy_axes(ax, "training seconds (eval left out)", "held-out accuracy (greedy)",
                      f"{regime} ({REGIMES[regime][2]} new tokens)")
    save(fig, "mmrl vs TRL GRPOTrainer (same task and settings), CPU", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--max-steps", type=int, default=300, help="demo regime: the budget to reach --target")
    ap.add_argument("--long-steps", type=int, default=10, help="long regime: steps timed")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args()
    python = ensure_trl_venv()
    out = Path(args.out)
    runs = out / "runs" / "vs_trl"
    runs.mkdir(parents=True, exist_ok=True)
    path = out / "vs_trl.json"
    # the regimes already measured stay (each is written as soon as it ends: the long one takes long)
    results: dict = json.loads(path.read_text())["results"] if path.exists() else {}
    for regime in args.regimes:
        model = ensure_assets(regime)
        steps, target = (args.max_steps, args.target) if regime == "demo" else (args.long_steps, None)
        sides = {"trl": run_trl(python, regime, model, steps, target, args.seed, runs),
                 "mmrl": run_mmrl(regime, model, steps, target, args.seed, runs)}
        results[regime] = sides
        m, t = sides["mmrl"], sides["trl"]
        print(f"{regime}: completions/s mmrl {m['completions_per_s']:.1f} vs TRL {t['completions_per_s']:.1f} "
              f"-> {m['completions_per_s'] / t['completions_per_s']:.2f}x; first step at {m['first_step_s']:.1f} s "
              f"vs {t['first_step_s']:.1f} s; to {args.target}: mmrl {m['steps_to_target']} steps / "
              f"{m['train_s_to_target'] and round(m['train_s_to_target'])} s, TRL {t['steps_to_target']} steps / "
              f"{t['train_s_to_target'] and round(t['train_s_to_target'])} s; final accuracy "
              f"{m['final_accuracy']} vs {t['final_accuracy']}", flush=True)
        print(f"  mmrl's step, mean per span: {profile_line(m['profile'])}", flush=True)
        write(results, regime, path)


def write(results: dict, regime: str, path: Path) -> None:
    """The JSON (each regime names the commit it was measured on) and the PNG, after each regime."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    results[regime]["commit"] = commit
    path.write_text(json.dumps({"trl": TRL, "prompts": PROMPTS, "group": GROUP, "results": results}, indent=1))
    plot(results, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
