"""`gui`: a synthetic desktop the model operates by clicking and typing (plugin kind "tool").

The screen (default 256x256) is drawn with Pillow from a `DesktopSpec`: a menu bar with three
menus (each opens a drop-down of 2-3 items) and one window with a title bar, a label, a text
field and 2-3 buttons. `DesktopSpec.generate(seed, task=...)` draws layout and task from a seed;
the spec is plain data (`to_dict`/`from_dict`, JSON-able), so a dataset sample carries it in
`sample.metadata["gui"]` and stores `render_screen(spec)` (the initial screenshot) as its image.

Tasks (`GuiTask.kind`; `GuiTask.instruction` is the sentence for the prompt):
  * "gui_click":  open menu M, then click item I in it (two clicks);
  * "gui_button": click the button labelled B (one click);
  * "gui_type":   click the text field, type word W, then click button B (three calls).

`GuiEnvironment` (tool "gui", built once per trajectory from the sample) offers `click(x, y)` and
`type(text)`; every call changes the state and returns a short text plus the NEXT screenshot.
  * A click on a menu header opens that menu (closes it if already open). While a menu is open,
    its items lie on top of everything and a click anywhere else only closes it (as desktops do).
  * Menu items and buttons are commands: running one ENDS the episode (done=True). Success iff
    it is the task's target (for gui_type: and the field then holds exactly W). A wrong command
    is an irrecoverable failure: a real application would already have done the wrong thing.
  * A click on the field focuses it; `type` appends to the focused field (refused otherwise).
  * A click on nothing interactive changes nothing ("nothing there").
  * Bad calls (unknown function or argument, non-numbers, off-screen points, typing with no
    focus, any call after the end) raise ToolError. Every call counts as a step; refused ones
    also count as errors. `max_steps` (tool args) ends an unfinished episode unsuccessfully.
`state()` = {"success", "done", "steps", "errors", "progress", ...}, judged from the
environment's state, never from text; `progress` (0..1) is the fraction of the task's milestones
reached (target menu opened / field focused / word typed / target command), for shaped rewards.

Coordinates are pixels of the screenshot by default. With `grid=N` (tool args) the model names a
cell of an N x N grid instead, click(x=column, y=row) in 0..N-1 meaning that cell's centre pixel,
so a tiny model emits two small integers. Every target is at least 40 px a side, so with
N >= max(width, height) / 40 each one contains a cell centre (`expert_actions` finds it).
With `marks=True` (set-of-marks prompting) every element that can be clicked in the current
state carries a small numbered tag in the screenshot and the model calls click(mark) with that
number: one small integer per action. Tags are numbered in a fixed order (`clickable`): menus,
the field, buttons while no menu is open; the menus, then the open menu's items, while one is.
`list_marks=True` also lists the tags of the new screen in the tool's text after each action
(`marks_text`: "Marks: 0 'File' 1 'Edit' 2 'View' 3 'New' ..."), as an accessibility tree
would: the numbers a click may use are then tokens in the context, not only pixels.
`open_menus=True` (with marks) adds `open(mark)`: open the menu tagged `mark` (a menu header's
tag only; an open menu stays open, another one replaces it), and `click` then refuses menu
headers: headers are for `open`, items, buttons and the field for `click`. (With header clicks
allowed, the gui_click run's second step settled on clicking the header it had just opened, a
valid call that closed the menu: for one menu of three every sample did it from step ~300 on,
every group's reward the same, no gradient left to find the items.) A two-step task can then be written
with one verb per step (`tool_choice: [open, click]` in the multi_turn loop): "open" and "click"
are different contexts for the number that follows, so what RL teaches the first step (menu
numbers up, the others down) does not carry over to the second, where the items' numbers must be
found. With `click` for both steps the first step's training pushed the items' numbers (invalid
or wrong there) so far down that the second step found the target 3 times in 180 steps x 256
samples (configs/gui_click.yaml).
A menu keeps its number in both states, so an item is never tagged with the number the menu
was opened by (with items first, a policy that repeated its first number clicked the first item
of every menu: success 1/3 of the fixed layout's tasks, a trap RL did not leave in 140 steps).
"""
from __future__ import annotations

