"""The zoom_read recipe, and its design measured through the real processor of the tiny model:
the framed cell is plain in the full view, the glyph's colour is not in the full view's patch
that holds it, and the zoomed cell (`image_zoom`, grid mode) shows it.

A "reading" of a colour is the nearest of the six palette colours and the image's background
colour. The vision tower sees an image as 14-px patches, so a patch's mean colour is what a
patch "says" about the glyph; the glyph is also read pixel by pixel in the zoomed view."""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from _data_media import read_split
from mmrl.data.recipes import zoom_read
from mmrl.data.recipes._common import COLOURS
from mmrl.data.stream import load_all
from mmrl.registry import resolve
from mmrl.tools.zoom import ImageZoom

ARGS = dict(train_size=30, heldout_size=120, shard_size=64, seed=3)
LUMA = np.array([0.299, 0.587, 0.114])


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = str(tmp_path_factory.mktemp("zoom_read"))
    return out, resolve("dataset", "zoom_read")(out, **ARGS)


@pytest.fixture(scope="module")
def heldout(built: tuple[str, dict]) -> list:
    out, info = built
    return load_all(os.path.join(out, info["shards"]["heldout"]))


@pytest.fixture(scope="module")
def views(heldout: list, tiny_model_dir: Path) -> list[dict]:
    """Per held-out sample: the full image and the zoomed cell as the processor shows them."""
    from mmrl.processors import build_processor

    seen = _Seen(build_processor("auto", str(tiny_model_dir)).hf.image_processor)
    out = []
    for s in heldout:
        image = s.images[0]
        crop = ImageZoom(s, grid=2, upscale_to=112).call("image_zoom", {"cell": s.metadata["cell"]}).images[0]
        pixels = np.asarray(image)
        out.append({"sample": s, "full": seen(image), "zoom": seen(crop), "crop": crop,
                    "background": np.median(pixels.reshape(-1, 3), 0).astype(np.float64)})
    return out


