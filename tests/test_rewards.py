"""Reward calling convention, built-in rewards and RewardSet, used the way a user would."""
from __future__ import annotations

import io
import math
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from mmrl.data.sample import Sample, messages_from_prompt
from mmrl.registry import PluginError, resolve
from mmrl.rewards import AVAILABLE_KEYS, RewardError, RewardSet, call_reward, reward_kwargs
from mmrl.plugins.rewards.answer import answer_match
from mmrl.plugins.rewards.colour import detect_colour, shape_colour

REPO = Path(__file__).resolve().parents[1]

# The palette of data/recipes/colors.py (written here so a palette change is a visible diff).
PALETTE = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (230, 220, 30),
    "purple": (140, 40, 170),
    "orange": (245, 140, 20),
}


def render(colour: str, seed: int, size: int = 64, frac: float = 0.8, circle: bool = False) -> Image.Image:
    """Grey background (~128), a filled square/circle of `frac` of the side, pixel noise σ=12."""
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (size, size), (128, 128, 128))
    side = int(frac * size)
    x0 = int(rng.integers(0, size - side + 1))
    y0 = int(rng.integers(0, size - side + 1))
    box = (x0, y0, x0 + side - 1, y0 + side - 1)
    draw = ImageDraw.Draw(img)
    (draw.ellipse if circle else draw.rectangle)(box, fill=PALETTE[colour])
    px = np.asarray(img, np.float32) + rng.normal(0, 12, (size, size, 3))
    return Image.fromarray(np.clip(np.rint(px), 0, 255).astype(np.uint8), "RGB")


def make_sample(image: Image.Image | None = None, answer="red") -> Sample:
    images = [image] if image is not None else []
    return Sample(key="k0", messages=messages_from_prompt("What colour is the shape?", n_images=len(images)),
                  images=images, answer=answer, metadata={"split": "train"})


# ------------------------------------------------------------------------------- call_reward

def test_call_reward_passes_only_declared_keywords() -> None:
    def length(response):  # would raise TypeError if handed anything else
        return len(response)

    kw = reward_kwargs(make_sample(render("red", 0)), "hello", [1, 2, 3])
    assert call_reward(length, **kw) == {"score": 5.0}

    def kwonly(*, answer, response_ids):
        return float(len(response_ids)) + (answer == "red")

    assert call_reward(kwonly, **kw) == {"score": 4.0}


def test_call_reward_var_kwargs_receives_everything_incl_images() -> None:
    seen = {}

    def spy(response, **kwargs):
        seen.update(kwargs, response=response)
        return 1

    img = render("blue", 1)
    sample = make_sample(img, answer=["blue", "navy"])
    assert call_reward(spy, **reward_kwargs(sample, "blue", [7])) == {"score": 1.0}
    assert set(seen) == set(AVAILABLE_KEYS)
    assert seen["images"][0] is img and isinstance(seen["images"][0], Image.Image)
    assert seen["answer"] == ["blue", "navy"] and seen["response_ids"] == [7]
    assert seen["prompt"] == "What colour is the shape?" and seen["sample"] is sample
    assert seen["metadata"] == {"split": "train"} and seen["messages"] is sample.messages


def test_call_reward_normalises_results() -> None:
    assert call_reward(lambda **_: {"score": 1, "format": 0.5, "reason": "ok", "x": None}) == \
        {"score": 1.0, "format": 0.5}
    assert call_reward(lambda **_: True) == {"score": 1.0}
    assert call_reward(lambda **_: np.float32(0.25)) == {"score": 0.25}
    assert call_reward(lambda **_: torch.tensor(0.5)) == {"score": 0.5}
    assert call_reward(lambda **_: {"score": np.int64(2), "len": torch.tensor(3)}) == {"score": 2.0, "len": 3.0}
    for v in call_reward(lambda **_: {"score": np.float64(1)}).values():
        assert type(v) is float


def my_broken_reward(response, **_):
    return response  # a str: wrong


@pytest.mark.parametrize("bad", ["0.5", None, [1.0], {"format": 1.0}, {"score": "high"},
                                 float("nan"), float("inf"), {"score": 1.0, "len": float("nan")}])
