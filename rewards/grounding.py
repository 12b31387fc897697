"""Grounding reward: IoU / GIoU of the predicted box with the answer box, reading the image size
from the sample's image.

Boxes are parsed from the response in any of these forms (all boxes, in order of appearance):
  * JSON or Python-dict style: {"bbox_2d": [x1, y1, x2, y2]} (Qwen2.5-VL / Qwen3-VL), "bbox",
    "box", "box_2d", including lists of such objects and ```json fences;
  * Qwen2-VL box tokens: <|box_start|>(x1,y1),(x2,y2)<|box_end|> (0-1000 relative coordinates);
  * plain [x1, y1, x2, y2] or (x1, y1, x2, y2), and corner pairs (x1,y1),(x2,y2) / [[x1,y1],[x2,y2]].
Corners given in the wrong order are swapped; a box with no area scores 0.

Coordinate frames (`coords` for the response, `answer_coords` for the answer):
  "abs"       pixels of the image given to the reward;
  "rel"       fractions of the width/height, 0-1;
  "qwen1000"  0-1000 relative (Qwen2-VL box tokens, Qwen3-VL boxes);
  "grid"      cells of a `grid` x `grid` partition of the image ([1, 0, 2, 1]: the cell in column
              1, row 0 of a 3x3 grid): single-digit coordinates, for a model whose tokenizer
              splits numbers into digits (data/recipes/grounding.py, layout=grid);
  "auto"      box tokens -> qwen1000; every value <= 1 -> rel; inside the image -> abs;
              beyond the image but <= 1000 -> qwen1000; otherwise abs.
Both boxes are converted to fractions of the image (clipped to it) before comparing; the size
comes from `images[0]`, else metadata["image_size"] ([W, H]). Note: Qwen2.5-VL answers in
pixels of the *processor-resized* image; if the processor resizes, prefer coords="rel" prompts
or resize the answer accordingly.
"""
from __future__ import annotations

import math
import re
from typing import Any, Mapping, Sequence

from mmrl.registry import register
from mmrl.plugins.rewards._text import MAX_CHARS, NUMBER, answer_span, as_text, head

__all__ = ["grounding_iou", "grounding_format", "parse_boxes", "box_iou_giou", "COORD_FRAMES"]

COORD_FRAMES = ("auto", "abs", "rel", "qwen1000", "grid")
_MAX_BOXES = 100
_N = rf"\s*({NUMBER})\s*"
_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("qwen", re.compile(rf"<\|box_start\|>\s*\({_N},{_N}\)\s*,?\s*\({_N},{_N}\)\s*<\|box_end\|>")),
    ("json", re.compile(r"[\"']?(?:bbox_2d|bbox|box_2d|box)[\"']?\s*[:=]\s*"
                        rf"[\[\(]{_N},{_N},{_N},{_N}[\]\)]", re.I)),
    ("pairs", re.compile(rf"[\[\(]\s*[\[\(]{_N},{_N}[\]\)]\s*,\s*[\[\(]{_N},{_N}[\]\)]\s*[\]\)]")),
    ("pairs", re.compile(rf"[\[\(]{_N},{_N}[\]\)]\s*,\s*[\[\(]{_N},{_N}[\]\)]")),
    ("plain", re.compile(rf"[\[\(]{_N},{_N},{_N},{_N}[\]\)]")),
]

Box = tuple[float, float, float, float]


def parse_boxes(text: Any) -> list[tuple[Box, str]]:
    """Every box in the text as ((x1, y1, x2, y2), source) in order of appearance; source is
    "qwen" (box tokens), "json", "pairs" or "plain". Overlapping matches keep the first pattern's."""
    s = head(answer_span(text), MAX_CHARS)
    taken: list[tuple[int, int]] = []
    found: list[tuple[int, Box, str]] = []
    for source, pat in _PATTERNS:
        for m in pat.finditer(s):
            a, b = m.span()
            if any(a < e and b > st for st, e in taken):
                continue
            try:
                vals = tuple(float(v) for v in m.groups())
            except ValueError:
                continue
            if len(vals) != 4 or not all(math.isfinite(v) for v in vals):
                continue
            taken.append((a, b))
            found.append((a, vals, source))  # type: ignore[arg-type]
            if len(found) >= 4 * _MAX_BOXES:
                break
    found.sort(key=lambda t: t[0])
    return [(box, source) for _, box, source in found[:_MAX_BOXES]]


