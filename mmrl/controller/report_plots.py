"""PNG plots for `mmrl report`: reward, held-out accuracy, KL, entropy, mismatch, step-time stack.

Drawn on a bare matplotlib Figure (Agg canvas) rather than pyplot, so no global backend or
figure state changes in the calling process.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mmrl.controller.report import OTHER, TIME_PREFIX, TIME_SUFFIX, span_names, timed_rows

Rows = list[dict[str, Any]]


def _series(rows: Rows, key: str) -> tuple[list[float], list[float]]:
    points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def _reward_components(rows: Rows) -> list[str]:
    """reward/<reward>/<component> keys (not the reward/errors/<reward> failure counts)."""
    keys: dict[str, None] = {}
    for row in rows:
        for key in row:
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "reward" and parts[1] not in ("errors", "timeouts"):
                keys[key] = None
    return list(keys)


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _line_plot(rows: Rows, path: Path, title: str, main: Sequence[str], thin: Sequence[str] = (),
               ylabel: str = "", log_y: bool = False) -> Path | str:
    """Main keys as bold lines, thin keys as faint ones; the reason string when no main key is logged."""
    if not any(_series(rows, k)[0] for k in main):
        return f"{' / '.join(main)} not in metrics.jsonl"
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    for key in main:
        x, y = _series(rows, key)
        if x:
            ax.plot(x, y, marker="o" if len(x) < 30 else None, linewidth=2, label=key)
    for key in thin:
        x, y = _series(rows, key)
        if x:
            ax.plot(x, y, linewidth=1, alpha=0.6, label=key)
    values = [v for k in list(main) + list(thin) for v in _series(rows, k)[1]]
    if log_y and values and min(values) > 0:  # log only when every value can be drawn on it
        ax.set_yscale("log")
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


def _step_time_stack(rows: Rows, path: Path) -> Path | str:
    """Stacked area of the top-level spans per step, plus what none of them measured."""
    timed = timed_rows(rows)
    names = [n for n in span_names(timed) if "/" not in n]  # sub-spans would count twice
    if not timed or not names:
        return "no time/<span>_s metrics in metrics.jsonl"
    steps = [r["step"] for r in timed]
    layers = [[r.get(f"{TIME_PREFIX}{n}{TIME_SUFFIX}", 0.0) for r in timed] for n in names]
    other = [max(r["time/step_s"] - sum(layer[i] for layer in layers), 0.0) for i, r in enumerate(timed)]
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    ax.stackplot(steps, *layers, other, labels=names + [OTHER], alpha=0.85)
    ax.plot(steps, [r["time/step_s"] for r in timed], color="black", linewidth=1, label="time/step_s")
    ax.set(title="step time by span", xlabel="step", ylabel="seconds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def write_plots(rows: Rows, out_dir: Path) -> tuple[list[Path], dict[str, str]]:
    """Write every plot whose metrics exist; return (written paths, {plot: why it was skipped})."""
    by_answer = sorted({k for r in rows for k in r if k.startswith("eval/accuracy_by_answer/")})
    results: dict[str, Path | str] = {
        "reward": _line_plot(rows, out_dir / "reward.png", "reward", ["reward/mean"], _reward_components(rows)),
        "heldout_accuracy": _line_plot(rows, out_dir / "heldout_accuracy.png", "held-out accuracy (greedy)",
                                       ["eval/heldout_accuracy"], by_answer),
        "kl": _line_plot(rows, out_dir / "kl.png", "KL (actor/kl)", ["actor/kl"]),
        "entropy": _line_plot(rows, out_dir / "entropy.png", "policy entropy", ["actor/entropy"], ylabel="nats"),
        "mismatch": _line_plot(rows, out_dir / "mismatch.png", "engine vs trainer logprob mismatch",
                               ["mismatch/mean_abs_logprob_diff", "mismatch/max_abs_logprob_diff"],
                               ylabel="|Δ logprob|", log_y=True),
        "step_time": _step_time_stack(rows, out_dir / "step_time.png"),
    }
    written = [r for r in results.values() if isinstance(r, Path)]
    skipped = {name: r for name, r in results.items() if isinstance(r, str)}
    return written, skipped