class _Seen:
    """The image the vision tower gets: the processor's resized pixels, read back from its
    patches (un-patchified and un-normalised), so the test sees exactly what the model sees."""

    def __init__(self, image_processor):
        self.ip = image_processor

    def __call__(self, image: Image.Image) -> np.ndarray:
        ip = self.ip
        p, m = ip.patch_size, ip.merge_size
        enc = ip(images=[image], return_tensors="pt")
        _, gh, gw = enc["image_grid_thw"][0].tolist()
        x = enc["pixel_values"].reshape(gh // m, gw // m, m, m, 3, ip.temporal_patch_size, p, p)[:, :, :, :, :, 0]
        x = x.permute(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * p, gw * p)
        mean, std = (torch.tensor(v, dtype=x.dtype).view(3, 1, 1) for v in (ip.image_mean, ip.image_std))
        return ((x * std + mean) * 255).permute(1, 2, 0).double().numpy()


def reading(rgb: np.ndarray, background: np.ndarray) -> tuple[str, dict[str, float]]:
    """The nearest of the palette and the background, and the distance to each."""
    candidates = {**{k: np.asarray(v, np.float64) for k, v in COLOURS.items()}, "background": background}
    dist = {k: float(np.linalg.norm(rgb - v)) for k, v in candidates.items()}
    return min(dist, key=dist.get), dist


def patch_mean(view: np.ndarray, x: float, y: float, patch: int = 14) -> np.ndarray:
    """Mean colour of the vision patch that holds pixel (x, y) of a processed view."""
    px, py = int(x // patch) * patch, int(y // patch) * patch
    return view[py:py + patch, px:px + patch].reshape(-1, 3).mean(0)


def glyph_in(view: dict, frame: str) -> tuple[float, float, tuple[int, int, int, int]]:
    """The glyph's centre and its interior box (2 px in from each side, inside the circle too)
    in the coordinates of the full view or the zoomed view."""
    s = view["sample"]
    x1, y1, x2, y2 = s.metadata["box"]
    if frame == "zoom":
        cell = s.images[0].width // 2
        ox, oy = (s.metadata["cell"] % 2) * cell, (s.metadata["cell"] // 2) * cell
        scale = view["zoom"].shape[1] / cell
    else:
        ox = oy = 0
        scale = view["full"].shape[1] / s.images[0].width
    box = [(x1 - ox) * scale, (y1 - oy) * scale, (x2 - ox) * scale, (y2 - oy) * scale]
    inner = (int(np.ceil(box[0] + 2 * scale)), int(np.ceil(box[1] + 2 * scale)),
             int(box[2] - 2 * scale), int(box[3] - 2 * scale))
    return (box[0] + box[2]) / 2, (box[1] + box[3]) / 2, inner


# --------------------------------------------------------------------------------- the recipe

def test_manifest_splits_and_balanced_colours(built: tuple[str, dict]) -> None:
    out, info = built
    assert resolve("dataset", "zoom_read") is zoom_read.build
    assert info["recipe"] == "zoom_read" and info["counts"] == {"train": 30, "heldout": 120}
    with open(os.path.join(out, "dataset.json")) as f:
        assert json.load(f) == info
    train, held = read_split(out, "train"), read_split(out, "heldout")
    assert len(train) == 30 and len(held) == 120 and not set(train) & set(held)
    assert not {m["png"] for m in train.values()} & {m["png"] for m in held.values()}
    for split, members in (("train", train), ("heldout", held)):
        recs = [json.loads(m["json"]) for m in members.values()]
        assert all(r["metadata"]["split"] == split and r["prompt"] == zoom_read.PROMPT for r in recs)
        counts = Counter(r["answer"] for r in recs)
        assert set(counts) == set(COLOURS) and max(counts.values()) - min(counts.values()) <= 1


def test_samples_draw_what_their_metadata_says(heldout: list) -> None:
    for s in heldout:
        m = s.metadata
        assert s.images[0].size == (448, 448) and m["colour"] == s.answer
        assert set(m) >= {"split", "index", "cell", "colour", "shape", "box", "distractors"}
        x1, y1, x2, y2 = m["box"]
        col, row = m["cell"] % 2, m["cell"] // 2
        # inside its cell, clear of the frame's patches, 13-14 px, within one 14-px slot
        assert 13 <= x2 - x1 == y2 - y1 <= 14 and x1 // 14 == (x2 - 1) // 14 and y1 // 14 == (y2 - 1) // 14
        assert col * 224 + 28 <= x1 and x2 <= col * 224 + 196 and row * 224 + 28 <= y1 and y2 <= row * 224 + 196
        assert m["cell"] not in m["distractors"] and set(m["distractors"]) <= {0, 1, 2, 3}
        centre = np.asarray(s.images[0])[(y1 + y2) // 2, (x1 + x2) // 2].astype(np.float64)
        assert reading(centre, np.full(3, 128.0))[0] == s.answer


def test_deterministic_for_a_seed_and_another_seed_differs(built: tuple[str, dict], tmp_path: Path) -> None:
    out, _ = built
    zoom_read.build(str(tmp_path / "again"), **ARGS)
    shards = sorted(n for n in os.listdir(out) if n.endswith(".tar"))
    assert shards == sorted(n for n in os.listdir(tmp_path / "again") if n.endswith(".tar"))
    for shard in shards:
        assert (Path(out) / shard).read_bytes() == (tmp_path / "again" / shard).read_bytes(), shard
    zoom_read.build(str(tmp_path / "other"), **{**ARGS, "seed": 4})
    a, b = read_split(out, "heldout"), read_split(str(tmp_path / "other"), "heldout")
    assert sum(a[k]["png"] == b[k]["png"] for k in a) == 0


@pytest.mark.parametrize("kwargs", [{"colour": "pink"}, {"size": 450}, {"grid": 0}, {"size": 112, "grid": 2},
                                    {"glyph_min": 15, "glyph_max": 15}, {"glyph_min": 14, "glyph_max": 13},
                                    {"frame": 14}])
def test_bad_arguments(kwargs: dict) -> None:
    args = {"colour": "red", **kwargs}
    with pytest.raises(ValueError):
        zoom_read.draw(args.pop("colour"), np.random.default_rng(0), **args)


# ------------------------------------------------------------------- the design, as the model sees it

def test_views_have_the_sizes_the_design_assumes(views: list[dict]) -> None:
    """The tiny model's budget (at most 224² pixels): the full image at half size, a cell at full size."""
    for v in views:
        assert v["full"].shape == (224, 224, 3) and v["crop"].size == (224, 224) and v["zoom"].shape == (224, 224, 3)


def test_zoom_returns_the_cell_that_holds_the_glyph(views: list[dict]) -> None:
    for v in views:
        s = v["sample"]
        x1, y1, x2, y2 = s.metadata["box"]
        col, row = s.metadata["cell"] % 2, s.metadata["cell"] // 2
        assert col * 224 <= x1 < x2 <= col * 224 + 224 and row * 224 <= y1 < y2 <= row * 224 + 224
        expected = s.images[0].crop((col * 224, row * 224, col * 224 + 224, row * 224 + 224))
        assert np.array_equal(np.asarray(v["crop"]), np.asarray(expected))


def test_the_glyph_colour_is_not_in_the_full_views_patch(views: list[dict]) -> None:
    """(a) In the full view the glyph's patch reads as the background (or another colour), never
    its own colour, with a wide margin; (b) in the zoomed view its patch reads as its colour for
    nearly every sample, and its pixels do for every sample."""
    full_own, zoom_own, pixel_own = 0, 0, 0
    full_margin, zoom_margin = [], []
    for v in views:
        colour, bg = v["sample"].answer, v["background"]
        x, y, _ = glyph_in(v, "full")
        got, dist = reading(patch_mean(v["full"], x, y), bg)
        full_own += got == colour
        full_margin.append(dist[colour] - min(d for k, d in dist.items() if k != colour))
        x, y, (ix1, iy1, ix2, iy2) = glyph_in(v, "zoom")
        got, dist = reading(patch_mean(v["zoom"], x, y), bg)
        zoom_own += got == colour
        zoom_margin.append(min(d for k, d in dist.items() if k != colour) - dist[colour])
        inner = v["zoom"][iy1:iy2, ix1:ix2].reshape(-1, 3).mean(0)
        pixel_own += reading(inner, bg)[0] == colour
    n = len(views)
    assert full_own == 0, f"{full_own}/{n} full-view patches read as the glyph's colour"
    assert min(full_margin) > 20  # own colour at least this much farther than the nearest reading
    assert zoom_own >= 0.95 * n, f"only {zoom_own}/{n} zoomed patches read as the glyph's colour"
    assert np.median(zoom_margin) > 40
    assert pixel_own == n


def test_the_framed_cell_is_plain_in_the_full_view(views: list[dict]) -> None:
    """(c) The framed cell is darker than every other cell, and each patch along its border is
    darker than every patch of the other cells (distractors included)."""
    for v in views:
        cell = v["sample"].metadata["cell"]
        luma = v["full"] @ LUMA
        cells = [luma[(c // 2) * 112:(c // 2 + 1) * 112, (c % 2) * 112:(c % 2 + 1) * 112] for c in range(4)]
        means = [c.mean() for c in cells]
        assert min(m for c, m in enumerate(means) if c != cell) - means[cell] > 8
        patches = [c.reshape(8, 14, 8, 14).mean((1, 3)) for c in cells]
        framed = patches[cell]
        ring = np.concatenate([framed[0], framed[-1], framed[1:-1, 0], framed[1:-1, -1]])
        others = np.concatenate([p.ravel() for c, p in enumerate(patches) if c != cell])
        assert others.min() - ring.max() > 5


# ------------------------------------------------------------------ one episode, as configured

def test_a_scripted_episode_zooms_then_answers(heldout: list, tiny_model_dir: Path) -> None:
    """The multi_turn loop as configs/zoom_read.yaml sets it up (grid zoom, `bare` parser, two
    turns), with an engine that writes "<function> <cell>" then the colour: the tool turn shows
    the framed cell, the trainer's view of the episode fits max_model_len, and `final_answer`
    scores the last turn plus the tool credit."""
    import asyncio

    from mmrl.processors import build_processor
    from mmrl.rewards.final_answer import final_answer
    from mmrl.rollout.agent_loops import AgentContext
    from mmrl.rollout.tool_loop import multi_turn
    from mmrl.rollout.types import Completion, RequestSampling

    processor = build_processor("auto", str(tiny_model_dir))
    tok = processor.tokenizer
    sample = heldout[0]
    cell = sample.metadata["cell"]

    class Scripted:
        def __init__(self, texts: list[str]):
            self.texts, self.prompts = list(texts), []

        async def generate(self, prompt: dict, sampling: RequestSampling) -> Completion:
            self.prompts.append(prompt)
            ids = tok(self.texts.pop(0), add_special_tokens=False)["input_ids"]
            return Completion(token_ids=ids, logprobs=[0.0] * len(ids), text=tok.decode(ids, skip_special_tokens=True),
                              finish_reason="stop")

    for function, call in (("image_zoom", f"image_zoom {cell}<|im_end|>"), ("zoom", f"zoom{cell}<|im_end|>")):
        client = Scripted([call, f"{sample.answer}<|im_end|>"])
        args = {"tools": [{"name": "image_zoom", "args": {"grid": 2, "function": function}}], "parser": "bare",
                "max_turns": 2, "max_total_tokens": 48}
        ctx = AgentContext(client=client, sampling=RequestSampling(max_tokens=4), processor=processor, args=args)
        t = asyncio.run(multi_turn(ctx, sample, processor(sample)))
        assert t.stats["turns"] == 2 and t.stats["tool_calls"] == 1 and t.stats["tool_errors"] == 0
        (crop,) = t.new_media["image"]
        x0, y0 = (cell % 2) * 224, (cell // 2) * 224
        expected = sample.images[0].crop((x0, y0, x0 + 224, y0 + 224))
        assert np.array_equal(np.asarray(crop), np.asarray(expected))
        last = client.prompts[-1]
        assert len(last["multi_modal_data"]["image"]) == 2 and len(t.response_ids) <= 48
        trainer = processor.expand(last)  # the second turn's prompt as the trainer sees it
        assert len(trainer.prompt_ids) < 512  # engine_args.max_model_len
        assert final_answer(t.transcript, sample.answer, tool_credit=0.1)["score"] == pytest.approx(1.1)
