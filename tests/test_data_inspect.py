"""`mmrl data inspect`: counts, media, answers, prompt lengths, and the bad samples it finds in
real shards (a corrupt image, bad JSON, a missing member, a truncated shard)."""
from __future__ import annotations

import json
import os
import shutil
import tarfile

import pytest

from _data_media import write_tar
from mmrl.cli import main
from mmrl.data.inspect import inspect_shards
from mmrl.plugins.data.recipes.colors import COLOURS, PROMPT
from mmrl.plugins.data.recipes.colors import build as build_colors



@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """24 good colour samples in 3 shards, plus a shard with 1 good and 3 bad samples."""
    out = tmp_path_factory.mktemp("inspect")
    build_colors(str(out), train_size=18, heldout_size=6, shard_size=9, seed=0)
    with tarfile.open(out / "heldout-000000.tar") as tf:
        good_json = tf.extractfile("heldout-000000.json").read()
        good_png = tf.extractfile("heldout-000000.png").read()
    write_tar(out / "extra-000000.tar", [
        ("ok-1", {"json": good_json, "png": good_png}),
        ("bad-png", {"json": good_json, "png": good_png[:200]}),
        ("bad-json", {"json": b"{not json", "png": good_png}),
        ("no-member", {"json": json.dumps({"prompt": "two?", "answer": "x",
                                           "images": ["0.png", "1.png"]}).encode(), "0.png": good_png}),
    ])
    return out


def test_cli_prints_counts_and_bad_samples(shards, capsys):
    assert main(["data", "inspect", str(shards)]) == 0
    text = capsys.readouterr().out
    assert "shards             4" in text
    assert "samples            28 (25 good, 3 bad)" in text
    assert "image size (WxH)" in text and "56x56" in text
    assert "prompt length (characters)" in text and f"median {len(PROMPT)}" in text
    assert "corrupt_image" in text and "bad-png" in text
    assert "bad_json" in text and "bad-json" in text
    assert "missing_media" in text and "no-member" in text
    # answers: the top colours are listed with counts (train and held-out are balanced)
    assert any(line.split()[:1] == ["red"] for line in text.splitlines())


def test_json_output_and_patterns(shards, capsys):
    pattern = str(shards / "train-{000000..000001}.tar")
    assert main(["data", "inspect", pattern, str(shards / "extra-000000.tar"), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["shards"]["count"] == 3
    assert stats["samples"] == {"total": 22, "good": 19, "bad": 3, "limited": False}
    assert stats["media"]["images"] == 19 and stats["media"]["images_per_sample"] == {"1": 19}
    assert stats["media"]["image_size"] == {"min": [56, 56], "median": [56, 56], "max": [56, 56]}
    assert stats["media"]["videos"] == 0
    assert {a for a, _ in stats["answers"]["top"]} <= set(COLOURS)
    assert sum(n for _, n in stats["answers"]["top"]) == 19
    assert stats["bad"]["reasons"] == {"corrupt_image": 1, "bad_json": 1, "missing_media": 1}
    assert stats["bad"]["examples"]["corrupt_image"][0]["key"] == "bad-png"
    assert stats["prompt_length"]["unit"] == "characters"


def test_limit_and_truncated_shard(shards, tmp_path):
    stats = inspect_shards(str(shards / "train-000000.tar"), limit=4)
    assert stats["samples"]["total"] == 4 and stats["samples"]["limited"]
    broken = tmp_path / "broken-000000.tar"
    shutil.copy(shards / "train-000000.tar", broken)
    with open(broken, "r+b") as f:
        f.truncate(os.path.getsize(broken) // 2 + 100)
    stats = inspect_shards(str(broken))
    assert 0 < stats["samples"]["good"] < 9
    assert "shard_read_error" in stats["bad"]["reasons"]
    assert stats["shards"]["errors"] == 1


def test_model_tokenizer_lengths(shards, tmp_path):
    from mmrl.models.tiny_vlm import build_tokenizer

    tok = build_tokenizer(tmp_path / "tok")
    stats = inspect_shards(str(shards / "heldout-000000.tar"), model=str(tmp_path / "tok"))
    n = len(tok(PROMPT, add_special_tokens=False)["input_ids"])
    assert stats["prompt_length"]["unit"] == "tokens"
    assert stats["prompt_length"]["min"] == stats["prompt_length"]["max"] == n < len(PROMPT)


def test_video_stats(tmp_path, capsys):
    from mmrl.plugins.data.recipes.video_motion import build

    build(str(tmp_path), train_size=4, heldout_size=0, frames=10, fps=5, width=48, height=32)
    stats = inspect_shards(str(tmp_path))
    assert stats["samples"]["good"] == 4 and stats["media"]["videos"] == 4
    assert stats["media"]["video_frames"]["min"] == stats["media"]["video_frames"]["max"] == 10
    assert stats["media"]["video_duration"]["median"] == pytest.approx(2.0)
    assert stats["media"]["video_size"]["median"] == [48, 32]
    assert main(["data", "inspect", str(tmp_path)]) == 0
    assert "video frames" in capsys.readouterr().out


def test_model_processor_limits_report_refused_images(tmp_path, tiny_model_dir, capsys):
    """With --model the shards are checked against that model's processor limits, as training checks
    them in the loader workers: a banner and a 1xN strip are bad (processor_limit); tiny images are not."""
    from _data_media import image_bytes, js

    sizes = {"banner": (8000, 12), "strip": (1, 300), "tiny": (1, 1), "small": (13, 13), "normal": (64, 48)}
    url = write_tar(tmp_path / "odd-000000.tar", [(k, {"json": js(prompt="What colour?", answer="red"),
                                                         "png": image_bytes(size=wh)}) for k, wh in sizes.items()])
    plain = inspect_shards(url)
    assert plain["samples"]["good"] == 5 and plain["media_limits"] is None
    stats = inspect_shards(url, model=str(tiny_model_dir))
    assert stats["samples"]["good"] == 3 and stats["bad"]["reasons"] == {"processor_limit": 2}
    examples = stats["bad"]["examples"]["processor_limit"]
    assert {e["key"] for e in examples} == {"banner", "strip"}
    assert all("aspect ratio" in e["detail"] for e in examples)
    assert stats["media_limits"]["max_aspect_ratio"] == 200.0
    assert main(["data", "inspect", url, "--model", str(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    assert "processor_limit" in out and "qwen_vl processor" in out
