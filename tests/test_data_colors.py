"""The synthetic colour recipe: real shards on disk, read back with tarfile and PIL (not with the
stream under test elsewhere), so a bug in one cannot hide a bug in the other."""
from __future__ import annotations

import io
import json
import os
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from _data_media import read_members, read_split
from mmrl.plugins.data.recipes.colors import COLOURS, PROMPT, build, render
from mmrl.registry import resolve

NAMES = list(COLOURS)
PALETTE = np.array([COLOURS[n] for n in NAMES], dtype=float)
ARGS = dict(train_size=240, heldout_size=24, shard_size=64, seed=3)




def nearest_colour(img: Image.Image) -> str:
    a = np.asarray(img.convert("RGB")).astype(int)
    saturated = a[(a.max(-1) - a.min(-1)) > 60]
    assert len(saturated) > 200, "the shape should cover a good part of the image"
    mean = saturated.mean(0)
    return NAMES[int(np.argmin(((PALETTE - mean) ** 2).sum(1)))]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("colors"))
    return out, build(out, **ARGS)


def test_palette_and_registry():
    assert COLOURS == {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220),
                       "yellow": (230, 220, 30), "purple": (140, 40, 170), "orange": (245, 140, 20)}
    assert resolve("dataset", "colors") is build


def test_counts_shards_and_manifest(built):
    out, info = built
    assert info["recipe"] == "colors"
    assert info["counts"] == {"train": 240, "heldout": 24}
    assert info["shards"] == {"train": "train-{000000..000003}.tar", "heldout": "heldout-{000000..000000}.tar"}
    assert info["args"]["seed"] == 3 and info["args"]["image_format"] == "png"
    with open(os.path.join(out, "dataset.json")) as f:
        assert json.load(f) == info
    tars = sorted(n for n in os.listdir(out) if n.endswith(".tar"))
    assert tars == ["heldout-000000.tar"] + [f"train-{i:06d}.tar" for i in range(4)]
    per_shard = [len(read_members(os.path.join(out, f"train-{i:06d}.tar"))) for i in range(4)]
    assert per_shard == [64, 64, 64, 48]


def test_sample_layout(built):
    out, _ = built
    members = read_split(out, "train")
    for key, m in members.items():
        assert set(m) == {"json", "png"}, key
        rec = json.loads(m["json"])
        assert rec["prompt"] == PROMPT
        assert rec["answer"] in COLOURS
        meta = rec["metadata"]
        assert set(meta) == {"split", "shape", "frac", "index"}
        assert meta["split"] == "train" and meta["shape"] in ("square", "circle")
        assert 0.8 - 1e-3 <= meta["frac"] <= 1.0


def test_balanced_colours(built):
    out, _ = built
    for split, n in (("train", 240), ("heldout", 24)):
        answers = [json.loads(m["json"])["answer"] for m in read_split(out, split).values()]
        assert Counter(answers) == {c: n // 6 for c in COLOURS}
        # shuffled, not cycling red, green, blue ... in index order
        assert answers[:6] != NAMES


def test_deterministic_for_a_seed(built, tmp_path):
    out, _ = built
    again = build(str(tmp_path / "again"), **ARGS)
    assert again["counts"] == built[1]["counts"]
    for split in ("train", "heldout"):
        assert read_split(str(tmp_path / "again"), split) == read_split(out, split)
    # the tar files themselves are byte-identical too (fixed mtime)
    with open(os.path.join(out, "train-000000.tar"), "rb") as a, \
            open(tmp_path / "again" / "train-000000.tar", "rb") as b:
        assert a.read() == b.read()
    other = str(tmp_path / "other")
    build(other, **{**ARGS, "seed": 4})
    a, b = read_split(out, "train"), read_split(other, "train")
    assert sum(a[k]["png"] == b[k]["png"] for k in a) == 0


def test_train_and_heldout_disjoint(built):
    out, _ = built
    train, held = read_split(out, "train"), read_split(out, "heldout")
    assert not set(train) & set(held)
    assert not {m["png"] for m in train.values()} & {m["png"] for m in held.values()}
    assert all(json.loads(m["json"])["metadata"]["split"] == "heldout" for m in held.values())


def test_every_image_is_a_png_with_the_right_colour(built):
    out, _ = built
    for split in ("train", "heldout"):
        for key, m in read_split(out, split).items():
            img = Image.open(io.BytesIO(m["png"]))
            assert img.format == "PNG" and img.size == (56, 56) and img.mode == "RGB"
            assert nearest_colour(img) == json.loads(m["json"])["answer"], key


def test_jpg_format_and_options(tmp_path):
    info = build(str(tmp_path), train_size=36, heldout_size=6, image_size=64, min_frac=0.8,
                 shard_size=100, seed=1, image_format="jpg")
    assert info["shards"]["train"] == "train-{000000..000000}.tar"
    members = read_members(str(tmp_path / "train-000000.tar"))
    assert len(members) == 36
    for key, m in members.items():
        assert set(m) == {"json", "jpg"}
        img = Image.open(io.BytesIO(m["jpg"]))
        assert img.format == "JPEG" and img.size == (64, 64)
        rec = json.loads(m["json"])
        assert rec["metadata"]["frac"] >= 0.8 - 1e-3
        assert nearest_colour(img) == rec["answer"], key


def test_rebuild_removes_stale_shards(tmp_path):
    build(str(tmp_path), train_size=40, heldout_size=6, shard_size=10)
    assert (tmp_path / "train-000003.tar").exists()
    info = build(str(tmp_path), train_size=20, heldout_size=6, shard_size=10)
    assert info["shards"]["train"] == "train-{000000..000001}.tar"
    assert sorted(p.name for p in tmp_path.glob("train-*.tar")) == ["train-000000.tar", "train-000001.tar"]


def test_render():
    rng = np.random.default_rng(0)
    for colour in COLOURS:
        img = render(colour, rng, size=40, min_frac=1.0)
        assert img.mode == "RGB" and img.size == (40, 40)
        assert nearest_colour(img) == colour
        centre = np.asarray(img)[18:22, 18:22].astype(float).mean((0, 1))
        assert np.abs(centre - COLOURS[colour]).max() < 45
    with pytest.raises(ValueError, match="unknown colour"):
        render("pink", rng)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="image_format"):
        build(str(tmp_path), train_size=6, heldout_size=6, image_format="gif")
