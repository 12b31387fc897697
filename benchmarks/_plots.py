"""What every benchmark repeats: a headless figure of panels, accuracy axes, saving; the results JSON."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def panels(rows: int, cols: int, size: tuple[float, float] = (5.5, 4.0), **kwargs: Any) -> tuple[Any, Any]:
    """A figure of rows x cols panels (axes always 2-D), drawn without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=(size[0] * cols, size[1] * rows), squeeze=False, **kwargs)


def accuracy_axes(ax: Any, xlabel: str, ylabel: str, title: str | None = None, target: float | None = None) -> None:
    """Labels, a 0-1 y range, the target line (if any) and the legend."""
    if target is not None:
        ax.axhline(target, color="grey", ls="--", lw=1)
    if title:
        ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)


def save(fig: Any, title: str, path: Path) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write_result(out_dir: str | Path, name: str, result: dict[str, Any]) -> Path:
    """`result` as `out_dir/name` (indented JSON), the folder made if missing; says where."""
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return path
