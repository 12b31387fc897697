"""`gui_click`: open a named menu of a synthetic desktop and click a named item in it — two
actions through the `gui` tool (mmrl/tools/gui.py), each answered with the next screenshot.

    mmrl data build gui_click --out DIR [layout=fixed|random] [grid=8]

Each sample is the first screenshot (`KEY.png`) and `KEY.json` with the instruction as prompt,
the target item as answer and the desktop in `metadata["gui"]` (the tool rebuilds the
environment from it; success is the environment's state, not text). The prompt tells the model
how to act: `click X Y` with X, Y the column and row of a `grid` x `grid` grid over the screen
(default 8; the `bare` parser reads a turn that starts with a function name as a call; the
tool's `grid` must match). A grid too coarse for some target (no cell centre on it) is refused
at build time. `marks=true` draws set-of-marks tags instead (the tool's `marks: true`): each
clickable element carries a number and the call is `click N`, one digit, which is what lets a
tiny random policy find a first success by sampling (configs/gui_click.yaml).
`layout=fixed` (default) keeps one desktop and draws only the task (3 menus x 3 items): the
instruction decides both clicks, which a tiny random VLM can learn by RL; `random` draws menus,
items and the window per sample as well. Without the tool no answer can succeed: the task is
done only by clicking.
"""
from __future__ import annotations

import io
from typing import Any

import numpy as np

from mmrl.plugins.data.recipes._common import build_splits
from mmrl.registry import register
from mmrl.tools.gui import DesktopSpec, GuiTask, expert_actions, render_screen

GRID = 8  # the default grid


def prompt_suffix(grid: int, marks: bool = False) -> str:
    if marks:
        return " Act with: click N (N = the number on the element's tag)."
    return f" Act with: click X Y (X, Y = column and row, 0-{grid - 1})."


def _fixed_tasks() -> list[str]:
    spec = DesktopSpec.generate(0, layout="fixed")
    return [f"{e.menu}/{e.label}" for e in spec.elements if e.kind == "item"]


@register("dataset", "gui_click")
def build(out_dir: str, *, train_size: int = 4096, heldout_size: int = 128, layout: str = "fixed",
          width: int = 256, height: int = 256, grid: int = GRID, marks: bool = False,
          shard_size: int = 1024, seed: int = 0) -> dict[str, Any]:
    """Synthetic GUI task: open the named menu, click the named item (see the module docstring)."""
    if isinstance(grid, bool) or not isinstance(grid, int) or grid < 2:
        raise ValueError(f"grid must be an integer of at least 2, got {grid!r}")
    if not isinstance(marks, bool):
        raise ValueError(f"marks must be true or false, got {marks!r}")
    labels = _fixed_tasks() if layout == "fixed" else ["gui_click"]

    def make(label: str, rng: np.random.Generator, split: str, i: int) -> dict[str, Any]:
        spec = DesktopSpec.generate(rng, task="gui_click", width=width, height=height, layout=layout)
        if layout == "fixed":  # the balanced label is the task
            menu, item = label.split("/")
            spec.task = GuiTask("gui_click", menu=menu, item=item)
            spec.validate()
        try:
            expert_actions(spec, grid=None if marks else grid, marks=marks)
        except ValueError as e:
            raise ValueError(f"gui_click sample {split}/{i}: {e} (build with a larger grid=N)") from None
        buf = io.BytesIO()
        render_screen(spec, marks=marks).save(buf, format="PNG")
        meta = {"split": split, "index": i, "gui": spec.to_dict()}
        return {"json": {"prompt": spec.task.instruction + prompt_suffix(grid, marks), "answer": spec.task.item, "metadata": meta},
                "png": buf.getvalue()}

    return build_splits(
        out_dir, recipe="gui_click",
        args={"train_size": train_size, "heldout_size": heldout_size, "layout": layout, "width": width,
              "height": height, "grid": grid, "marks": marks, "shard_size": shard_size, "seed": seed},
        labels=labels, salt=0x6C1C, make=make, train_size=train_size, heldout_size=heldout_size,
        shard_size=shard_size, seed=seed, extra={"grid": grid, "marks": marks})
