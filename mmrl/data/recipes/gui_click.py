"""`gui_click`: open a named menu of a synthetic desktop and click a named item in it — two
actions through the `gui` tool (mmrl/tools/gui.py), each answered with the next screenshot.

    mmrl data build gui_click --out DIR [--layout fixed|random]

Each sample is the first screenshot (`KEY.png`) and `KEY.json` with the instruction as prompt,
the target item as answer and the desktop in `metadata["gui"]` (the tool rebuilds the
environment from it; success is the environment's state, not text). The prompt tells the model
how to act: `click X Y` with X, Y the column and row of an 8 x 8 grid over the screen (the
`bare` parser reads a turn that starts with a function name as a call; the tool's `grid: 8`).
`layout=fixed` (default) keeps one desktop and draws only the task (3 menus x 3 items): the
instruction decides both clicks, which a tiny random VLM can learn by RL; `random` draws menus,
items and the window per sample as well. Without the tool no answer can succeed: the task is
done only by clicking.
"""
from __future__ import annotations

import io
from typing import Any

import numpy as np

from mmrl.data.recipes._common import build_splits
from mmrl.registry import register
from mmrl.tools.gui import DesktopSpec, GuiTask, render_screen

GRID = 8
PROMPT_SUFFIX = f" Act with: click X Y (X, Y = column and row, 0-{GRID - 1})."


def _fixed_tasks() -> list[str]:
    spec = DesktopSpec.generate(0, layout="fixed")
    return [f"{e.menu}/{e.label}" for e in spec.elements if e.kind == "item"]


@register("dataset", "gui_click")
def build(out_dir: str, *, train_size: int = 4096, heldout_size: int = 128, layout: str = "fixed",
          width: int = 256, height: int = 256, shard_size: int = 1024, seed: int = 0) -> dict[str, Any]:
    """Synthetic GUI task: open the named menu, click the named item (see the module docstring)."""
    labels = _fixed_tasks() if layout == "fixed" else ["gui_click"]

    def make(label: str, rng: np.random.Generator, split: str, i: int) -> dict[str, Any]:
        spec = DesktopSpec.generate(rng, task="gui_click", width=width, height=height, layout=layout)
        if layout == "fixed":  # the balanced label is the task
            menu, item = label.split("/")
            spec.task = GuiTask("gui_click", menu=menu, item=item)
            spec.validate()
        buf = io.BytesIO()
        render_screen(spec).save(buf, format="PNG")
        meta = {"split": split, "index": i, "gui": spec.to_dict()}
        return {"json": {"prompt": spec.task.instruction + PROMPT_SUFFIX, "answer": spec.task.item, "metadata": meta},
                "png": buf.getvalue()}

    return build_splits(
        out_dir, recipe="gui_click",
        args={"train_size": train_size, "heldout_size": heldout_size, "layout": layout, "width": width,
              "height": height, "shard_size": shard_size, "seed": seed},
        labels=labels, salt=0x6C1C, make=make, train_size=train_size, heldout_size=heldout_size,
        shard_size=shard_size, seed=seed, extra={"grid": GRID})