def _answer_boxes(answer: Any) -> list[tuple[Box, str]]:
    """Gold boxes from [x1,y1,x2,y2], a list of those, {"bbox_2d": [...]}, or text."""
    if answer is None:
        return []
    if isinstance(answer, Mapping):
        for k in ("bbox_2d", "bbox", "box", "box_2d"):
            if k in answer:
                return _answer_boxes(answer[k])
        return []
    if isinstance(answer, (str, bytes)):
        return parse_boxes(as_text(answer))
    if isinstance(answer, Sequence) or hasattr(answer, "tolist"):
        items = answer.tolist() if hasattr(answer, "tolist") else list(answer)
        if len(items) == 4 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items):
            vals = tuple(float(v) for v in items)
            return [(vals, "plain")] if all(math.isfinite(v) for v in vals) else []  # type: ignore[list-item]
        out: list[tuple[Box, str]] = []
        for item in items[:_MAX_BOXES]:
            out.extend(_answer_boxes(item))
        return out
    return []


def _image_size(images: Any, metadata: Any) -> tuple[float, float] | None:
    img = images[0] if isinstance(images, (list, tuple)) and images else images
    size = getattr(img, "size", None)
    if isinstance(size, tuple) and len(size) == 2 and size[0] > 0 and size[1] > 0:
        return float(size[0]), float(size[1])
    if isinstance(metadata, Mapping):
        ms = metadata.get("image_size")
        if isinstance(ms, (list, tuple)) and len(ms) == 2 and all(isinstance(v, (int, float)) for v in ms):
            if ms[0] > 0 and ms[1] > 0:
                return float(ms[0]), float(ms[1])
    return None


def _frame(box: Box, source: str, coords: str, size: tuple[float, float] | None) -> str:
    if coords != "auto":
        return coords
    if source == "qwen":
        return "qwen1000"
    hi = max(abs(v) for v in box)
    if hi <= 1.0:
        return "rel"
    if size is None:
        return "abs"
    w, h = size
    if max(box[0], box[2]) <= w + 1 and max(box[1], box[3]) <= h + 1:
        return "abs"
    return "qwen1000" if hi <= 1000 else "abs"


def _to_rel(box: Box, frame: str, size: tuple[float, float] | None, grid: int | None = None) -> Box:
    """The box as fractions of the image, corners ordered, clipped to [0, 1] when the size is known
    (pixels stay pixels when the size is unknown: the caller checked both boxes are in pixels)."""
    x1, y1, x2, y2 = box
    if frame == "rel":
        sx = sy = 1.0
    elif frame == "qwen1000":
        sx = sy = 1000.0
    elif frame == "grid":
        sx = sy = float(grid)  # type: ignore[arg-type]  # checked by grounding_iou
    elif frame == "abs":
        sx, sy = size if size is not None else (1.0, 1.0)  # no size: both boxes are pixels (checked)
    else:
        raise ValueError(f"grounding_iou: unknown coordinate frame {frame!r}; use one of {COORD_FRAMES}")
    x1, x2 = sorted((x1 / sx, x2 / sx))
    y1, y2 = sorted((y1 / sy, y2 / sy))
    if size is not None or frame in ("qwen1000", "grid"):
        x1, x2, y1, y2 = (min(max(v, 0.0), 1.0) for v in (x1, x2, y1, y2))
    return x1, y1, x2, y2


def box_iou_giou(p: Box, g: Box) -> tuple[float, float]:
    """(IoU, GIoU) of two boxes with ordered corners; a box without area gives (0, -1)."""
    ap = (p[2] - p[0]) * (p[3] - p[1])
    ag = (g[2] - g[0]) * (g[3] - g[1])
    if ap <= 0 or ag <= 0:
        return 0.0, -1.0
    iw = max(0.0, min(p[2], g[2]) - max(p[0], g[0]))
    ih = max(0.0, min(p[3], g[3]) - max(p[1], g[1]))
    inter = iw * ih
    union = ap + ag - inter
    hull = (max(p[2], g[2]) - min(p[0], g[0])) * (max(p[3], g[3]) - min(p[1], g[1]))
    iou = inter / union
    giou = iou - (hull - union) / hull
    return iou, giou