import json
import math
import threading
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from mmrl.registry import register
from mmrl.tools.base import Tool, ToolError, ToolResult

__all__ = ["DesktopSpec", "Element", "GuiEnvironment", "GuiTask", "TASKS", "cell_centre",
           "cell_for_box", "clickable", "expert_actions", "marks_text", "render_screen", "spec_from_sample"]

TASKS = ("gui_click", "gui_button", "gui_type")
MENU_NAMES = ("File", "Edit", "View", "Tools", "Window", "Help")
ITEM_NAMES = ("New", "Open", "Save", "Print", "Undo", "Copy", "Paste", "Find", "Zoom", "About",
              "Reload", "Quit")
# Disjoint from ITEM_NAMES, so "click 'X'" never names both a button and an item.
BUTTON_NAMES = ("OK", "Cancel", "Apply", "Close", "Next", "Back", "Send", "Reset")
TITLES = ("Settings", "Editor", "Login", "Search", "Notes", "Mail")
LABELS = ("Name:", "Word:", "Text:", "Query:")
WORDS = ("cat", "dog", "sun", "tree", "fish", "moon", "blue", "star")
BACKGROUNDS = ((58, 110, 165), (46, 139, 87), (112, 86, 150), (90, 90, 100))

# Geometry (pixels). Targets are >= 40 px a side: big enough for a low-resolution vision tower.
BAR_H, MENU_W, MENU_GAP, ITEM_W, ITEM_H = 40, 64, 4, 112, 40
TITLE_H, FIELD_H, BUTTON_H, WINDOW_H, MIN_WINDOW_W = 24, 40, 40, 152, 208
MIN_WIDTH, MIN_HEIGHT = 224, BAR_H + 8 + WINDOW_H + 8
MAX_TEXT = 24  # characters the field holds
KINDS = ("menu", "item", "button", "field", "label")
COMMANDS = ("item", "button")  # clicking one ends the episode

INK, GREY, WHITE, FOCUS = (30, 30, 30), (150, 150, 150), (255, 255, 255), (40, 100, 220)
MARK_BG = (200, 30, 30)  # set-of-marks tags: white digits on red, in each element's top-left corner
BAR_BG, WINDOW_BG, TITLE_BG, BUTTON_BG, HILITE = (225, 225, 225), (240, 240, 240), (50, 70, 120), \
    (205, 210, 220), (40, 80, 170)


@dataclass
class Element:
    """One thing on screen. `box` is [x0, y0, x1, y1), pixels, half-open; `menu` names the menu
    an item belongs to (items are only visible, and clickable, while their menu is open)."""

    kind: str
    label: str
    box: list[int]
    menu: str = ""

    @property
    def key(self) -> str:
        if self.kind == "item":
            return f"item:{self.menu}/{self.label}"
        return self.kind if self.kind in ("field", "label") else f"{self.kind}:{self.label}"

    @property
    def centre(self) -> tuple[int, int]:
        x0, y0, x1, y1 = self.box
        return (x0 + x1) // 2, (y0 + y1) // 2

    def contains(self, x: int, y: int) -> bool:
        x0, y0, x1, y1 = self.box
        return x0 <= x < x1 and y0 <= y < y1


@dataclass
class GuiTask:
    """What to achieve; only the fields of its `kind` are set (see the module docstring)."""

    kind: str
    menu: str = ""
    item: str = ""
    button: str = ""
    text: str = ""

    @property
    def instruction(self) -> str:
        if self.kind == "gui_click":
            return f"Open the '{self.menu}' menu and click '{self.item}'."
        if self.kind == "gui_button":
            return f"Click the '{self.button}' button."
        return f"Type '{self.text}' into the text field, then click the '{self.button}' button."

    def target_key(self) -> str:
        """The key of the command that completes the task."""
        return f"item:{self.menu}/{self.item}" if self.kind == "gui_click" else f"button:{self.button}"


