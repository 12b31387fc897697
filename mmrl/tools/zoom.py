"""`image_zoom`: crop a region of the image and show it to the model as a new image."""
from __future__ import annotations

from typing import Any

from mmrl.registry import register
from mmrl.tools.base import Tool, ToolError, ToolResult


@register("tool", "image_zoom")
class ImageZoom(Tool):
    """Crops `bbox` = [x1, y1, x2, y2] out of the sample's image and returns the crop.

    Coordinates are absolute pixels of that image, or relative (every value in [0, 1]); the box
    is clamped to the image and grown around its centre to at least `min_size` pixels a side, so
    a sloppy box still returns something the processor accepts. `upscale_to` (pixels of the
    longer side) enlarges small crops, so the crop gets more vision tokens than it had in the
    full image: that is what makes zooming worth it. `crop_from`: "original" (boxes refer to
    the sample's image, as grounding data does) or "latest" (to the last image shown, so zooms
    can nest)."""

    name = "image_zoom"
    description = "Zoom into a region of the image: returns the region [x1, y1, x2, y2] as a new image."
    parameters = {
        "type": "object",
        "properties": {"bbox": {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4,
                                "description": "x1, y1, x2, y2 in pixels, or relative in [0, 1]"},
                       "image": {"type": "integer", "description": "which image of the sample (default 0)"}},
        "required": ["bbox"],
    }

    def __init__(self, sample: Any = None, min_size: int = 28, upscale_to: int | None = None,
                 crop_from: str = "original"):
        super().__init__(sample)
        if crop_from not in ("original", "latest"):
            raise ValueError(f"image_zoom: crop_from must be 'original' or 'latest', got {crop_from!r}")
        self.min_size, self.upscale_to, self.crop_from = int(min_size), upscale_to, crop_from
        self.latest: Any = None
        self.calls = 0

    def call(self, function: str, arguments: dict[str, Any]) -> ToolResult:
        images = list(getattr(self.sample, "images", None) or [])
        index = arguments.get("image", 0)
        if not isinstance(index, int) or not 0 <= index < len(images):
            raise ToolError(f"image must be an index below {len(images)}, got {index!r}")
        image = self.latest if self.crop_from == "latest" and self.latest is not None else images[index]
        box = crop_box(arguments.get("bbox"), image.width, image.height, self.min_size)
        crop = image.crop(box)
        if self.upscale_to and max(crop.size) < self.upscale_to:
            scale = self.upscale_to / max(crop.size)
            crop = crop.resize((max(1, round(crop.width * scale)), max(1, round(crop.height * scale))))
        self.latest = crop
        self.calls += 1
        return ToolResult(text=f"zoomed into {list(box)}", images=[crop])

    def state(self) -> dict[str, Any]:
        return {"zoom_calls": self.calls}


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