@register("reward", "grounding_iou")
def grounding_iou(response: str, answer: Any, images: Any = None, metadata: Any = None, *,
                  coords: str = "auto", answer_coords: str = "abs", multiple: str = "first",
                  metric: str = "iou", grid: int | None = None) -> dict[str, float]:
    """IoU of the response's box with the answer box (answer: [x1, y1, x2, y2], default pixels).

    coords / answer_coords: "auto" | "abs" | "rel" | "qwen1000" | "grid" (module docstring; "grid"
    needs `grid`, the cells per side).
    multiple: "first" (the first box in the response counts; default, as listing many boxes
    must not pay) or "best" (the best-matching one). metric: "iou" (score = IoU) or "giou"
    (score = (GIoU + 1) / 2, in [0, 1], which still rewards a near miss). Several answer boxes:
    the best-matching one counts. Components: iou, giou (in [-1, 1]), parsed (a box was found),
    n_boxes (boxes found in the response).
    """
    for name, val, allowed in (("coords", coords, COORD_FRAMES), ("answer_coords", answer_coords, COORD_FRAMES),
                               ("multiple", multiple, ("first", "best")), ("metric", metric, ("iou", "giou"))):
        if val not in allowed:
            raise ValueError(f"grounding_iou: {name}={val!r}; allowed: {', '.join(allowed)}")
    if "grid" in (coords, answer_coords) and (isinstance(grid, bool) or not isinstance(grid, int) or grid < 1):
        raise ValueError(f"grounding_iou: coords='grid' needs grid=N, the cells per side of the image (a positive "
                         f"integer, e.g. 3 for data built with layout=grid grid_cells=3), got grid={grid!r}")
    preds = parse_boxes(response)
    golds = _answer_boxes(answer)
    out = {"score": 0.0, "iou": 0.0, "giou": -1.0, "parsed": 1.0 if preds else 0.0, "n_boxes": float(len(preds))}
    if not preds or not golds:
        return out
    size = _image_size(images, metadata)
    candidates = preds[:1] if multiple == "first" else preds
    gold_frames = [_frame(b, src, answer_coords, size) for b, src in golds]
    pred_frames = [_frame(b, src, coords, size) for b, src in candidates]
    frames = set(gold_frames) | set(pred_frames)
    if size is None and "abs" in frames and len(frames) > 1:
        raise ValueError(f"grounding_iou: comparing pixel boxes with {sorted(frames - {'abs'})} boxes "
                         f"needs the image size, but the sample has no image (and no "
                         f"metadata['image_size']); provide the image or set coords/answer_coords")
    gold_rel = [_to_rel(b, f, size, grid) for (b, _), f in zip(golds, gold_frames)]
    best: tuple[float, float, float] | None = None
    for (box, _), frame in zip(candidates, pred_frames):
        p = _to_rel(box, frame, size, grid)
        for g in gold_rel:
            iou, giou = box_iou_giou(p, g)
            score = iou if metric == "iou" else (giou + 1.0) / 2.0
            if best is None or score > best[0]:
                best = (score, iou, giou)
    assert best is not None
    out.update(score=best[0], iou=best[1], giou=best[2])
    return out


_FIELDS = re.compile(r"[\[\(]([^\[\]\(\)]*)[\]\)]")


@register("reward", "grounding_format")
def grounding_format(response: str, answer: Any = None, *, grid: int | None = None) -> dict[str, float]:
    """Format credit for a box answer: the fraction of the four fields of the response's first
    bracketed group (`[x1, y1, x2, y2]`) that are numbers (with `grid`: integers 0..grid, the
    coordinates of coords="grid"). Partial credit per field, so a fresh policy that fills the
    answer_template loop's holes with anything gets a gradient towards digits before the IoU
    pays at all. Components: fields (numeric fields found, 0-4)."""
    if grid is not None and (isinstance(grid, bool) or not isinstance(grid, int) or grid < 1):
        raise ValueError(f"grounding_format: grid must be a positive integer or null, got {grid!r}")
    m = _FIELDS.search(head(answer_span(response), MAX_CHARS))
    fields = [f.strip() for f in m.group(1).split(",")][:4] if m else []
    good = 0
    for f in fields:
        if grid is not None:
            good += f.isdigit() and int(f) <= grid
        else:
            try:
                good += math.isfinite(float(f))
            except ValueError:
                pass
    return {"score": good / 4.0, "fields": float(good)}