def test_call_reward_bad_returns_name_the_reward(bad) -> None:
    def my_bad_reward(**_):
        return bad

    with pytest.raises(RewardError, match="my_bad_reward"):
        call_reward(my_bad_reward, response="x")
    with pytest.raises(RewardError, match="my_broken_reward"):
        call_reward(my_broken_reward, response="x")


def test_call_reward_missing_parameter_and_async() -> None:
    def needs_boxes(response, boxes):
        return 0.0

    with pytest.raises(RewardError, match=r"needs_boxes.*boxes"):
        call_reward(needs_boxes, **reward_kwargs(make_sample(), "r", []))

    async def slow(response):  # awaited: async rewards are a supported variant
        return 1.0

    assert call_reward(slow, response="r") == {"score": 1.0}

    async def later(response):
        return 1.0

    with pytest.raises(RewardError, match="async def"):  # an awaitable from a plain function
        call_reward(lambda response: later(response), response="r")


# ------------------------------------------------------------------------------- answer_match

@pytest.mark.parametrize("response, answer, kwargs, expected", [
    ("Red", "red", {}, 1.0),
    ("  RED.  ", "red", {}, 1.0),
    ("red!!!", "Red", {}, 1.0),
    ("New   York", "new york", {}, 1.0),
    ("blue", "red", {}, 0.0),
    ("red, I think", "red", {}, 0.0),
    ("red, I think", "red", {"first_word": True}, 1.0),
    ("**Red** is the colour", "red", {"first_word": True}, 1.0),
    ("I think red", "red", {"first_word": True}, 0.0),
    ("", "red", {}, 0.0),
    ("", "red", {"first_word": True}, 0.0),
    ("   \n\t ", "red", {}, 0.0),
    ("!!!???", "red", {}, 0.0),
    ("\x00\ufffd\U0001f600 ☃", "red", {}, 0.0),
    ("navy", ["blue", "navy"], {}, 1.0),
    ("green", ["blue", "navy"], {}, 0.0),
    ("42", 42, {}, 1.0),
    ("3.5", "35", {}, 0.0),     # a decimal point is not punctuation
    ("-2", "2", {}, 0.0),       # nor is a leading minus
    ("red", None, {}, 0.0),
    ("", "", {}, 0.0),          # an empty answer never matches
    (None, "red", {}, 0.0),
])
def test_answer_match_cases(response, answer, kwargs, expected) -> None:
    assert answer_match(response=response, answer=answer, **kwargs) == expected


def test_answer_match_huge_response() -> None:
    huge = "red " + "x" * 100_000
    assert answer_match(huge, "red") == 0.0
    assert answer_match(huge, "red", first_word=True) == 1.0
    assert answer_match("!" * 100_000 + " red", "red") == 1.0


def test_answer_match_through_call_reward() -> None:
    kw = reward_kwargs(make_sample(answer=["Red", "crimson"]), "crimson.", [1])
    assert call_reward(resolve("reward", "answer_match"), **kw) == {"score": 1.0}


# ------------------------------------------------------------------------------- shape_colour

@pytest.mark.parametrize("colour", list(PALETTE))
def test_shape_colour_reads_the_image(colour: str) -> None:
    for seed, (frac, circle) in enumerate([(0.6, False), (0.6, True), (0.8, True), (1.0, False)]):
        img = render(colour, seed, frac=frac, circle=circle)
        assert detect_colour(img) == colour
        assert shape_colour(response=f"{colour.capitalize()}.", images=[img]) == {"score": 1.0, "format": 1.0}
        wrong = next(c for c in PALETTE if c != colour)
        assert shape_colour(response=wrong, images=[img]) == {"score": 0.0, "format": 1.0}
        assert shape_colour(response="banana " + colour, images=[img]) == {"score": 0.0, "format": 0.0}
        assert shape_colour(response="", images=[img]) == {"score": 0.0, "format": 0.0}


