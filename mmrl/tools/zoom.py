"""`image_zoom`: crop a region of the image and show it to the model as a new image.

Two modes. The default takes a bounding box (what grounding-trained models write). Grid mode
(`grid=N`) takes one integer, the row-major cell of an N x N grid over the image: a call is then
a handful of tokens ("image_zoom 3" with the `bare` parser), few enough for a tiny random policy
to stumble on by sampling and then learn by RL (the `zoom_read` recipe is built for it).
"""
from __future__ import annotations

from typing import Any

from mmrl.registry import register
from mmrl.tools.base import Tool, ToolError, ToolResult

BBOX_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"bbox": {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4,
                            "description": "x1, y1, x2, y2 in pixels, or relative in [0, 1]"},
                   "image": {"type": "integer", "description": "which image of the sample (default 0)"}},
    "required": ["bbox"],
}


def grid_parameters(grid: int) -> dict[str, Any]:
    """The schema of grid mode: one integer, so positional parsers read `image_zoom 3`."""
    last = grid * grid - 1
    return {"type": "object",
            "properties": {"cell": {"type": "integer", "minimum": 0, "maximum": last,
                                    "description": f"cell of the {grid} x {grid} grid, row-major: "
                                                   f"0 top-left, {last} bottom-right"}},
            "required": ["cell"]}


@register("tool", "image_zoom")
class ImageZoom(Tool):
    """Crops `bbox` = [x1, y1, x2, y2] (or, with `grid=N`, grid cell `cell`) out of the sample's
    image and returns the crop.

    Coordinates are absolute pixels of that image, or relative (every value in [0, 1]); the box
    is clamped to the image and grown around its centre to at least `min_size` pixels a side, so
    a sloppy box still returns something the processor accepts. `upscale_to` (pixels of the
    longer side) enlarges small crops, so the crop gets more vision tokens than it had in the
    full image: that is what makes zooming worth it. `crop_from`: "original" (boxes refer to
    the sample's image, as grounding data does) or "latest" (to the last image shown, so zooms
    can nest). Grid mode crops image 0 (or the latest crop) exactly at the cell's borders
    (`min_size` does not apply). `function` renames the function the model calls (default
    "image_zoom", eight tokens of the tiny tokenizer; "zoom" is one token when the tiny model is
    built with `--words ...,zoom`)."""

    name = "image_zoom"
    description = "Zoom into a region of the image: returns the region [x1, y1, x2, y2] as a new image."
    parameters = BBOX_PARAMETERS

    def __init__(self, sample: Any = None, min_size: int = 28, upscale_to: int | None = None,
                 crop_from: str = "original", grid: int | None = None, function: str | None = None):
        super().__init__(sample)
        if crop_from not in ("original", "latest"):
            raise ValueError(f"image_zoom: crop_from must be 'original' or 'latest', got {crop_from!r}")
        if grid is not None and (isinstance(grid, bool) or not isinstance(grid, int) or grid < 1):
            raise ValueError(f"image_zoom: grid must be a positive integer or None, got {grid!r}")
        if function is not None and (not isinstance(function, str) or not function or function.split() != [function]):
            raise ValueError(f"image_zoom: function must be one word, got {function!r}")
        self.min_size, self.upscale_to, self.crop_from = int(min_size), upscale_to, crop_from
        self.grid = grid
        self.function = function or self.name
        self.latest: Any = None
        self.latest_origin = (0.0, 0.0, 1.0)  # latest crop -> sample image: x = ox + u / scale
        self.boxes: list[list[float]] = []  # every crop, in the sample image's pixels

    def functions(self) -> list[dict[str, Any]]:
        if self.grid is None:
            description, parameters = self.description, self.parameters
        else:
            description = (f"Zoom into one cell of a {self.grid} x {self.grid} grid over the image "
                           f"(cells 0-{self.grid * self.grid - 1}, row-major): returns it as a new image.")
            parameters = grid_parameters(self.grid)
        return [{"type": "function",
                 "function": {"name": self.function, "description": description, "parameters": parameters}}]

    def call(self, function: str, arguments: dict[str, Any]) -> ToolResult:
        if function != self.function:
            raise ToolError(f"unknown function {function!r}; this tool has {self.function!r}")
        images = list(getattr(self.sample, "images", None) or [])
        index = 0 if self.grid is not None else arguments.get("image", 0)
        if not isinstance(index, int) or not 0 <= index < len(images):
            raise ToolError(f"image must be an index below {len(images)}, got {index!r}")
        nested = self.crop_from == "latest" and self.latest is not None
        image = self.latest if nested else images[index]
        ox, oy, scale = self.latest_origin if nested else (0.0, 0.0, 1.0)
        if self.grid is None:
            box = crop_box(arguments.get("bbox"), image.width, image.height, self.min_size)
            what = str(list(box))
        else:
            cell = _cell_argument(arguments, self.grid)
            box = cell_box(cell, self.grid, image.width, image.height)
            what = f"cell {cell}"
        crop = image.crop(box)
        x1, y1 = ox + box[0] / scale, oy + box[1] / scale
        self.boxes.append([x1, y1, ox + box[2] / scale, oy + box[3] / scale])
        if self.upscale_to and max(crop.size) < self.upscale_to:
            up = self.upscale_to / max(crop.size)
            crop = crop.resize((max(1, round(crop.width * up)), max(1, round(crop.height * up))))
            scale *= crop.width / (box[2] - box[0])
        self.latest, self.latest_origin = crop, (x1, y1, scale)
        return ToolResult(text=f"zoomed into {what}", images=[crop])

    def state(self) -> dict[str, Any]:
        return {"zoom_calls": len(self.boxes), "zoom_boxes": [list(b) for b in self.boxes]}