@dataclass
class DesktopSpec:
    """A desktop layout and its task: plain data, equal after a JSON round trip."""

    width: int
    height: int
    title: str
    background: list[int]
    window: list[int]
    elements: list[Element]
    task: GuiTask
    seed: Any = None  # int or list of ints it was generated from (None: from a Generator)

    @classmethod
    def generate(cls, seed: int | list[int] | np.random.Generator, task: str = "gui_click",
                 width: int = 256, height: int = 256, layout: str = "random") -> "DesktopSpec":
        """A layout and a task drawn from `seed` (a dataset recipe passes its per-sample rng).
        `task`: one of TASKS, or "any" to draw it too. The order of the draws is the output.
        `layout="fixed"`: the same desktop every time (the first three menus with three items
        each, the first window, title and buttons), only the task is drawn: a curriculum step
        where the instruction alone decides the clicks, which a tiny VLM can learn by RL."""
        if layout not in ("random", "fixed"):
            raise ValueError(f"layout must be 'random' or 'fixed', got {layout!r}")
        if task not in TASKS + ("any",):
            raise ValueError(f"task must be one of {', '.join(TASKS)} or 'any', got {task!r}")
        if width < MIN_WIDTH or height < MIN_HEIGHT:
            raise ValueError(f"the screen must be at least {MIN_WIDTH}x{MIN_HEIGHT}, got {width}x{height}")
        rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        pick = lambda names, n: [names[i] for i in rng.choice(len(names), n, replace=False)]  # noqa: E731
        if layout == "fixed":
            background, title, label = list(BACKGROUNDS[0]), TITLES[0], LABELS[0]
            menus, sizes = list(MENU_NAMES[:3]), [3, 3, 3]
            items, buttons = iter(ITEM_NAMES[:9]), list(BUTTON_NAMES[:2])
            ww = min(width - 16, 200)
            wx, wy = (width - ww) // 2, height - WINDOW_H - 8
        else:
            background = list(BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))])
            title, label = pick(TITLES, 1)[0], pick(LABELS, 1)[0]
            menus = pick(MENU_NAMES, 3)
            sizes = [int(rng.integers(2, 4)) for _ in menus]
            items = iter(pick(ITEM_NAMES, sum(sizes)))
            buttons = pick(BUTTON_NAMES, int(rng.integers(2, 4)))
            ww = int(rng.integers(MIN_WINDOW_W, min(width - 16, 240) + 1))
            wx = int(rng.integers(8, width - ww - 8 + 1))
            wy = int(rng.integers(BAR_H + 8, height - WINDOW_H - 8 + 1))
        elements: list[Element] = []
        for i, (name, n) in enumerate(zip(menus, sizes)):
            x0 = 4 + i * (MENU_W + MENU_GAP)
            elements.append(Element("menu", name, [x0, 0, x0 + MENU_W, BAR_H]))
            dx = min(x0, width - ITEM_W - 2)  # keep the drop-down on screen
            elements += [Element("item", next(items), [dx, BAR_H + j * ITEM_H, dx + ITEM_W, BAR_H + (j + 1) * ITEM_H],
                                 menu=name) for j in range(n)]
        elements.append(Element("label", label, [wx + 12, wy + 30, wx + ww - 12, wy + 48]))
        elements.append(Element("field", "", [wx + 12, wy + 50, wx + ww - 12, wy + 50 + FIELD_H]))
        bw = (ww - 24 - (len(buttons) - 1) * 8) // len(buttons)
        for i, name in enumerate(buttons):
            x0 = wx + 12 + i * (bw + 8)
            elements.append(Element("button", name, [x0, wy + 102, x0 + bw, wy + 102 + BUTTON_H]))
        kind = task if task != "any" else TASKS[int(rng.integers(len(TASKS)))]
        if kind == "gui_click":
            menu = menus[int(rng.integers(len(menus)))]
            names = [e.label for e in elements if e.kind == "item" and e.menu == menu]
            goal = GuiTask(kind, menu=menu, item=names[int(rng.integers(len(names)))])
        elif kind == "gui_button":
            goal = GuiTask(kind, button=buttons[int(rng.integers(len(buttons)))])
        else:
            goal = GuiTask(kind, text=WORDS[int(rng.integers(len(WORDS)))],
                           button=buttons[int(rng.integers(len(buttons)))])
        stored = int(seed) if isinstance(seed, (int, np.integer)) else \
            None if isinstance(seed, np.random.Generator) else [int(s) for s in seed]
        spec = cls(width, height, title, background, [wx, wy, wx + ww, wy + WINDOW_H], elements, goal, stored)
        spec.validate()
        return spec

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | str) -> "DesktopSpec":
        """The spec of `to_dict()` (or its JSON text); ValueError if it is not one."""
        if isinstance(data, str):
            data = json.loads(data)
        try:
            d = dict(data)
            d["elements"] = [Element(**e) for e in d["elements"]]
            d["task"] = GuiTask(**d["task"])
            spec = cls(**d)
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a gui DesktopSpec dict ({type(e).__name__}: {e})") from None
        spec.validate()
        return spec

    def validate(self) -> None:
        """ValueError unless every element is known, on screen, and the task's target exists."""
        keys = {e.key for e in self.elements}
        for e in self.elements:
            x0, y0, x1, y1 = e.box
            if e.kind not in KINDS or not (0 <= x0 < x1 <= self.width and 0 <= y0 < y1 <= self.height):
                raise ValueError(f"gui spec: bad element {e}")
        if self.task.kind not in TASKS:
            raise ValueError(f"gui spec: task kind must be one of {TASKS}, got {self.task.kind!r}")
        needed = [self.task.target_key()] + (["menu:" + self.task.menu] if self.task.kind == "gui_click" else [])
        missing = [k for k in needed if k not in keys]
        if missing or (self.task.kind == "gui_type" and ("field" not in keys or not self.task.text)):
            raise ValueError(f"gui spec: the task {self.task} names elements that are not on screen")

    def element(self, key: str) -> Element:
        for e in self.elements:
            if e.key == key:
                return e
        raise KeyError(f"no element {key!r}; keys are {[e.key for e in self.elements]}")

    def centres(self) -> dict[str, tuple[int, int]]:
        """The centre pixel of every element by key ("menu:File", "item:File/Save", "button:OK",
        "field", "label"); items are only clickable while their menu is open."""
        return {e.key: e.centre for e in self.elements}

    def hit(self, x: int, y: int, kinds: tuple[str, ...], menu: str | None = None) -> Element | None:
        """The element of `kinds` (items: of `menu`) under pixel (x, y), or None."""
        for e in self.elements:
            if e.kind in kinds and (e.kind != "item" or e.menu == menu) and e.contains(x, y):
                return e
        return None

    def render(self) -> Image.Image:
        return render_screen(self)