def test_shape_colour_survives_jpeg_and_modes() -> None:
    for colour in PALETTE:
        img = render(colour, 7, frac=0.6, circle=True)
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=75)
        jpg = Image.open(io.BytesIO(buf.getvalue()))
        assert detect_colour(jpg) == colour
        assert detect_colour(img.convert("RGBA")) == colour
        assert detect_colour(np.asarray(img)) == colour


def test_shape_colour_matches_the_recipe() -> None:
    colors = pytest.importorskip("mmrl.plugins.data.recipes.colors")
    assert colors.COLOURS == PALETTE
    rng = np.random.default_rng(0)
    for i in range(240):
        colour = list(PALETTE)[i % 6]
        assert detect_colour(colors.render(colour, rng)) == colour


def test_shape_colour_through_reward_set_without_answer() -> None:
    # the truth comes from the pixels: the sample's answer is not consulted
    rs = RewardSet([{"name": "shape_colour"}])
    sample = make_sample(render("purple", 3), answer=None)
    assert rs.score(sample, "purple", []) == {"score": 1.0, "shape_colour/score": 1.0,
                                              "shape_colour/format": 1.0}
    with pytest.raises(ValueError, match="image"):
        rs.score(make_sample(None), "purple", [])


# ------------------------------------------------------------------------------- RewardSet

def test_reward_set_weights_and_prefixes() -> None:
    rs = RewardSet([
        {"name": "shape_colour", "weight": 1.0},
        {"name": "answer_match", "weight": 0.5, "args": {"first_word": True}},
    ])
    assert rs.names == ["shape_colour", "answer_match"]
    out = rs.score(make_sample(render("red", 0), answer="red"), "red is my answer", [1, 2])
    assert out == {"score": 1.5, "shape_colour/score": 1.0, "shape_colour/format": 1.0,
                   "answer_match/score": 1.0}
    out = rs.score(make_sample(render("green", 0), answer="red"), "red", [1])
    assert out["score"] == pytest.approx(0.5) and out["shape_colour/score"] == 0.0
    assert rs(make_sample(render("green", 0), answer="red"), "green", []) ["score"] == 1.0