def _cell_argument(arguments: dict[str, Any], grid: int) -> int:
    """The `cell` of a grid-mode call; any other argument or value is a ToolError the model sees."""
    extra = sorted(set(arguments) - {"cell"})
    if extra:
        raise ToolError(f"unknown argument(s) {extra}; the only argument is cell (0-{grid * grid - 1})")
    cell = arguments.get("cell")
    if isinstance(cell, float) and cell.is_integer():
        cell = int(cell)
    if isinstance(cell, bool) or not isinstance(cell, int) or not 0 <= cell < grid * grid:
        raise ToolError(f"cell must be an integer from 0 to {grid * grid - 1}, got {cell!r}")
    return cell


def cell_box(cell: int, grid: int, width: int, height: int) -> tuple[int, int, int, int]:
    """The pixel box of row-major `cell` of a `grid` x `grid` grid; borders rounded, so the cells
    tile the image exactly whatever its size."""
    if width < grid or height < grid:
        raise ToolError(f"the image ({width}x{height}) is too small for a {grid} x {grid} grid")
    row, col = divmod(cell, grid)
    return (round(col * width / grid), round(row * height / grid),
            round((col + 1) * width / grid), round((row + 1) * height / grid))


def crop_box(bbox: Any, width: int, height: int, min_size: int) -> tuple[int, int, int, int]:
    """The pixel box for `bbox` (absolute or relative), clamped and at least `min_size` a side."""
    if not isinstance(bbox, (list, tuple)) or len(bbox) != 4:
        raise ToolError(f"bbox must be [x1, y1, x2, y2], got {bbox!r}")
    try:
        x1, y1, x2, y2 = (float(v) for v in bbox)
    except (TypeError, ValueError):
        raise ToolError(f"bbox values must be numbers, got {bbox!r}") from None
    if all(0.0 <= v <= 1.0 for v in (x1, y1, x2, y2)):
        x1, x2, y1, y2 = x1 * width, x2 * width, y1 * height, y2 * height
    x1, x2 = sorted((x1, x2))
    y1, y2 = sorted((y1, y2))
    side_w, side_h = min(max(x2 - x1, min_size), width), min(max(y2 - y1, min_size), height)
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    left = min(max(cx - side_w / 2, 0.0), width - side_w)
    top = min(max(cy - side_h / 2, 0.0), height - side_h)
    return round(left), round(top), round(left + side_w), round(top + side_h)
