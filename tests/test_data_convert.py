"""Converters: JSONL + media folder, Parquet (verl / EasyR1 columns), a `save_to_disk` folder (arrow
files written here with pyarrow in the `datasets` layout). Convert, then read back with `load_all`:
same prompts, answers and pixels; shard sizes near the target; bad rows reported, not fatal."""
from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pytest
from PIL import Image

from mmrl.cli import main
from mmrl.plugins.data.convert import convert, convert_row
from mmrl.plugins.data.recipes._common import encode_mp4
from mmrl.data.stream import load_all

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def noise_image(seed: int, size=(48, 40), fmt="PNG") -> tuple[bytes, np.ndarray]:
    """Encoded bytes and the RGB pixels a decoder gives back."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    data = buf.getvalue()
    return data, np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def pixels(img: Image.Image) -> np.ndarray:
    return np.asarray(img.convert("RGB"))


def tiny_mp4(frames: int = 6) -> bytes:
    video = np.full((frames, 32, 32, 3), 120, np.uint8)
    for t in range(frames):
        video[t, 10:20, 2 + 3 * t:12 + 3 * t] = (220, 30, 30)
    return encode_mp4(video, fps=3)


def shards(out: str, split: str = "train") -> list[str]:
    return sorted(os.path.join(out, n) for n in os.listdir(out) if n.startswith(split + "-") and n.endswith(".tar"))


def tar_keys(path: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    with tarfile.open(path) as tf:
        for ti in tf:
            key, _, ext = ti.name.partition(".")
            out.setdefault(key, set()).add(ext)
    return out


# --------------------------------------------------------------------------------------- JSONL

@pytest.fixture()
def jsonl_source(tmp_path):
    media = tmp_path / "media"
    (media / "sub").mkdir(parents=True)
    imgs = {}
    for name, seed, fmt in (("a.png", 1, "PNG"), ("b.png", 2, "PNG"), ("sub/d.png", 3, "PNG"),
                            ("c.jpg", 4, "JPEG"), ("e.bmp", 5, "BMP")):
        data, px = noise_image(seed, fmt=fmt)
        (media / name).write_bytes(data)
        imgs[name] = (data, px)
    (media / "clip.mp4").write_bytes(tiny_mp4())
    (media / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    rows = [
        {"prompt": "What is in the picture?", "answer": "noise", "images": ["a.png"]},
        {"problem": "<image> left and <image> right: same?", "solution": "no",
         "images": ["b.png", "sub/d.png"], "id": "x1"},
        {"question": "Describe.", "answer": 3, "images": ["c.jpg"], "extra": {"k": 1}},
        {"prompt": "Which way?", "answer": "right", "videos": ["clip.mp4"]},
        {"prompt": "Text only.", "answer": "ok", "system": "Be brief."},
        {"prompt": "A bitmap.", "answer": "bmp", "image": "e.bmp"},
        {"prompt": "missing", "answer": "x", "images": ["nope.png"]},
        "not json {",
        {"answer": "no prompt here"},
        {"prompt": "garbage", "answer": "x", "images": ["bad.png"]},
        {"prompt": "<image><image> two markers, one image", "answer": "x", "images": ["a.png"]},
    ]
    src = tmp_path / "data.jsonl"
    src.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return src, media, imgs


def test_jsonl_round_trip(jsonl_source, tmp_path):
    src, media, imgs = jsonl_source
    out = str(tmp_path / "out")
    info = convert(str(src), out, source_format="jsonl", media_root=str(media))
    assert info["counts"] == info["converted"] == {"train": 6} and info["rows"] == 11
    assert info["bad"]["count"] == 5
    assert info["bad"]["reasons"] == {"missing image": 1, "invalid json line": 1, "no prompt": 1,
                                      "undecodable image": 1, "image count mismatch": 1}
    assert any("row 6" in e and "nope.png" in e for e in info["bad"]["examples"])
    with open(os.path.join(out, "dataset.json")) as f:
        assert json.load(f) == info

    samples = load_all(os.path.join(out, info["shards"]["train"]))
    assert [s.answer for s in samples] == ["noise", "no", 3, "right", "ok", "bmp"]
    assert [s.metadata["source_index"] for s in samples] == [0, 1, 2, 3, 4, 5]
    a, b, c, v, t, bmp = samples
    assert a.prompt_text == "What is in the picture?" and len(a.images) == 1
    assert np.array_equal(pixels(a.images[0]), imgs["a.png"][1])
    # <image> markers place the images inside the text
    assert [p["type"] for p in b.messages[-1]["content"]] == ["image", "text", "image", "text"]
    assert b.prompt_text == "left and right: same?" and b.metadata["id"] == "x1"
    assert [np.array_equal(pixels(im), imgs[n][1]) for im, n in zip(b.images, ["b.png", "sub/d.png"])] == [True, True]
    assert np.array_equal(pixels(c.images[0]), imgs["c.jpg"][1]) and c.metadata["extra"] == {"k": 1}
    assert len(v.videos) == 1 and v.videos[0].total_num_frames == 6 and not v.images
    assert t.messages[0] == {"role": "system", "content": "Be brief."} and not t.images
    assert np.array_equal(pixels(bmp.images[0]), imgs["e.bmp"][1])  # re-encoded losslessly as PNG

    members = tar_keys(shards(out)[0])
    assert members["train-00000000"] == {"json", "png"}
    assert members["train-00000001"] == {"json", "0.png", "1.png"}
    assert members["train-00000002"] == {"json", "jpg"}  # JPEG bytes kept, not re-encoded
    assert members["train-00000003"] == {"json", "mp4"}
    assert members["train-00000005"] == {"json", "png"}
    with tarfile.open(shards(out)[0]) as tf:
        assert tf.extractfile("train-00000002.jpg").read() == imgs["c.jpg"][0]
        rec = json.loads(tf.extractfile("train-00000000.json").read())
    assert rec["prompt"] == "What is in the picture?" and rec["images"] == ["png"] and "messages" not in rec


def test_jsonl_cli_and_default_media_root(jsonl_source, tmp_path, capsys):
    src, media, _ = jsonl_source
    # without --media-root, paths are relative to the source's folder: here they all miss
    out = str(tmp_path / "cli")
    rc = main(["data", "convert", "--from", "jsonl", "--src", str(src), "--out", out,
               "--split", "valid", "--shard-size-mb", "1"])
    text = capsys.readouterr().out
    assert rc == 0 and "converted 1 of 11 row(s)" in text  # only the text-only row
    assert "missing image" in text and "missing video" in text
    rc = main(["data", "convert", "--from", "jsonl", "--src", str(src), "--out", out,
               "--media-root", str(media)])
    text = capsys.readouterr().out
    assert rc == 0 and "converted 6 of 11 row(s)" in text and "skipped 5 bad row(s)" in text
    with open(os.path.join(out, "dataset.json")) as f:
        info = json.load(f)
    # the second conversion into the folder keeps the first one's split
    assert info["counts"] == {"train": 6, "valid": 1}
    assert set(info["shards"]) == {"train", "valid"}
    assert main(["data", "convert", "--from", "jsonl", "--src", str(tmp_path / "nothing.jsonl"),
                 "--out", out]) == 2


# ------------------------------------------------------------------------------------- Parquet

def test_parquet_verl_style_bytes_and_shard_size(tmp_path):
    n = 40
    images = [noise_image(100 + i, size=(64, 64)) for i in range(n)]
    rows = {
        "data_source": ["synthetic"] * (n + 1),
        "prompt": [[{"role": "user", "content": "<image>What colour is this?"}] for _ in range(n + 1)],
        "images": [[{"bytes": data, "path": None}] for data, _ in images] + [[{"bytes": b"junk", "path": None}]],
        "reward_model": [{"ground_truth": f"c{i}", "style": "rule"} for i in range(n + 1)],
        "extra_info": [{"index": i, "split": "train"} for i in range(n + 1)],
    }
    src = tmp_path / "train.parquet"
    pq.write_table(pa.table(rows), src, row_group_size=16)
    out = str(tmp_path / "out")
    target_mb = 0.05
    info = convert(str(src), out, source_format="parquet", shard_size_mb=target_mb)
    assert info["counts"] == {"train": n}
    assert info["bad"]["count"] == 1 and info["bad"]["reasons"] == {"undecodable image": 1}
    files = shards(out)
    sizes = [os.path.getsize(p) for p in files]
    assert all(s <= target_mb * 1e6 for s in sizes), sizes
    total = sum(sizes)
    # shards are filled, not tiny: at least half full (here two ~14 kB samples fill a shard, as a
    # third would cross 50 kB once tar pads the file to whole 10 KiB records)
    assert len(files) <= total / (target_mb * 1e6) * 2 + 1
    assert len(files) == info["num_shards"]["train"] >= 3

    samples = load_all(os.path.join(out, info["shards"]["train"]))
    assert [s.answer for s in samples] == [f"c{i}" for i in range(n)]
    for s, (_, px) in zip(samples, images):
        assert s.prompt_text == "What colour is this?"
        assert [p["type"] for p in s.messages[-1]["content"]] == ["image", "text"]
        assert np.array_equal(pixels(s.images[0]), px)
        assert s.metadata["data_source"] == "synthetic" and s.metadata["reward_model"]["style"] == "rule"
        assert s.metadata["extra_info"]["index"] == s.metadata["source_index"]


def test_parquet_easyr1_style_paths(tmp_path):
    media = tmp_path / "imgs"
    media.mkdir()
    expected = []
    for i in range(4):
        data, px = noise_image(200 + i)
        (media / f"{i}.png").write_bytes(data)
        expected.append(px)
    table = pa.table({"problem": [f"<image>Question {i}?" for i in range(4)],
                      "answer": [str(i) for i in range(4)],
                      "images": [[f"{i}.png"] for i in range(4)]})
    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(table.slice(0, 2), folder / "part-0.parquet")
    pq.write_table(table.slice(2, 2), folder / "part-1.parquet")
    out = str(tmp_path / "out")
    info = convert(str(folder), out, source_format="parquet", media_root=str(media), split="heldout")
    assert info["counts"] == {"heldout": 4} and info["bad"]["count"] == 0
    samples = load_all(os.path.join(out, info["shards"]["heldout"]))
    assert [s.prompt_text for s in samples] == [f"Question {i}?" for i in range(4)]
    assert [s.answer for s in samples] == ["0", "1", "2", "3"]
    assert all(np.array_equal(pixels(s.images[0]), px) for s, px in zip(samples, expected))


# ------------------------------------------------------------------------- save_to_disk folder


def write_saved_dataset(folder, columns: dict, features: dict, schema_fields: list, chunks: int = 2) -> None:
    """What `datasets.Dataset.save_to_disk` writes: arrow IPC stream files, state.json, dataset_info.json."""
    folder.mkdir(parents=True)
    schema = pa.schema(schema_fields, metadata={"huggingface": json.dumps({"info": {"features": features}})})
    table = pa.table(columns, schema=schema)
    n = table.num_rows
    step = -(-n // chunks)
    files = []
    for k in range(chunks):
        name = f"data-{k:05d}-of-{chunks:05d}.arrow"
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            writer.write_table(table.slice(k * step, step), max_chunksize=3)
        files.append({"filename": name})
    (folder / "state.json").write_text(json.dumps({
        "_data_files": files, "_fingerprint": "0123456789abcdef", "_format_columns": None,
        "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}))
    (folder / "dataset_info.json").write_text(json.dumps({
        "citation": "", "description": "", "features": features, "homepage": "", "license": ""}))


def hf_columns(n: int, seed: int):
    image_t = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    imgs = [noise_image(seed + i) for i in range(n)]
    columns = {"picture": [{"bytes": d, "path": f"img_{i}.png"} for i, (d, _) in enumerate(imgs)],
               "question": [f"How many dots in image {i}?" for i in range(n)],
               "answer": list(range(n)),
               "id": [f"id-{seed + i}" for i in range(n)]}
    features = {"picture": {"_type": "Image"}, "question": {"dtype": "string", "_type": "Value"},
                "answer": {"dtype": "int64", "_type": "Value"}, "id": {"dtype": "string", "_type": "Value"}}
    fields = [("picture", image_t), ("question", pa.string()), ("answer", pa.int64()), ("id", pa.string())]
    return columns, features, fields, [px for _, px in imgs]


def test_hf_saved_dataset(tmp_path):
    columns, features, fields, expected = hf_columns(7, 300)
    src = tmp_path / "saved"
    write_saved_dataset(src, columns, features, fields)
    out = str(tmp_path / "out")
    info = convert(str(src), out, source_format="hf")
    assert info["counts"] == {"train": 7} and info["bad"]["count"] == 0
    samples = load_all(os.path.join(out, info["shards"]["train"]))
    # "picture" is an image column because dataset_info.json says Image, not because of its name
    assert [len(s.images) for s in samples] == [1] * 7
    assert [s.answer for s in samples] == list(range(7))
    assert [s.prompt_text for s in samples] == [f"How many dots in image {i}?" for i in range(7)]
    assert [s.metadata["id"] for s in samples] == [f"id-{300 + i}" for i in range(7)]
    assert all(np.array_equal(pixels(s.images[0]), px) for s, px in zip(samples, expected))


def test_hf_saved_dataset_dict(tmp_path):
    src = tmp_path / "dd"
    expected = {}
    for split, n, seed in (("train", 5, 400), ("test", 3, 500)):
        columns, features, fields, expected[split] = hf_columns(n, seed)
        if split == "test":
            columns["picture"][1] = {"bytes": None, "path": "/nowhere/gone.png"}
        write_saved_dataset(src / split, columns, features, fields, chunks=1)
    (src / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    out = str(tmp_path / "out")
    info = convert(str(src), out, source_format="hf")
    assert info["counts"] == {"train": 5, "test": 2}
    assert info["bad"]["reasons"] == {"missing image": 1}
    assert "gone.png" in info["bad"]["examples"][0]
    for split in ("train", "test"):
        samples = load_all(os.path.join(out, info["shards"][split]))
        keep = [px for i, px in enumerate(expected[split]) if not (split == "test" and i == 1)]
        assert all(np.array_equal(pixels(s.images[0]), px) for s, px in zip(samples, keep))
        assert len(samples) == len(keep)


def test_convert_row_contract():
    record, members = convert_row({"prompt": [{"role": "system", "content": "sys"},
                                              {"role": "user", "content": "hi"}], "answer": "a"})
    assert members == {} and record["prompt"] == "hi" and record["system"] == "sys"
    with pytest.raises(ValueError, match="no answer"):
        convert_row({"prompt": "q"})
    record, _ = convert_row({"prompt": "q"}, require_answer=False)
    assert record["answer"] is None
    with pytest.raises(ValueError, match="remote image"):
        convert_row({"prompt": "q", "answer": 1, "images": ["https://example.org/a.png"]})
