"""`image_zoom` in bbox mode and grid mode, and the `bare` tool-call parser."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from mmrl import registry
from mmrl.tools.base import ToolError, run_tool
from mmrl.tools.parsers import ToolCall, bare
from mmrl.tools.zoom import ImageZoom


def _sample(width: int = 200, height: int = 100) -> SimpleNamespace:
    """An image whose pixel (x, y) is (x, y, 0): a crop shows where it came from."""
    xs, ys = np.meshgrid(np.arange(width), np.arange(height))
    pixels = np.stack([xs, ys, np.zeros_like(xs)], -1).astype(np.uint8)
    return SimpleNamespace(images=[Image.fromarray(pixels, "RGB")])


def _origin(image: Image.Image) -> tuple[int, int]:
    r, g, _ = image.getpixel((0, 0))
    return r, g


# ------------------------------------------------------------------------------- bbox mode

def test_bbox_absolute_and_relative_give_the_same_crop() -> None:
    tool = ImageZoom(_sample())
    absolute = tool.call("image_zoom", {"bbox": [20, 10, 120, 60]})
    relative = tool.call("image_zoom", {"bbox": [0.1, 0.1, 0.6, 0.6]})
    for result in (absolute, relative):
        (crop,) = result.images
        assert crop.size == (100, 50) and _origin(crop) == (20, 10)
    assert absolute.text == "zoomed into [20, 10, 120, 60]"
    assert tool.state() == {"zoom_calls": 2, "zoom_boxes": [[20, 10, 120, 60], [20, 10, 120, 60]]}


def test_state_keeps_every_crop_in_the_sample_images_pixels() -> None:
    """Nested zooms (crop_from latest, upscaled) are mapped back to the sample image, so a reward
    can check what was looked at (zoom_on_target)."""
    tool = ImageZoom(_sample(), crop_from="latest", upscale_to=100)
    tool.call("image_zoom", {"bbox": [100, 0, 200, 100]})  # 100 px: kept
    tool.call("image_zoom", {"bbox": [50, 50, 100, 100]})  # a 50-px crop of it, upscaled x2 ...
    (last,) = tool.call("image_zoom", {"bbox": [0, 0, 50, 50]}).images  # ... of which this quarter
    assert tool.state()["zoom_boxes"] == [[100, 0, 200, 100], [150, 50, 200, 100], [150, 50, 175, 75]]
    assert _origin(last) == (150, 50)  # the pixel that says where it came from agrees


def test_bbox_is_sorted_clamped_and_grown_to_min_size() -> None:
    tool = ImageZoom(_sample(), min_size=28)
    assert tool.call("image_zoom", {"bbox": [120, 60, 20, 10]}).images[0].size == (100, 50)  # swapped corners
    crop = tool.call("image_zoom", {"bbox": [180, 80, 230, 110]}).images[0]  # past an edge: shifted inside
    assert crop.size == (50, 30) and _origin(crop) == (150, 70)
    whole = tool.call("image_zoom", {"bbox": [-50, -50, 400, 300]}).images[0]  # bigger than the image
    assert whole.size == (200, 100) and _origin(whole) == (0, 0)
    tiny = tool.call("image_zoom", {"bbox": [195, 95, 198, 98]}).images[0]  # 3 px, in a corner
    assert tiny.size == (28, 28) and _origin(tiny) == (172, 72)


def test_bbox_upscale_enlarges_small_crops_only() -> None:
    tool = ImageZoom(_sample(), upscale_to=112)
    assert tool.call("image_zoom", {"bbox": [0, 0, 56, 28]}).images[0].size == (112, 56)
    assert tool.call("image_zoom", {"bbox": [0, 0, 150, 100]}).images[0].size == (150, 100)


@pytest.mark.parametrize("args", [{}, {"bbox": [1, 2, 3]}, {"bbox": "0 0 1 1"}, {"bbox": [0, 0, "a", 1]},
                                  {"bbox": [0, 0, 1, 1], "image": 1}, {"bbox": [0, 0, 1, 1], "image": "0"}])
def test_bbox_bad_calls_are_tool_errors(args: dict) -> None:
    with pytest.raises(ToolError):
        ImageZoom(_sample()).call("image_zoom", args)


def test_bbox_mode_schema_is_unchanged() -> None:
    (f,) = ImageZoom().functions()
    assert f["function"]["name"] == "image_zoom"
    assert f["function"]["parameters"]["required"] == ["bbox"]
    assert set(f["function"]["parameters"]["properties"]) == {"bbox", "image"}


# ------------------------------------------------------------------------------- grid mode

def test_grid_schema_is_one_integer_cell() -> None:
    (f,) = ImageZoom(grid=3).functions()
    params = f["function"]["parameters"]
    assert params["type"] == "object" and params["required"] == ["cell"] and list(params["properties"]) == ["cell"]
    cell = params["properties"]["cell"]
    assert (cell["type"], cell["minimum"], cell["maximum"]) == ("integer", 0, 8)
    assert "3 x 3" in f["function"]["description"]


def test_grid_cells_are_row_major_and_tile_the_image() -> None:
    tool = ImageZoom(_sample(200, 100), grid=2)
    origins = [_origin(tool.call("image_zoom", {"cell": c}).images[0]) for c in range(4)]
    assert origins == [(0, 0), (100, 0), (0, 50), (100, 50)]
    assert {tool.call("image_zoom", {"cell": c}).images[0].size for c in range(4)} == {(100, 50)}
    assert tool.call("image_zoom", {"cell": 3}).text == "zoomed into cell 3"
    odd = ImageZoom(_sample(101, 99), grid=3)  # rounded borders: the cells still cover every pixel
    widths = [odd.call("image_zoom", {"cell": c}).images[0].width for c in range(3)]
    heights = [odd.call("image_zoom", {"cell": c}).images[0].height for c in (0, 3, 6)]
    assert sum(widths) == 101 and sum(heights) == 99


def test_grid_upscale_and_no_min_size() -> None:
    tool = ImageZoom(_sample(40, 40), grid=4, upscale_to=112, min_size=28)
    crop = tool.call("image_zoom", {"cell": 5}).images[0]  # a 10-px cell, not grown to min_size first
    assert crop.size == (112, 112)
    big = ImageZoom(_sample(448, 448), grid=2, upscale_to=112).call("image_zoom", {"cell": 0}).images[0]
    assert big.size == (224, 224)


def test_grid_crop_from_latest_nests() -> None:
    tool = ImageZoom(_sample(200, 200), grid=2, crop_from="latest")
    tool.call("image_zoom", {"cell": 3})
    crop = tool.call("image_zoom", {"cell": 3}).images[0]
    assert crop.size == (50, 50) and _origin(crop) == (150, 150)


@pytest.mark.parametrize("args", [{}, {"cell": 4}, {"cell": -1}, {"cell": "1"}, {"cell": 1.5}, {"cell": True},
                                  {"cell": 1, "image": 0}, {"bbox": [0, 0, 1, 1]}])
def test_grid_bad_calls_are_tool_errors(args: dict) -> None:
    with pytest.raises(ToolError):
        ImageZoom(_sample(), grid=2).call("image_zoom", args)


def test_grid_accepts_an_integral_float() -> None:
    assert _origin(ImageZoom(_sample(), grid=2).call("image_zoom", {"cell": 1.0}).images[0]) == (100, 0)


def test_grid_errors_reach_the_model_through_run_tool() -> None:
    tool = ImageZoom(_sample(), grid=2)
    result, _ = asyncio.run(run_tool(tool, "image_zoom", {"cell": 7}, timeout_s=10))
    assert result.error and "0 to 3" in result.text
    result, _ = asyncio.run(run_tool(tool, "nope", {"cell": 0}, timeout_s=10))
    assert result.error and "unknown function" in result.text


@pytest.mark.parametrize("kwargs", [{"grid": 0}, {"grid": 2.0}, {"grid": True}, {"function": "two words"},
                                    {"function": ""}, {"crop_from": "first"}])
def test_bad_constructor_args(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ImageZoom(_sample(), **kwargs)


def test_function_renames_the_call() -> None:
    tool = ImageZoom(_sample(), grid=2, function="zoom")
    assert [f["function"]["name"] for f in tool.functions()] == ["zoom"]
    assert _origin(tool.call("zoom", {"cell": 2}).images[0]) == (0, 50)
    with pytest.raises(ToolError):
        tool.call("image_zoom", {"cell": 2})


# ------------------------------------------------------------------------------ bare parser

GRID = ImageZoom(grid=2).functions()


@pytest.mark.parametrize("text, cell", [("image_zoom 3", 3), ("image_zoom 3<|im_end|>", 3), ("  image_zoom\t1\n", 1),
                                        ("<|im_start|>image_zoom 2<|im_end|>", 2), ("image_zoom3<|im_end|>", 3)])
def test_bare_reads_a_turn_that_starts_with_a_function(text: str, cell: int) -> None:
    assert bare(text, GRID) == [ToolCall("image_zoom", {"cell": cell})]


@pytest.mark.parametrize("text", ["red", "red<|im_end|>", "", "<|im_end|>", "the answer is image_zoom 3",
                                  "image_zoomed", "image_zoom_in 2", "Image_zoom 1", "zoom 1"])
def test_bare_anything_else_is_an_answer(text: str) -> None:
    assert bare(text, GRID) == []


def test_bare_values_and_errors_as_compact() -> None:
    assert bare("image_zoom", GRID) == [ToolCall("image_zoom", {})]  # the tool answers "cell ..."
    assert bare("image_zoom x", GRID) == [ToolCall("image_zoom", {"cell": "x"})]
    (too_many,) = bare("image_zoom 1 2<|im_end|>", GRID)
    assert too_many.error and "at most 1" in too_many.error
    box = ImageZoom().functions()
    assert bare("image_zoom [0,0,0.5,0.5] 0", box) == [ToolCall("image_zoom", {"bbox": [0, 0, 0.5, 0.5], "image": 0})]
    (unknown,) = bare("<tool_call>nope 1</tool_call>", GRID)  # tags: read as compact, unknown -> error
    assert unknown.error and unknown.name == "nope"


def test_bare_prefers_the_longest_function_name() -> None:
    functions = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {"v": {}}}}}
                 for n in ("zoom", "zoom_out")]
    assert bare("zoom_out 2", functions) == [ToolCall("zoom_out", {"v": 2})]
    assert bare("zoom 2", functions) == [ToolCall("zoom", {"v": 2})]


def test_bare_is_registered() -> None:
    assert registry.resolve("tool_parser", "bare") is bare
