"""The synthetic recipes (counting, grounding, multi_image, video_motion): real shards in tmp_path,
read back with tarfile / PIL / PyAV for the pixel checks and with `load_all` for the stream path."""
from __future__ import annotations

import asyncio
import io
import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from _data_media import read_members, read_split
from mmrl.cli import main
from mmrl.plugins.data.recipes import counting, grounding, gui_click, multi_image, video_motion
from mmrl.plugins.data.recipes._common import NUMBER_WORDS, SHAPES, ShardSink, tar_file_size
from mmrl.data.stream import load_all
from mmrl.registry import resolve
from mmrl.plugins.rewards.colour import detect_colour

ARGS = {
    "counting": dict(train_size=50, heldout_size=10, shard_size=16, seed=5),
    "grounding": dict(train_size=48, heldout_size=9, shard_size=16, seed=5),
    "multi_image": dict(train_size=40, heldout_size=8, shard_size=16, seed=5),
    "video_motion": dict(train_size=16, heldout_size=8, shard_size=8, seed=5),
    "gui_click": dict(train_size=20, heldout_size=8, shard_size=8, seed=5, layout="random"),
}
MODULES = {"counting": counting, "grounding": grounding, "multi_image": multi_image,
           "video_motion": video_motion, "gui_click": gui_click}




def records(out_dir: str, split: str) -> list[dict]:
    return [json.loads(m["json"]) for m in read_split(out_dir, split).values()]


def saturated(pixels: np.ndarray) -> np.ndarray:
    """bool mask of shape pixels (palette colours are saturated; the grey background is not)."""
    a = pixels.astype(np.float32)
    mx = a.max(-1)
    return (mx - a.min(-1)) / np.maximum(mx, 1.0) > 0.45


def components(mask: np.ndarray, min_size: int = 4) -> list[int]:
    """Sizes of 4-connected components with at least `min_size` pixels (iterative flood fill)."""
    seen = np.zeros_like(mask, bool)
    sizes = []
    h, w = mask.shape
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        stack, n = [(y0, x0)], 0
        seen[y0, x0] = True
        while stack:
            y, x = stack.pop()
            n += 1
            for yy, xx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= yy < h and 0 <= xx < w and mask[yy, xx] and not seen[yy, xx]:
                    seen[yy, xx] = True
                    stack.append((yy, xx))
        if n >= min_size:
            sizes.append(n)
    return sizes


def decode_mp4(data: bytes) -> tuple[np.ndarray, float]:
    import av

    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.video[0]
        assert stream.codec_context.name == "h264" and stream.codec_context.pix_fmt == "yuv420p"
        fps = float(stream.average_rate)
        frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    return frames, fps


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = {}
    for name, args in ARGS.items():
        d = str(tmp_path_factory.mktemp(name))
        out[name] = (d, resolve("dataset", name)(d, **args))
    return out


# ------------------------------------------------------------------------------ every recipe

