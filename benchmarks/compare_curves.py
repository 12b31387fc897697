"""Overlay the held-out accuracy curves of several `colors_learning.py` results (e.g. sync vs async).

    .venv/bin/python benchmarks/compare_curves.py OUT.png LABEL=path/colors_learning.json ...

Plots accuracy against steps and against wall time (start-up included), one line per label and
seed, and prints each label's steps and seconds to the target.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, runs = Path(argv[0]), [a.split("=", 1) for a in argv[1:]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    target = None
    for label, path in runs:
        data = json.loads(Path(path).read_text())
        target = data["target"]
        for r in data["results"]:
            steps, acc, wall = zip(*r["curve"])
            name = f"{label} (seed {r['seed']})"
            axes[0].plot(steps, acc, label=name)
            axes[1].plot([w + r["startup_s"] for w in wall], acc, label=name)
            print(f"{name}: {r['steps_to_target']} steps, {r['total_wall_to_target_s']:.0f} s to {target} "
                  f"(start-up included); mean step {r['mean_step_s']:.2f} s")
    for ax, xlabel in zip(axes, ["step", "wall time incl. start-up (s)"]):
        if target is not None:
            ax.axhline(target, color="grey", ls="--", lw=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out accuracy (greedy)")
        ax.set_ylim(0, 1.02)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
