"""The colours task through the Tinker API (examples/tinker_colors_rl.py, the official SDK against
`mmrl serve`) beside `mmrl train` on the same task, measured in one run: held-out accuracy by
step and by wall time in one plot, and p50/p95 seconds of the SDK's calls on this machine.

  .venv/bin/python benchmarks/tinker_colors.py [--steps 300] [--train-steps 200] [--skip-train]
Writes benchmarks/results/tinker_colors.json and .png (needs `make assets`)."""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _plots import accuracy_axes, panels, save, write_result  # noqa: E402
from _train_runs import curve_summary, train  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "colors_demo.yaml"
CALLS = ("sample", "forward_backward", "forward_backward_prior", "optim_step", "save_weights_for_sampler")


def start_server(store: Path, key: str, log: Path) -> tuple[subprocess.Popen, str]:
    """`mmrl serve` on the demo config (vLLM sampler, adapters on the projector too) on a free port;
    its URL once healthy."""
    import httpx

    cmd = [sys.executable, "-m", "mmrl.cli", "serve", str(CONFIG), "--port", "0", f"serve.store_dir={store}",
           "serve.lora_projector=true"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "MMRL_API_KEYS": key, "HF_HUB_OFFLINE": "1"})
    deadline = time.time() + 900  # a hang guard: the engine starts in about a minute
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"mmrl serve exited ({proc.returncode}); see {log}")
        found = re.search(r"Tinker API on (http://\S+)", log.read_text())
        if found:
            try:
                if httpx.get(found.group(1) + "/api/v1/healthz", timeout=2).status_code == 200:
                    return proc, found.group(1)
            except httpx.HTTPError:
                pass
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"mmrl serve did not come up in 900 s; see {log}")


def run_example(url: str, key: str, steps: int, log: Path) -> tuple[list[dict], float]:
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "tinker_colors_rl.py"), "--model", "work/tiny-vlm",
                           "--data", "work/data/colors", "--steps", str(steps)], cwd=REPO,
                          env={**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": key, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the example failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    log.write_text(proc.stdout)
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")], time.time() - t0


def latency(rows: list[dict]) -> dict[str, dict[str, float]]:
    out = {}
    for call in CALLS:
        xs = [r["seconds"][call] for r in rows if call in r.get("seconds", {})]
        if xs:
            out[call] = {"p50_s": float(np.percentile(xs, 50)), "p95_s": float(np.percentile(xs, 95)), "n": len(xs)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="the example's step budget and lr-decay horizon (it stops at 0.95)")
    ap.add_argument("--train-steps", type=int, default=200, help="mmrl train's step budget")
    ap.add_argument("--skip-train", action="store_true", help="only the Tinker run (no mmrl train curve)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="mmrl-tinker-colors-"))
    result: dict = {"target": 0.95}
    if not args.skip_train:
        rows, wall, _ = train(CONFIG, work / "train", [f"run.max_steps={args.train_steps}",
                                                       "run.stop_at_heldout_accuracy=0.95"], work / "train.log")
        result["mmrl_train"] = {**curve_summary(rows, 0.95), "total_wall_s": wall}
    key = "tml-" + secrets.token_hex(12)
    server, url = start_server(work / "store", key, work / "serve.log")
    try:
        rows, wall = run_example(url, key, args.steps, work / "tinker.jsonl")
    finally:
        server.terminate()
        server.wait(timeout=120)
    start = 0.0
    curve = []
    for r in rows:  # wall seconds from the example's step times (sampling, training, weight saves)
        start += sum(r["seconds"].values())
        if "heldout_accuracy" in r:
            curve.append((r["step"], r["heldout_accuracy"], start))
    hit = next(((s, w) for s, a, w in curve if a >= 0.95), None)
    result["tinker_api"] = {"curve": curve, "steps_to_target": hit[0] if hit else None,
                            "calls_wall_to_target_s": hit[1] if hit else None, "total_wall_s": wall,
                            "steps": rows[-1]["step"], "latency": latency(rows)}
    write_result(args.out, "tinker_colors.json", result)

    fig, axes = panels(1, 2)
    for name, label in (("mmrl_train", "mmrl train (full weights, DeepSpeed + vLLM)"),
                        ("tinker_api", "Tinker SDK -> mmrl serve (LoRA)")):
        if name in result:
            c = result[name]["curve"]
            axes[0][0].plot([s for s, _, _ in c], [a for _, a, _ in c], marker=".", label=label)
            axes[0][1].plot([w for _, _, w in c], [a for _, a, _ in c], marker=".", label=label)
    accuracy_axes(axes[0][0], "step", "held-out greedy accuracy", target=0.95)
    accuracy_axes(axes[0][1], "seconds", "held-out greedy accuracy", target=0.95)
    save(fig, "colours task: mmrl train vs the Tinker API", Path(args.out) / "tinker_colors.png")
    print(json.dumps({k: {kk: v for kk, v in r.items() if kk != "curve"} for k, r in result.items()
                      if isinstance(r, dict)}, indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