@pytest.mark.parametrize("name", list(ARGS))
def test_counts_manifest_and_splits(built, name):
    out, info = built[name]
    args = ARGS[name]
    assert resolve("dataset", name) is MODULES[name].build
    assert info["recipe"] == name and info["args"]["seed"] == args["seed"]
    assert info["counts"] == {"train": args["train_size"], "heldout": args["heldout_size"]}
    with open(os.path.join(out, "dataset.json")) as f:
        assert json.load(f) == info
    n_train = -(-args["train_size"] // args["shard_size"])
    assert info["shards"]["train"] == f"train-{{000000..{n_train - 1:06d}}}.tar"
    train, held = read_split(out, "train"), read_split(out, "heldout")
    assert len(train) == args["train_size"] and len(held) == args["heldout_size"]
    # disjoint keys and media; every record says its split
    assert not set(train) & set(held)
    media = lambda ms: {v for m in ms.values() for k, v in m.items() if k != "json"}  # noqa: E731
    assert not media(train) & media(held)
    for split, ms in (("train", train), ("heldout", held)):
        assert all(json.loads(m["json"])["metadata"]["split"] == split for m in ms.values())


@pytest.mark.parametrize("name", list(ARGS))
def test_balanced_answers(built, name):
    out, info = built[name]
    labels = {"counting": list(NUMBER_WORDS[1:6]), "grounding": list(SHAPES),
              "multi_image": ["yes", "no"], "video_motion": list(video_motion.DIRECTIONS),
              "gui_click": None}[name]
    for split in ("train", "heldout"):
        recs = records(out, split)
        if labels is None:  # random layouts: the task is drawn with the desktop, not balanced
            continue
        if name == "grounding":
            got = Counter(r["metadata"]["target"] for r in recs)
        else:
            got = Counter(r["answer"] for r in recs)
        assert set(got) <= set(labels)
        n = len(recs)
        assert sorted(got.values()) == sorted(n // len(labels) + (i < n % len(labels)) for i in range(len(labels)))


@pytest.mark.parametrize("name", list(ARGS))
def test_deterministic_for_a_seed(built, name, tmp_path):
    out, _ = built[name]
    build = resolve("dataset", name)
    build(str(tmp_path / "again"), **ARGS[name])
    for shard in sorted(n for n in os.listdir(out) if n.endswith(".tar")):
        with open(os.path.join(out, shard), "rb") as a, open(tmp_path / "again" / shard, "rb") as b:
            assert a.read() == b.read(), shard
    build(str(tmp_path / "other"), **{**ARGS[name], "seed": 6})
    a, b = read_split(out, "heldout"), read_split(str(tmp_path / "other"), "heldout")
    ext = next(k for k in a[next(iter(a))] if k != "json")
    assert sum(a[k][ext] == b[k][ext] for k in a) == 0


@pytest.mark.parametrize("name", list(ARGS))
def test_decodes_through_the_stream(built, name):
    out, info = built[name]
    samples = load_all(os.path.join(out, info["shards"]["heldout"]))
    assert len(samples) == ARGS[name]["heldout_size"]
    for s in samples:
        assert s.prompt_text and s.answer is not None and s.metadata["split"] == "heldout"
        if name == "video_motion":
            assert len(s.videos) == 1 and not s.images
            assert s.videos[0].total_num_frames == 8 and s.videos[0].frames.shape[1:] == (64, 64, 3)
        else:
            assert len(s.images) == (2 if name == "multi_image" else 1) and not s.videos


# ----------------------------------------------------------------------------------- counting

def test_counting_pixels_match_the_answer(built):
    out, _ = built["counting"]
    for split in ("train", "heldout"):
        for key, m in read_split(out, split).items():
            rec = json.loads(m["json"])
            meta = rec["metadata"]
            assert rec["prompt"] == counting.PROMPT
            assert rec["answer"] == NUMBER_WORDS[meta["count"]] and 1 <= meta["count"] <= 5
            assert len(meta["boxes"]) == meta["count"] and meta["shape"] in SHAPES
            img = np.asarray(Image.open(io.BytesIO(m["png"])))
            assert img.shape == (84, 84, 3)
            assert len(components(saturated(img))) == meta["count"], key


def test_counting_options(tmp_path):
    info = counting.build(str(tmp_path), train_size=12, heldout_size=4, shard_size=100, min_count=0,
                          max_count=8, image_size=64)
    assert info["answers"] == list(NUMBER_WORDS[:9])
    recs = records(str(tmp_path), "train")
    assert {r["answer"] for r in recs} <= set(NUMBER_WORDS[:9])
    with pytest.raises(ValueError, match="max_count"):
        counting.build(str(tmp_path), train_size=2, heldout_size=2, max_count=10)


# ---------------------------------------------------------------------------------- grounding

def test_grounding_box_is_the_named_shape(built):
    out, _ = built["grounding"]
    fill = {"square": 1.0, "circle": np.pi / 4, "triangle": 0.5}
    for key, m in read_split(out, "train").items():
        rec = json.loads(m["json"])
        meta = rec["metadata"]
        target = meta["target"]
        assert rec["prompt"] == f"Where is the {target}? Answer with its box [x1, y1, x2, y2]."
        x1, y1, x2, y2 = rec["answer"]
        assert meta["image_size"] == [84, 84]
        assert meta["box_rel"] == [round(v / 84, 4) for v in rec["answer"]]
        assert 0 <= x1 < x2 <= 84 and 0 <= y1 < y2 <= 84 and x2 - x1 == y2 - y1
        assert 1 <= len(meta["distractors"]) <= 3
        assert all(d["shape"] != target for d in meta["distractors"])
        mask = saturated(np.asarray(Image.open(io.BytesIO(m["png"]))))
        inside = mask[y1:y2, x1:x2]
        assert abs(inside.mean() - fill[target]) < 0.12, (key, target, inside.mean())
        # the box is tight: every edge row / column holds shape pixels
        assert inside[0].any() and inside[-1].any() and inside[:, 0].any() and inside[:, -1].any()
        # nothing else overlaps it: distractor boxes are disjoint from the target's
        for d in meta["distractors"]:
            a1, b1, a2, b2 = d["box"]
            assert a2 <= x1 or x2 <= a1 or b2 <= y1 or y2 <= b1


def test_grounding_grid_layout_answers_the_targets_cell(tmp_path):
    """layout=grid (the tiny model's grounding config): every shape in its own 28-px cell; the
    answer is the target's cell box, which `[col, row, col + 1, row + 1]` in grid units scores 1.0."""
    from mmrl.plugins.rewards.grounding import grounding_iou

    grounding.build(str(tmp_path), train_size=30, heldout_size=3, shard_size=100, layout="grid")
    for key, m in read_split(str(tmp_path), "train").items():
        rec = json.loads(m["json"])
        meta = rec["metadata"]
        assert rec["prompt"] == f"Where is the {meta['target']}? Answer with its cell [x1, y1, x2, y2] in grid units."
        col, row = meta["cell"]
        assert rec["answer"] == [28 * col, 28 * row, 28 * col + 28, 28 * row + 28], key
        x1, y1, x2, y2 = meta["shape_box"]  # the shape itself, inside its cell
        assert (x1 // 28, y1 // 28) == ((x2 - 1) // 28, (y2 - 1) // 28) == (col, row), key
        cells = {(d["box"][0] // 28, d["box"][1] // 28) for d in meta["distractors"]}
        assert (col, row) not in cells and len(cells) == len(meta["distractors"]), key
        inside = saturated(np.asarray(Image.open(io.BytesIO(m["png"]))))[y1:y2, x1:x2]
        assert inside.mean() > 0.3, key
        assert grounding_iou(f"[{col}, {row}, {col + 1}, {row + 1}]", rec["answer"], metadata=meta, coords="grid",
                             grid=3)["score"] == 1.0
    with pytest.raises(ValueError, match="grid_cells"):
        grounding.build(str(tmp_path), train_size=2, heldout_size=2, layout="grid", grid_cells=1)
    with pytest.raises(ValueError, match="layout"):
        grounding.build(str(tmp_path), train_size=2, heldout_size=2, layout="rows")


# -------------------------------------------------------------------------------- multi_image

def test_multi_image_members_and_colours(built):
    out, info = built["multi_image"]
    assert info["images_per_sample"] == 2
    for key, m in read_split(out, "train").items():
        assert set(m) == {"json", "0.png", "1.png"}, key
        rec = json.loads(m["json"])
        assert rec["images"] == ["0.png", "1.png"] and rec["prompt"] == multi_image.PROMPT
        c0, c1 = rec["metadata"]["colours"]
        assert rec["answer"] == ("yes" if c0 == c1 else "no")
        seen = [detect_colour(Image.open(io.BytesIO(m[f"{i}.png"]))) for i in (0, 1)]
        assert seen == [c0, c1], key
        assert m["0.png"] != m["1.png"]


def test_multi_image_stream_order(built):
    out, info = built["multi_image"]
    for s in load_all(os.path.join(out, info["shards"]["heldout"])):
        assert [c["type"] for c in s.messages[-1]["content"]] == ["image", "image", "text"]
        assert [detect_colour(im) for im in s.images] == s.metadata["colours"]


# ------------------------------------------------------------------------------- video_motion

def test_video_motion_centroid_moves_the_stated_way(built):
    out, _ = built["video_motion"]
    axis_sign = {"left": (0, -1), "right": (0, 1), "up": (1, -1), "down": (1, 1)}
    for split in ("train", "heldout"):
        for key, m in read_split(out, split).items():
            assert set(m) == {"json", "mp4"}
            rec = json.loads(m["json"])
            assert rec["videos"] == ["mp4"] and rec["prompt"] == video_motion.PROMPT
            frames, fps = decode_mp4(m["mp4"])
            assert frames.shape == (8, 64, 64, 3) and fps == 4.0
            centres = []
            for f in frames:
                ys, xs = np.nonzero(saturated(f))
                assert len(xs) > 20, key
                centres.append((xs.mean(), ys.mean()))
            centres = np.array(centres)
            axis, sign = axis_sign[rec["answer"]]
            along = sign * np.diff(centres[:, axis])
            assert (along > -0.5).all(), (key, centres)  # monotone, up to compression noise
            assert along.sum() >= 0.5 * (64 - rec["metadata"]["side"]) - 2, key
            assert np.abs(centres[:, 1 - axis] - centres[0, 1 - axis]).max() < 1.5  # straight line
            # the metadata's box centres move as the pixels do (a triangle's centroid sits lower
            # than its box centre, so compare displacements)
            meta = np.array(rec["metadata"]["centres"])
            assert np.abs((centres - centres[0]) - (meta - meta[0])).max() < 1.5, key


def test_video_motion_options(tmp_path):
    info = video_motion.build(str(tmp_path), train_size=4, heldout_size=4, frames=6, fps=3,
                              width=48, height=32, shard_size=10)
    assert info["modality"] == "video"
    m = next(iter(read_members(str(tmp_path / "train-000000.tar")).values()))
    frames, fps = decode_mp4(m["mp4"])
    assert frames.shape == (6, 32, 48, 3) and fps == 3.0
    with pytest.raises(ValueError, match="even"):
        video_motion.build(str(tmp_path), train_size=2, heldout_size=2, width=63)


# --------------------------------------------------------------------------------------- misc

def test_cli_build_with_options_after_out(tmp_path, capsys):
    out = str(tmp_path / "c")
    assert main(["data", "build", "counting", "--out", out, "train_size=10", "heldout_size=5",
                 "max_count=3", "shard_size=4"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["counts"] == {"train": 10, "heldout": 5} and info["args"]["max_count"] == 3
    assert main(["data", "build", "counting", "--out", out, "bogus=1"]) == 2
    assert "unknown option(s) bogus" in capsys.readouterr().err


def test_shard_sink_size_limit(tmp_path):
    rng = np.random.default_rng(0)
    blobs = [rng.bytes(int(n)) for n in rng.integers(3_000, 9_000, 40)]
    with ShardSink(str(tmp_path / "s-%06d.tar"), maxbytes=30_000) as sink:
        for i, b in enumerate(blobs):
            sink.write({"__key__": f"k{i:03d}", "bin": b})
    sizes = [os.path.getsize(p) for p in sink.shards]
    assert all(s <= 30_000 for s in sizes) and len(sizes) >= 8
    assert [tar_file_size(s) for s in sink.sizes] == sizes
    assert sum(sink.counts) == 40
    # nothing written: no shard file at all
    with ShardSink(str(tmp_path / "empty-%06d.tar"), maxcount=3) as empty:
        pass
    assert empty.shards == [] and not list(tmp_path.glob("empty-*"))


def test_our_yuv420p_conversion_matches_ffmpeg_and_round_trips():
    """encode_mp4 converts RGB -> YUV 4:2:0 itself (the encoder's own conversion made builds differ
    under load): luma within 1 of swscale's, and flat colours come back within 2 levels."""
    import av

    from mmrl.plugins.data.recipes._common import rgb_to_yuv420p

    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (2, 32, 48, 3), dtype=np.uint8)
    yuv = rgb_to_yuv420p(frames)
    ffmpeg = np.stack([av.VideoFrame.from_ndarray(f, format="rgb24").reformat(format="yuv420p").to_ndarray()
                       for f in frames])
    assert yuv.shape == ffmpeg.shape == (2, 48, 48)
    assert np.abs(yuv[:, :32].astype(int) - ffmpeg[:, :32]).max() <= 1
    for colour in [(200, 30, 30), (20, 160, 60), (40, 60, 220), (128, 128, 128), (240, 220, 30)]:
        flat = np.broadcast_to(np.array(colour, np.uint8), (1, 16, 16, 3)).copy()
        back = av.VideoFrame.from_ndarray(rgb_to_yuv420p(flat)[0], format="yuv420p").to_ndarray(format="rgb24")
        assert np.abs(back.astype(int) - colour).max() <= 2, (colour, back[0, 0])


# ---------------------------------------------------------------------------------- gui_click

def test_gui_click_episodes_are_solved_by_clicking(built, tmp_path):
    """Every sample's desktop rebuilds from its metadata, its first screenshot is the sample's
    image, and only the expert's two clicks (grid cells, as the prompt says) succeed."""
    import asyncio

    from mmrl.tools.base import run_tool
    from mmrl.tools.gui import GuiEnvironment, expert_actions, render_screen, spec_from_sample

    for layout, out in (("random", built["gui_click"][0]), ("fixed", None)):
        if out is None:
            out = str(tmp_path / "fixed")
            resolve("dataset", "gui_click")(out, train_size=18, heldout_size=9, shard_size=9, seed=1)
            assert Counter(r["answer"] for r in records(out, "heldout")) == Counter(
                e.split("/")[1] for e in gui_click._fixed_tasks())
        samples = load_all(os.path.join(out, "heldout-000000.tar"))
        for s in samples:
            spec = spec_from_sample(s)
            assert "click X Y" in s.prompt_text and s.answer == spec.task.item
            assert np.array_equal(np.asarray(render_screen(spec)), np.asarray(s.images[0].convert("RGB")))
            env = GuiEnvironment(s, grid=gui_click.GRID)
            for function, arguments in expert_actions(spec, grid=gui_click.GRID):
                result, _ = asyncio.run(run_tool(env, function, arguments, timeout_s=30))
                assert not result.error and len(result.images) == 1
            assert env.state()["success"] and result.done


def test_gui_click_with_marks_or_a_coarser_grid(tmp_path):
    """`marks=true`: the screenshots carry the tags the tool's marks mode reads and the prompt
    says `click N`; `grid=N` changes the prompt, and a grid too coarse to hit every target is
    refused at build time, naming the fix."""
    import asyncio

    from mmrl.tools.base import run_tool
    from mmrl.tools.gui import GuiEnvironment, expert_actions, render_screen, spec_from_sample

    build = resolve("dataset", "gui_click")
    build(str(tmp_path / "marks"), train_size=9, heldout_size=9, shard_size=9, seed=2, marks=True)
    for s in load_all(str(tmp_path / "marks" / "heldout-000000.tar")):
        spec = spec_from_sample(s)
        assert "click N" in s.prompt_text
        assert np.array_equal(np.asarray(render_screen(spec, marks=True)), np.asarray(s.images[0].convert("RGB")))
        env = GuiEnvironment(s, marks=True)
        for function, arguments in expert_actions(spec, marks=True):
            result, _ = asyncio.run(run_tool(env, function, arguments, timeout_s=30))
            assert not result.error
        assert env.state()["success"]
    build(str(tmp_path / "six"), train_size=9, heldout_size=9, shard_size=9, seed=2, grid=6)
    assert all("0-5" in s.prompt_text for s in load_all(str(tmp_path / "six" / "heldout-000000.tar")))
    with pytest.raises(ValueError, match="larger grid"):
        build(str(tmp_path / "three"), train_size=9, heldout_size=9, shard_size=9, seed=2, grid=3)


def test_a_scripted_gui_click_episode_as_configured(tmp_path, tiny_model_dir):
    """configs/gui_click.yaml's loop (forced `open` then `click`, marks, two turns) with an engine
    that writes the expert's two numbers: both verbs are the loop's tokens (loss mask 0, the
    second inside the tool turn's span), the model's tokens are the numbers, the desktop reports
    success and the configured reward scores it 1; a wrong first number opens another menu and
    earns only the call credit; a refused first action (no such tag, or a tag that is not a menu)
    ends the episode."""
    import yaml

    from mmrl.processors import build_processor
    from mmrl.plugins.rewards.tool_state import tool_success
    from mmrl.rollout.agent_loops import AgentContext, ScriptedClient
    from mmrl.rollout.tool_loop import multi_turn
    from mmrl.rollout.types import CALL_SEED_STRIDE, RequestSampling
    from mmrl.tools.gui import expert_actions, spec_from_sample

    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "gui_click.yaml").read_text())
    loop_args = cfg["rollout"]["agent_loop_args"]
    (reward,) = cfg["rewards"]
    processor = build_processor("auto", str(tiny_model_dir), max_pixels=cfg["processor"]["max_pixels"])
    tok = processor.tokenizer
    resolve("dataset", "gui_click")(str(tmp_path / "g"), train_size=9, heldout_size=9, shard_size=9, seed=2, marks=True)
    sample = load_all(str(tmp_path / "g" / "heldout-000000.tar"))[0]
    marks = [a["mark"] for _, a in expert_actions(spec_from_sample(sample), marks=True)]

    clients = []

    def episode(texts):
        clients.append(ScriptedClient(tok, texts, finish_reason="length"))
        ctx = AgentContext(client=clients[-1], processor=processor, args=loop_args,
                           sampling=RequestSampling(max_tokens=cfg["rollout"]["max_new_tokens"], seed=5))
        return asyncio.run(multi_turn(ctx, sample, processor(sample)))

    t = episode([str(m) for m in marks])
    assert t.tool_state["success"] and t.stats["turns"] == 2 and t.stats["tool_errors"] == 0
    assert [s.seed for s in clients[-1].samplings] == [5, 5 + CALL_SEED_STRIDE]  # each turn its own draws
    assert loop_args["tool_choice"] == ["open", "click"]
    assert [turn["content"] for turn in t.transcript if turn["role"] == "assistant"] == [f"open{marks[0]}",
                                                                                       f"click{marks[1]}"]
    model_tokens = [i for i, m in zip(t.response_ids, t.loss_mask) if m]
    assert model_tokens == [tok.convert_tokens_to_ids(str(m)) for m in marks]
    open_, click = (tok(verb, add_special_tokens=False)["input_ids"] for verb in ("open", "click"))
    assert t.response_ids[:len(open_)] == open_ and t.loss_mask[:len(open_)] == [0] * len(open_)
    second = t.loss_mask.index(1, len(open_) + 1)  # the second model token: "click" just before it
    assert t.response_ids[second - len(click):second] == click and t.loss_mask[second - len(click):second] == [0] * len(click)
    assert len(t.response_ids) <= loop_args["max_total_tokens"]
    assert tool_success(t.tool_state, t.transcript, **reward["args"])["score"] == 1.0
    refused = episode(["9", str(marks[0])])  # no tag 9: refused, and max_tool_errors: 1 ends the episode
    assert refused.finish_reason == "tool_error" and refused.stats == {**refused.stats, "turns": 1.0, "tool_errors": 1.0}
    assert refused.tool_state["progress"] == 0.0 and "mark must be one of" in refused.transcript[-1]["content"]
    loop_args = {**loop_args, "tool_choice": ["opn", "click"]}
    with pytest.raises(ValueError, match="tool_choice names 'opn', not a function of the configured tools"):
        episode(["0", "0"])
    loop_args = cfg["rollout"]["agent_loop_args"]
    not_a_menu = episode(["3", str(marks[1])])  # tag 3 is the text field: `open` takes menu headers only
    assert not_a_menu.finish_reason == "tool_error" and "open takes the tag of a menu header (0, 1, 2)" in \
        not_a_menu.transcript[-1]["content"]
    wrong = episode([str((marks[0] + 1) % 3), str(marks[1])])
    assert not wrong.tool_state["success"] and wrong.tool_state["progress"] == 0.0
    assert tool_success(wrong.tool_state, wrong.transcript, **reward["args"])["score"] == pytest.approx(0.1)


def test_counting_grid_layout_puts_one_shape_per_cell(tmp_path):
    """layout=grid (the tiny model's counting config): every shape inside its own 28-px cell, so each
    merged image token holds a whole shape or none; the pixels still show `count` separate shapes."""
    counting.build(str(tmp_path), train_size=40, heldout_size=4, shard_size=100, layout="grid")
    for key, m in read_split(str(tmp_path), "train").items():
        rec = json.loads(m["json"])
        boxes = rec["metadata"]["boxes"]
        cells = {(x1 // 28, y1 // 28) for x1, y1, _, _ in boxes}
        assert len(cells) == len(boxes) == rec["metadata"]["count"], key
        for x1, y1, x2, y2 in boxes:  # inside its cell, one pixel from the edge
            assert x1 % 28 >= 1 and y1 % 28 >= 1 and (x2 - 1) // 28 == x1 // 28 and (y2 - 1) // 28 == y1 // 28
        img = np.asarray(Image.open(io.BytesIO(m["png"])))
        assert len(components(saturated(img))) == rec["metadata"]["count"], key
    with pytest.raises(ValueError, match="grid_cells"):
        counting.build(str(tmp_path), train_size=2, heldout_size=2, layout="grid", grid_cells=2)
    with pytest.raises(ValueError, match="layout"):
        counting.build(str(tmp_path), train_size=2, heldout_size=2, layout="rows")
