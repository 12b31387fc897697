"""RL on an MoE VLM without and with rollout routing replay (R3), and with TIS: held-out accuracy
and the engine-trainer mismatch over a run.

    .venv/bin/python benchmarks/moe_stability.py [--dtype bfloat16] [--max-steps 150] [--only off r3 tis]

The colours demo (configs/colors_demo.yaml: 16 prompts x 16 samples, the demo's lr, entropy bonus
and fades) on the tiny Qwen3-VL-MoE (4 experts, top-2; the folder moe_routing_replay.py builds),
`model.dtype=<dtype>` for the engine and the trainer, one `mmrl train` process per variant with the
same seed and data order:
  off     the trainer routes every token by its own routers (the default);
  r3      algorithm.routing_replay=rollout: the trainer replays the engine's experts;
  tis     off, with truncated importance sampling (algorithm.rollout_correction.mode=tis, cap 2);
  r3_tis  both.
Per step it reads the run's own metrics: mismatch/mean_abs_logprob_diff and max, the importance
ratio's extremes (mismatch/ratio_min, ratio_max) and mismatch/router_agreement; held-out greedy
accuracy every --eval-every steps. Prints a table and writes
benchmarks/results/moe_stability_<dtype>.{json,png}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _plots import panels, save, write_result  # noqa: E402
from _train_runs import curve_summary, train  # noqa: E402

VARIANTS: dict[str, list[str]] = {
    "off": [],
    "r3": ["algorithm.routing_replay=rollout"],
    "tis": ["algorithm.rollout_correction.mode=tis", "algorithm.rollout_correction.threshold=2.0"],
    "r3_tis": ["algorithm.routing_replay=rollout", "algorithm.rollout_correction.mode=tis",
               "algorithm.rollout_correction.threshold=2.0"],
}
SERIES = ("mismatch/mean_abs_logprob_diff", "mismatch/max_abs_logprob_diff", "mismatch/ratio_max",
          "mismatch/ratio_min", "mismatch/router_agreement")


def assets(dtype: str) -> tuple[Path, Path]:
    """The tiny MoE model in `dtype` and the colours shards (built once, shared with
    moe_routing_replay.py)."""
    from mmrl.models.tiny_vlm import build_tiny_vlm
    from mmrl.plugins.data.recipes.colors import build as build_colors

    model = REPO / "work" / f"bench-qwen3-vl-moe-{dtype}"
    if not (model / "config.json").exists():
        build_tiny_vlm("qwen3_vl_moe", model, dtype=dtype)
    shards = REPO / "work" / "bench-moe-r3-colors"
    if not (shards / "heldout-000000.tar").exists():
        build_colors(shards, train_size=512, heldout_size=64, shard_size=512, seed=0)
    return model, shards


def summarise(name: str, rows: list[dict], wall_s: float, exit_code: int, target: float) -> dict:
    steps = [r for r in rows if r["step"] > 0 and "mismatch/mean_abs_logprob_diff" in r]
    series = {key: [(r["step"], r[key]) for r in steps if key in r] for key in SERIES}

    def mean(key: str) -> float | None:
        values = [v for _, v in series[key]]
        return statistics.fmean(values) if values else None

    return {"name": name, "overrides": VARIANTS[name], "exit_code": exit_code, "wall_s": wall_s,
            **curve_summary(rows, target), "series": series,
            "mean_abs_logprob_diff": mean("mismatch/mean_abs_logprob_diff"),
            "max_abs_logprob_diff": max((v for _, v in series["mismatch/max_abs_logprob_diff"]), default=None),
            "ratio_max": max((v for _, v in series["mismatch/ratio_max"]), default=None),
            "ratio_min": min((v for _, v in series["mismatch/ratio_min"]), default=None),
            "router_agreement": mean("mismatch/router_agreement")}


def plot(results: list[dict], target: float, dtype: str, path: Path) -> None:
    fig, axes = panels(1, 3)
    for i, r in enumerate(results):  # one colour per variant in every panel
        colour = f"C{i}"
        axes[0][0].plot([s for s, _, _ in r["curve"]], [a for _, a, _ in r["curve"]], label=r["name"], color=colour)
        diff = r["series"]["mismatch/mean_abs_logprob_diff"]
        axes[0][1].plot([s for s, _ in diff], [v for _, v in diff], label=r["name"], lw=0.8, color=colour)
        hi, lo = r["series"]["mismatch/ratio_max"], r["series"]["mismatch/ratio_min"]
        axes[0][2].plot([s for s, _ in hi], [v for _, v in hi], label=f"{r['name']} max", lw=0.8, color=colour)
        axes[0][2].plot([s for s, _ in lo], [v for _, v in lo], label=f"{r['name']} min", lw=0.8, ls=":", color=colour)
    axes[0][0].axhline(target, color="grey", ls="--", lw=1)
    axes[0][0].set(xlabel="step", ylabel="held-out accuracy (greedy)", ylim=(0, 1.02))
    axes[0][1].set(xlabel="step", ylabel="mean |logprob trainer - engine|", yscale="log")
    axes[0][2].set(xlabel="step", ylabel="importance ratio pi/mu (extremes per step)", yscale="log")
    for ax in axes[0]:
        ax.legend(fontsize=7)
    save(fig, f"tiny Qwen3-VL-MoE ({dtype}) on the colours task: without and with R3 / TIS", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--only", nargs="+", choices=list(VARIANTS), default=["off", "r3", "tis"])
    ap.add_argument("--max-steps", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every variant")
    args = ap.parse_args()

    model, shards = assets(args.dtype)
    out = Path(args.out)
    runs = out / "runs" / f"moe_stability_{args.dtype}"
    base = [f"model.path={model}", f"model.dtype={args.dtype}", f"data.train_shards={shards}/train-000000.tar",
            f"data.heldout_shards={shards}/heldout-000000.tar", f"run.seed={args.seed}",
            f"run.max_steps={args.max_steps}", "run.time_limit_s=null", f"eval.every_steps={args.eval_every}",
            # the comparison is of the runs as they go: no rollback hides a collapse
            "stability.enabled=false"]
    results = []
    for name in args.only:
        rows, wall, code = train(REPO / "configs" / "colors_demo.yaml", runs / name,
                                 [*base, *VARIANTS[name], *args.overrides], runs / f"{name}.log")
        results.append(summarise(name, rows, wall, code, args.target))
        r = results[-1]
        print(f"{name}: exit {code}, {r['steps']} steps, best {r['best']}, final {r['final']}, "
              f"mean |dlogprob| {r['mean_abs_logprob_diff']:.3g}, ratio [{r['ratio_min']:.3g}, {r['ratio_max']:.3g}], "
              f"router agreement {r['router_agreement']}", flush=True)
        write_result(out, f"moe_stability_{args.dtype}.json",
                     {"dtype": args.dtype, "model": str(model), "seed": args.seed, "max_steps": args.max_steps,
                      "target": args.target, "overrides": base, "extra_overrides": args.overrides,
                      "results": results})
    plot(results, args.target, args.dtype, out / f"moe_stability_{args.dtype}.png")
    print(f"| variant | steps to {args.target} | best | final | mean abs dlogprob | max abs dlogprob | "
          "ratio min | ratio max | router agreement | s/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        agree = f"{r['router_agreement']:.4f}" if r["router_agreement"] is not None else "-"
        print(f"| {r['name']} | {r['steps_to_target'] or 'not reached'} | {r['best']:.3f} | {r['final']:.3f} | "
              f"{r['mean_abs_logprob_diff']:.3g} | {r['max_abs_logprob_diff']:.3g} | {r['ratio_min']:.3g} | "
              f"{r['ratio_max']:.3g} | {agree} | {r['mean_step_s']:.2f} |")


if __name__ == "__main__":
    main()