_fonts = threading.local()


def _font() -> Any:
    """One font per thread: run_tool runs many trajectories' calls in threads, and a FreeType face
    is not safe to share between them (loading one takes ~0.1 ms)."""
    if not hasattr(_fonts, "font"):
        try:
            _fonts.font = ImageFont.load_default(size=14)  # Pillow >= 10.1 with FreeType
        except TypeError:  # older Pillow: the small bitmap font
            _fonts.font = ImageFont.load_default()
    return _fonts.font


def _text(draw: ImageDraw.ImageDraw, box: list[int], text: str, fill: tuple[int, int, int],
          left: int | None = None) -> None:
    """`text` centred in `box` (vertically; horizontally too unless `left` padding is given).
    Computed from textbbox rather than anchors, so the bitmap fallback font works too."""
    l, t, r, b = draw.textbbox((0, 0), text, font=_font())
    x = box[0] + left if left is not None else (box[0] + box[2] - (r - l)) // 2 - l
    draw.text((x, (box[1] + box[3] - (b - t)) // 2 - t), text, fill=fill, font=_font())


def _rect(draw: ImageDraw.ImageDraw, box: list[int], fill: Any, outline: Any = None, width: int = 1) -> None:
    draw.rectangle([box[0], box[1], box[2] - 1, box[3] - 1], fill=fill, outline=outline, width=width)


def clickable(spec: DesktopSpec, open_menu: str | None = None) -> list[Element]:
    """What a click can hit in a state, in set-of-marks order (see the module docstring)."""
    menus = [e for e in spec.elements if e.kind == "menu"]
    if open_menu is not None:  # menus keep their numbers: repeating the first click is no shortcut
        return menus + [e for e in spec.elements if e.kind == "item" and e.menu == open_menu]
    return menus + [e for e in spec.elements if e.kind == "field"] + [e for e in spec.elements if e.kind == "button"]


def marks_text(spec: DesktopSpec, open_menu: str | None = None) -> str:
    """The tags of a state as text, the screen's accessibility list: "Marks: 0 'File' 1 'Edit' ..."."""
    return "Marks: " + " ".join(f"{n} '{e.label or e.kind}'" for n, e in enumerate(clickable(spec, open_menu)))


def render_screen(spec: DesktopSpec, open_menu: str | None = None, focused: bool = False,
                  text: str = "", marks: bool = False) -> Image.Image:
    """The screenshot (RGB, spec.width x spec.height) of `spec` in a state: which menu is open,
    whether the field has focus, what it holds, and (`marks`) the set-of-marks tags.
    `render_screen(spec)` is the initial screen."""
    img = Image.new("RGB", (spec.width, spec.height), tuple(spec.background))
    draw = ImageDraw.Draw(img)
    wx0, wy0, wx1, wy1 = spec.window
    _rect(draw, [wx0 + 3, wy0 + 3, wx1 + 3, wy1 + 3], fill=(40, 40, 40))  # shadow
    _rect(draw, spec.window, fill=WINDOW_BG, outline=INK)
    _rect(draw, [wx0, wy0, wx1, wy0 + TITLE_H], fill=TITLE_BG)
    _text(draw, [wx0, wy0, wx1, wy0 + TITLE_H], spec.title, WHITE, left=8)
    _rect(draw, [0, 0, spec.width, BAR_H], fill=BAR_BG)
    draw.line([0, BAR_H - 1, spec.width - 1, BAR_H - 1], fill=GREY)
    for e in spec.elements:
        if e.kind == "label":
            _text(draw, e.box, e.label, INK, left=0)
        elif e.kind == "field":
            _rect(draw, e.box, fill=WHITE, outline=FOCUS if focused else GREY, width=3 if focused else 1)
            shown = text + ("|" if focused else "")
            while len(shown) > 1 and draw.textlength(shown, font=_font()) > e.box[2] - e.box[0] - 16:
                shown = shown[1:]  # a long text shows its end, as a scrolled field does
            _text(draw, e.box, shown, INK, left=8)
        elif e.kind == "button":
            _rect(draw, e.box, fill=BUTTON_BG, outline=INK, width=2)
            _text(draw, e.box, e.label, INK)
        elif e.kind == "menu":
            is_open = e.label == open_menu
            if is_open:
                _rect(draw, e.box, fill=HILITE)
            _text(draw, e.box, e.label, WHITE if is_open else INK)
    # The drop-down last: it lies on top of the window, as it does on a real desktop.
    for e in spec.elements:
        if e.kind == "item" and e.menu == open_menu:
            _rect(draw, e.box, fill=WHITE, outline=GREY)
            _text(draw, e.box, e.label, INK, left=12)
    if marks:
        for number, e in enumerate(clickable(spec, open_menu)):
            tag = [e.box[0], e.box[1], e.box[0] + 9 * len(str(number)) + 5, e.box[1] + 16]
            _rect(draw, tag, fill=MARK_BG)
            _text(draw, tag, str(number), WHITE)
    return img


def cell_centre(col: int, row: int, width: int, height: int, grid: int) -> tuple[int, int]:
    """The pixel at the centre of cell (col, row) of a grid x grid division of the screen."""
    return int((col + 0.5) * width / grid), int((row + 0.5) * height / grid)


def cell_for_box(box: list[int], width: int, height: int, grid: int) -> tuple[int, int]:
    """The cell whose centre lies in `box`, nearest the box's centre; ValueError if none does."""
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    inside = [(abs(px - cx) + abs(py - cy), c, r) for c in range(grid) for r in range(grid)
              for px, py in [cell_centre(c, r, width, height, grid)]
              if box[0] <= px < box[2] and box[1] <= py < box[3]]
    if not inside:
        raise ValueError(f"no cell centre of a {grid}x{grid} grid lies in {box}; use a finer grid")
    _, c, r = min(inside)
    return c, r


def expert_actions(spec: DesktopSpec, grid: int | None = None,
                   marks: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """The calls (function, arguments) that solve the spec's task, in pixels, grid cells or
    set-of-marks numbers."""
    def click(key: str, open_menu: str | None = None) -> tuple[str, dict[str, Any]]:
        e = spec.element(key)
        if marks:
            return "click", {"mark": [c.key for c in clickable(spec, open_menu)].index(e.key)}
        x, y = e.centre if grid is None else cell_for_box(e.box, spec.width, spec.height, grid)
        return "click", {"x": x, "y": y}

    t = spec.task
    if t.kind == "gui_click":
        return [click("menu:" + t.menu), click(t.target_key(), open_menu=t.menu)]
    if t.kind == "gui_button":
        return [click(t.target_key())]
    return [click("field"), ("type", {"text": t.text}), click(t.target_key())]


def spec_from_sample(sample: Any) -> DesktopSpec:
    """The DesktopSpec in `sample.metadata["gui"]` (a Sample or a record dict); ValueError if none."""
    meta = sample.get("metadata") if isinstance(sample, dict) else getattr(sample, "metadata", None)
    data = (meta or {}).get("gui") if isinstance(meta, dict) else None
    if data is None:
        raise ValueError("tool 'gui' needs a sample whose metadata['gui'] holds a DesktopSpec "
                         "(DesktopSpec.generate(seed).to_dict()); this sample has none")
    return data if isinstance(data, DesktopSpec) else DesktopSpec.from_dict(data)


MILESTONES = {"gui_click": ("menu", "command"), "gui_button": ("command",),
              "gui_type": ("focus", "text", "command")}


@register("tool", "gui")
class GuiEnvironment(Tool):
    """The desktop of `sample.metadata["gui"]` as an environment; see the module docstring."""

    name = "gui"
    description = "A desktop screen you operate by clicking and typing."

    def __init__(self, sample: Any = None, grid: int | None = None, max_steps: int | None = None,
                 marks: bool = False, list_marks: bool = False, open_menus: bool = False):
        super().__init__(sample)
        self.spec = spec_from_sample(sample)
        if not isinstance(marks, bool) or (marks and grid is not None):
            raise ValueError(f"gui: marks must be true or false, and not combined with grid (got marks={marks!r}, "
                             f"grid={grid!r})")
        if not isinstance(list_marks, bool) or (list_marks and not marks):
            raise ValueError(f"gui: list_marks (true or false) needs marks: true, got list_marks={list_marks!r}")
        if not isinstance(open_menus, bool) or (open_menus and not marks):
            raise ValueError(f"gui: open_menus (true or false) needs marks: true, got open_menus={open_menus!r}")
        self.marks, self.list_marks, self.open_menus = marks, list_marks, open_menus
        if grid is not None and not (isinstance(grid, int) and 2 <= grid <= min(self.spec.width, self.spec.height)):
            raise ValueError(f"gui: grid must be an int in 2..{min(self.spec.width, self.spec.height)}, got {grid!r}")
        if max_steps is not None and not (isinstance(max_steps, int) and max_steps >= 1):
            raise ValueError(f"gui: max_steps must be a positive int, got {max_steps!r}")
        self.grid, self.max_steps = grid, max_steps
        self.open_menu: str | None = None
        self.focused, self.text = False, ""
        self.command: str | None = None  # key of the command that ended the episode
        self.steps = self.errors = 0
        self.done = self.success = False
        self.reached: set[str] = set()

    def functions(self) -> list[dict[str, Any]]:
        w, h = self.spec.width, self.spec.height
        if self.marks:
            desc = ("Click the item, button or field tagged with a number in the screenshot (menu headers: open)."
                    if self.open_menus else "Click the element tagged with a number in the screenshot.")
            xy = {"mark": {"type": "integer", "minimum": 0, "description": "the number on the element's tag"}}
        elif self.grid:
            n = self.grid
            desc = f"Click the centre of a cell of the screen divided into a {n}x{n} grid."
            xy = {"x": {"type": "integer", "minimum": 0, "maximum": n - 1, "description": "column, 0 = left"},
                  "y": {"type": "integer", "minimum": 0, "maximum": n - 1, "description": "row, 0 = top"}}
        else:
            desc = f"Click a pixel of the {w}x{h} screenshot."
            xy = {"x": {"type": "integer", "minimum": 0, "maximum": w - 1, "description": "pixels from the left"},
                  "y": {"type": "integer", "minimum": 0, "maximum": h - 1, "description": "pixels from the top"}}
        text = {"text": {"type": "string", "description": "characters to append to the focused text field"}}
        out = [{"type": "function", "function": {"name": "click", "description": desc,
                "parameters": {"type": "object", "properties": xy, "required": sorted(xy)}}},
               {"type": "function", "function": {"name": "type", "description": "Type into the focused text field.",
                "parameters": {"type": "object", "properties": text, "required": ["text"]}}}]
        if self.open_menus:
            out.append({"type": "function", "function": {
                "name": "open", "description": "Open the menu whose header is tagged with a number in the screenshot.",
                "parameters": {"type": "object", "properties": xy, "required": sorted(xy)}}})
        return out

    def screenshot(self) -> Image.Image:
        return render_screen(self.spec, self.open_menu, self.focused, self.text, self.marks)

    def to_pixels(self, x: Any, y: Any) -> tuple[int, int]:
        """Validated click arguments -> a pixel of the screen (ToolError if they are bad)."""
        limits = (self.grid, self.grid) if self.grid else (self.spec.width, self.spec.height)
        unit = "grid cells" if self.grid else "pixels"
        for name, v, n in (("x", x, limits[0]), ("y", y, limits[1])):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ToolError(f"{name} must be a number, got {v!r}")
            if self.grid and v != int(v):
                raise ToolError(f"{name} must be a whole grid cell, got {v!r}")
            if not 0 <= v < n:
                raise ToolError(f"{name}={v!r} is off the screen: {unit} go from 0 to {n - 1}")
        if self.grid:
            return cell_centre(int(x), int(y), self.spec.width, self.spec.height, self.grid)
        return int(x), int(y)

    def mark_pixel(self, mark: Any) -> tuple[int, int]:
        """The centre of the element tagged `mark` in the current screenshot (ToolError if none)."""
        tagged = clickable(self.spec, self.open_menu)
        if isinstance(mark, float) and mark.is_integer():
            mark = int(mark)
        if isinstance(mark, bool) or not isinstance(mark, int) or not 0 <= mark < len(tagged):
            raise ToolError(f"mark must be one of the numbers on screen, 0 to {len(tagged) - 1}, got {mark!r}")
        return tagged[mark].centre

    def call(self, function: str, arguments: dict[str, Any]) -> ToolResult:
        self.steps += 1
        try:
            if self.done:
                raise ToolError("the episode is over; no more actions")
            known = ["click(mark)" if self.marks else "click(x, y)", "type(text)"] + (["open(mark)"] if self.open_menus else [])
            if function not in [k.split("(")[0] for k in known]:
                raise ToolError(f"unknown function {function!r}; use {', '.join(known)}")
            wanted = {"text"} if function == "type" else ({"mark"} if self.marks else {"x", "y"})
            if not isinstance(arguments, dict) or set(arguments) != wanted:
                raise ToolError(f"{function} takes exactly {sorted(wanted)}, got {arguments!r}")
            if function == "type":
                text = self._type(arguments["text"])
            elif function == "open":
                text = self._open(arguments["mark"])
            elif self.marks:
                x, y = self.mark_pixel(arguments["mark"])
                if self.open_menus and self.spec.hit(x, y, ("menu",)) is not None:
                    raise ToolError(f"click takes the tag of an item, a button or the field; menu headers are opened "
                                    f"with open(mark), got {arguments['mark']!r}")
                text = self._click(x, y)
            else:
                text = self._click(*self.to_pixels(arguments["x"], arguments["y"]))
        except ToolError as e:
            self.errors += 1
            if self._used_last_step():
                raise ToolError(f"{e}; step limit reached, episode over") from None
            raise
        if self._used_last_step():
            text += "; step limit reached"
        if self.done:
            text += " (episode over)"
        elif self.list_marks:
            text += ". " + marks_text(self.spec, self.open_menu)
        return ToolResult(text=text, images=[self.screenshot()], done=self.done)

    def _used_last_step(self) -> bool:
        """True (and the episode ends, unsuccessfully) if this call used up `max_steps`."""
        if self.done or self.max_steps is None or self.steps < self.max_steps:
            return False
        self.done = True
        return True

    def _click(self, x: int, y: int) -> str:
        spec, task = self.spec, self.spec.task
        if self.open_menu is not None:  # an open menu takes the click, whatever it hits
            item = spec.hit(x, y, ("item",), menu=self.open_menu)
            if item is not None:
                self.open_menu = None
                return self._run(item)
            header = spec.hit(x, y, ("menu",))
            if header is None or header.label == self.open_menu:
                closed, self.open_menu = self.open_menu, None
                return f"closed menu '{closed}'"
        e = spec.hit(x, y, ("menu", "button", "field"))
        if e is None:
            return "nothing there"
        if e.kind == "menu":
            self.open_menu = e.label
            if task.kind == "gui_click" and e.label == task.menu:
                self.reached.add("menu")
            return f"opened menu '{e.label}'"
        if e.kind == "field":
            self.focused = True
            self.reached.add("focus")
            return "focused the text field"
        return self._run(e)

    def _open(self, mark: Any) -> str:
        x, y = self.mark_pixel(mark)
        header = self.spec.hit(x, y, ("menu",))
        if header is None:
            menus = [i for i, e in enumerate(clickable(self.spec, self.open_menu)) if e.kind == "menu"]
            raise ToolError(f"open takes the tag of a menu header ({', '.join(map(str, menus))}), got {mark!r}")
        if header.label == self.open_menu:
            return f"menu '{header.label}' is open"
        return self._click(x, y)  # opens it (replacing an open one)

    def _run(self, e: Element) -> str:
        """Run a command (menu item or button): the episode ends, successfully iff it was the target."""
        task = self.spec.task
        self.command, self.done = e.key, True
        self.success = e.key == task.target_key() and (task.kind != "gui_type" or self.text == task.text)
        if self.success:
            self.reached.add("command")
        return f"clicked '{e.label}' in menu '{e.menu}'" if e.kind == "item" else f"clicked button '{e.label}'"

    def _type(self, text: Any) -> str:
        if not isinstance(text, str) or not text or not text.isprintable():
            raise ToolError(f"text must be a non-empty printable string, got {text!r}")
        if not self.focused:
            raise ToolError("no text field has focus: click the text field first")
        if len(self.text) + len(text) > MAX_TEXT:
            raise ToolError(f"the text field holds at most {MAX_TEXT} characters")
        self.text += text
        if self.spec.task.kind == "gui_type" and self.text == self.spec.task.text:
            self.reached.add("text")
        return f"typed '{text}'"

    def state(self) -> dict[str, Any]:
        milestones = MILESTONES[self.spec.task.kind]
        return {"success": self.success, "done": self.done, "steps": self.steps, "errors": self.errors,
                "progress": sum(m in self.reached for m in milestones) / len(milestones),
                "task": self.spec.task.kind, "command": self.command, "open_menu": self.open_menu,
                "focused": self.focused, "field_text": self.text}