def test_yaml_booleans_where_a_reward_expects_text_are_refused_before_the_run(tmp_path) -> None:
    """`words: [yes, no]` in YAML is [True, False]: the format credit would silently never pay
    (it happened: configs/multi_image.yaml trained 340 steps on answer_match alone). The reward set
    refuses it naming the fix; `mmrl train` says so before Ray starts, dry run included."""
    with pytest.raises(ValueError, match=r"'words' = \[True, False\].*quote them"):
        RewardSet([{"name": "first_word_in", "args": {"words": [True, False]}}])
    RewardSet([{"name": "first_word_in", "args": {"words": ["yes", "no"]}}])
    RewardSet([{"name": "answer_match", "args": {"first_word": True}}])  # a bool where a bool is meant

    def takes_optional_text(response: str, *, label: str | None = None) -> float:
        return 0.0
    with pytest.raises(ValueError, match="'label' = False"):
        RewardSet([{"name": takes_optional_text, "args": {"label": False}}])

    src = (REPO / "configs" / "multi_image.yaml").read_text()
    bad = tmp_path / "bare_yes_no.yaml"
    bad.write_text(src.replace('["yes", "no"]', "[yes, no]"))
    assert "[yes, no]" in bad.read_text()
    # the model folder is absent here (as on a clean machine before `make assets`): the config's own
    # mistake is still the one reported
    proc = subprocess.run([sys.executable, "-m", "mmrl.cli", "train", str(bad), "--dry-run",
                           f"model.path={tmp_path / 'absent-model'}"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode != 0 and "YAML reads unquoted yes/no" in proc.stderr, proc.stderr[-2000:]


def test_reward_set_rejects_bad_config_early() -> None:
    with pytest.raises(PluginError, match="no_such_reward"):
        RewardSet([{"name": "no_such_reward"}])
    with pytest.raises(ValueError, match="wieght"):
        RewardSet([{"name": "answer_match", "wieght": 1.0}])
    with pytest.raises(ValueError, match="firstword"):
        RewardSet([{"name": "answer_match", "args": {"firstword": True}}])
    with pytest.raises(ValueError, match="clash"):
        RewardSet([{"name": "answer_match", "args": {"answer": "x"}}])
    with pytest.raises(ValueError, match="alias"):
        RewardSet([{"name": "answer_match"}, {"name": "answer_match", "args": {"first_word": True}}])
    with pytest.raises(ValueError, match="weight"):
        RewardSet([{"name": "answer_match", "weight": float("nan")}])
    with pytest.raises(ValueError):
        RewardSet([])
    rs = RewardSet([{"name": "answer_match"},
                    {"name": "answer_match", "alias": "first", "args": {"first_word": True}}])
    assert rs.score(make_sample(answer="a"), "a b", [])["score"] == 1.0


USER_FILE = textwrap.dedent("""
    import numpy as np

    def brevity(response, response_ids, max_tokens=4):
        return {"score": 1.0 if len(response_ids) <= max_tokens else 0.0, "n": len(response_ids)}

    def mean_brightness(images, **_):
        return float(np.asarray(images[0], dtype=np.float32).mean() / 255.0)
""")


def test_reward_set_pickles_and_resolves_file_and_module_specs(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_rewards.py").write_text(USER_FILE)
    (tmp_path / "my_reward_mod.py").write_text(USER_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    entries = [
        {"name": "my_rewards.py:brevity", "weight": 2.0, "args": {"max_tokens": 2}},  # relative path
        {"name": "my_reward_mod:mean_brightness", "weight": 0.0},
        {"name": "answer_match", "weight": 1.0},
    ]
    rs = RewardSet(entries)
    assert rs.names == ["brevity", "mean_brightness", "answer_match"]
    sample = make_sample(render("red", 0), answer="red")
    expected = rs.score(sample, "red", [1, 2])
    assert expected["score"] == 3.0 and expected["brevity/n"] == 2.0
    assert 0.0 < expected["mean_brightness/score"] < 1.0

    clone = pickle.loads(pickle.dumps(rs))
    assert clone._fns is None  # resolved again lazily, in the process that scores
    assert clone.score(sample, "red", [1, 2]) == expected
    assert clone.score(sample, "red", [1, 2, 3])["score"] == 1.0

    # a Ray worker: another process, another working directory, only the pickle
    blob = tmp_path / "rs.pkl"
    blob.write_bytes(pickle.dumps((rs, sample)))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = ("import pickle, sys; rs, s = pickle.load(open(sys.argv[1], 'rb')); "
            "print(rs.score(s, 'red', [1, 2]))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.getcwd(), *sys.path]))
    out = subprocess.run([sys.executable, "-c", code, str(blob)], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert eval(out.stdout) == expected


def test_reward_set_propagates_reward_errors_with_name(tmp_path) -> None:
    path = tmp_path / "bad.py"
    path.write_text("def oops(response):\n    return 'yes'\n")
    rs = RewardSet([{"name": f"{path}:oops"}])
    with pytest.raises(RewardError, match="oops"):
        rs.score(make_sample(), "x", [])
    assert math.isfinite(RewardSet([{"name": "answer_match"}]).score(make_sample(), "x", [])["score"])


def test_tool_success_reads_the_environment_state_not_the_text() -> None:
    from mmrl.plugins.rewards.tool_state import tool_success

    called = [{"role": "assistant", "content": "click 1 0", "tool_calls": [{"name": "click", "arguments": {}}]},
              {"role": "tool", "name": "click", "content": "opened menu 'File'", "error": False}]
    done = tool_success({"success": True, "progress": 1.0}, called, progress_credit=0.3, call_credit=0.05)
    assert done["score"] == 1.0 and done["success"] == 1.0
    half = tool_success({"success": False, "progress": 0.5}, called, progress_credit=0.3, call_credit=0.05)
    assert half["score"] == pytest.approx(0.3 * 0.5 + 0.05) and half["tool_calls"] == 1.0
    says_done = [{"role": "assistant", "content": "Done, I clicked Save.", "tool_calls": []}]
    assert tool_success({}, says_done, progress_credit=0.3, call_credit=0.05)["score"] == 0.0
