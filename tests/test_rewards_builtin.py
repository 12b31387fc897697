"""The built-in task rewards on hand-made cases (expected values computed by hand in comments),
including the empty, garbage and huge (>= 100k characters) responses a policy will produce."""
from __future__ import annotations

import time

import numpy as np
import pytest
from PIL import Image

from mmrl.data.sample import Sample, messages_from_prompt
from mmrl.registry import resolve
from mmrl.rewards import RewardSet, call_reward, reward_kwargs
from mmrl.plugins.rewards.choice import extract_choice, multiple_choice
from mmrl.plugins.rewards.counting import counting, first_count
from mmrl.plugins.rewards.format_tags import format_tags
from mmrl.plugins.rewards.grounding import box_iou_giou, grounding_iou, parse_boxes
from mmrl.plugins.rewards.math_answer import extract_final_answer, math_answer, parse_number, verifier_available
from mmrl.plugins.rewards.ocr import levenshtein, ocr_edit_distance
from mmrl.plugins.rewards.overlong import dapo_overlong
from mmrl.plugins.rewards.temporal import interval_iou, parse_interval, temporal_iou

HUGE = "blue " * 20_000 + "@@##!!"  # 100,006 characters
GARBAGE = ["", "   ", "@@##!!", "\x00\x01\ufffd", "}{][)(", HUGE]
BUILTINS = ["multiple_choice", "math_answer", "format_tags", "grounding_iou", "counting",
            "ocr_edit_distance", "temporal_iou", "dapo_overlong"]


def _fast(fn, *args, limit_s: float = 2.0, **kwargs):
    t0 = time.process_time()  # CPU time: other load on the machine does not count
    out = fn(*args, **kwargs)
    assert time.process_time() - t0 < limit_s, f"{fn.__name__} took too long on a huge input"
    return out


def test_all_registered_and_resolvable_by_name() -> None:
    for name in BUILTINS:
        assert callable(resolve("reward", name))


# ----------------------------------------------------------------------------- multiple_choice

@pytest.mark.parametrize("response, letter", [
    ("(B)", "B"), ("B.", "B"), ("B", "B"), ("**B**", "B"), ("Answer: b", "B"),
    ("The answer is C", "C"), ("The answer is C.", "C"), ("so the final answer is $\\boxed{C}$", "C"),
    ("\\boxed{\\text{D}}", "D"), ("I think the answer is (D).", "D"), ("B. Because it is round", "B"),
    ("Option A looks wrong; the correct option is C", "C"), ("answer is A because it is red", "A"),
    ("<think>maybe A</think><answer>C</answer>", "C"), ("it could be (E)", "E"),
    # prose, not a pick: the article "a", the pronoun "I", a word starting with a letter
    ("The answer is a circle", None), ("A cat sat there", None), ("Answer: I think so", None),
    ("", None), ("@@##!!", None), ("blue blue", None),
])
def test_extract_choice(response: str, letter: str | None) -> None:
    assert extract_choice(response) == letter


def test_multiple_choice_scores_and_choices() -> None:
    assert multiple_choice("The answer is (B).", "B") == {"score": 1.0, "parsed": 1.0}
    assert multiple_choice("The answer is (B).", "(C)") == {"score": 0.0, "parsed": 1.0}
    assert multiple_choice("b", ["A", "B"])["score"] == 1.0
    meta = {"choices": ["square", "circle", "triangle"]}  # a list: A, B, C
    assert multiple_choice("It is a circle", "B", meta)["score"] == 1.0  # the option text
    assert multiple_choice("B", "circle", meta)["score"] == 1.0  # the answer given as option text
    assert multiple_choice("C", "circle", meta)["score"] == 0.0
    # "circle" is inside "semicircle": the longer option is the one named
    assert multiple_choice("a semicircle", "B", choices={"A": "circle", "B": "semicircle"})["score"] == 1.0
    # letters outside the choices do not count
    assert multiple_choice("(E)", "A", choices={"A": "x", "B": "y"})["parsed"] == 0.0
    for bad in GARBAGE:
        assert _fast(multiple_choice, bad, "B") == {"score": 0.0, "parsed": 0.0}
    assert _fast(multiple_choice, HUGE + " The answer is B", "B")["score"] == 1.0


# ----------------------------------------------------------------------------- math_answer

@pytest.mark.parametrize("response, answer, expected", [
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("The answer is 1/2", "\\frac{1}{2}", 1.0),
    ("3 apples and 5 pears make 8", "8", 1.0),  # the last number
    ("The answer is 7", "8", 0.0),
    ("It is 50%", "0.5", 1.0), ("It is 50 percent", "50%", 1.0), ("50\\%", "50", 1.0),
    ("The population is 1,234,567.", "1234567", 1.0),
    ("answer: $1.5 \\times 10^{-3}$", "1.5e-3", 1.0), ("0.0015", "1.5e-3", 1.0),
    ("x = -3", "-3", 1.0), ("x = 3", "-3", 0.0),
    ("The answer is $\\dfrac{3}{4}$.", 0.75, 1.0),
    ("<think>2+2 is 4</think><answer>42</answer>", 42, 1.0),
    ("1/3", "0.3333", 0.0),  # default rel_tol 1e-6: 0.3333 is not 1/3
    ("\\boxed{7}", ["7", "seven"], 1.0),
])
def test_math_answer_numeric(response: str, answer, expected: float) -> None:
    assert math_answer(response, answer)["score"] == expected


def test_math_answer_numeric_without_verifier_and_tolerance() -> None:
    assert math_answer("\\boxed{\\frac{1}{2}}", "0.5", use_verifier=False)["score"] == 1.0
    assert math_answer("1/3", "0.3333", rel_tol=1e-3)["score"] == 1.0  # |1/3-0.3333|/0.3333 = 1e-4
    assert parse_number("1,000") == (1000.0, False)
    assert parse_number("25%") == (0.25, True)
    assert parse_number("-\\frac{3}{4}") == (-0.75, False)
    assert parse_number("2.5 \\times 10^{3}") == (2500.0, False)
    assert parse_number("1,2") is None and parse_number("x+1") is None
    assert extract_final_answer("so \\boxed{\\frac{a}{b}} hence") == "\\frac{a}{b}"
    assert extract_final_answer("The answer is: \\(x^2\\)") == "x^2"
    assert extract_final_answer("nothing here") is None


@pytest.mark.skipif(not verifier_available(), reason="math-verify is not installed")
def test_math_answer_symbolic_via_verifier() -> None:
    assert math_answer("\\boxed{2\\sqrt{2}}", "\\sqrt{8}") == {"score": 1.0, "parsed": 1.0, "verified": 1.0}
    assert math_answer("\\boxed{x+1}", "1+x")["verified"] == 1.0
    assert math_answer("\\boxed{x+2}", "1+x")["score"] == 0.0
    # the verifier is only asked when the plain numeric check fails
    assert math_answer("\\boxed{0.5}", "1/2")["verified"] == 0.0


def test_math_answer_garbage_and_huge() -> None:
    for bad in GARBAGE:
        assert _fast(math_answer, bad, "3") == {"score": 0.0, "parsed": 0.0, "verified": 0.0}
    assert math_answer("3", "red")["score"] == 0.0  # an unusable answer scores 0, no exception
    assert math_answer("3", None)["score"] == 0.0
    assert _fast(math_answer, "x " * 60_000 + "so the answer is \\boxed{3}", "3")["score"] == 1.0
    assert _fast(math_answer, "(1+" * 40_000, "3")["score"] == 0.0
    assert _fast(math_answer, "\\boxed{" * 30_000, "3")["score"] == 0.0


# ----------------------------------------------------------------------------- format_tags

@pytest.mark.parametrize("response, lenient, strict", [
    ("<think>a</think><answer>b</answer>", 1, 1),
    (" <think>a</think>\n<answer>b</answer>\n", 1, 1),
    ("Sure! <think>a</think><answer>b</answer>", 1, 0),  # text outside the tags
    ("<think></think><answer>b</answer>", 1, 0),  # empty think
    ("<THINK>a</THINK><answer>b</answer>", 1, 0),  # tag case
    ("<answer>b</answer><think>a</think>", 0, 0),  # wrong order
    ("<think>a<answer>b</answer>", 0, 0),  # think never closed
    ("<think>a</think><answer> </answer>", 0, 0),  # empty answer
    ("<think>a</think><answer>b</answer><answer>c</answer>", 0, 0),  # two answers
    ("<think>a</think>b", 0, 0),
])
def test_format_tags(response: str, lenient: int, strict: int) -> None:
    assert format_tags(response)["score"] == lenient
    assert format_tags(response, strict=True)["score"] == strict


def test_format_tags_components_custom_tags_and_huge() -> None:
    assert format_tags("<answer>b</answer><think>a</think>") == {"score": 0.0, "think": 1.0, "answer": 1.0, "order": 0.0}
    assert format_tags("<answer>3</answer>", think_tag="")["score"] == 1.0
    assert format_tags("<reasoning>r</reasoning><final>3</final>", think_tag="reasoning",
                       answer_tag="final", strict=True)["score"] == 1.0
    for bad in GARBAGE:
        assert _fast(format_tags, bad)["score"] == 0.0
    long_ok = "<think>" + "x" * 500_000 + "</think><answer>1</answer>"
    assert _fast(format_tags, long_ok, strict=True)["score"] == 1.0
    with pytest.raises(ValueError, match="answer_tag"):
        format_tags("x", answer_tag="")


# ----------------------------------------------------------------------------- grounding_iou

IMG_100x50 = [Image.new("RGB", (100, 50))]


def test_box_iou_giou_by_hand() -> None:
    # [20,20,40,40] vs [10,10,30,30]: intersection 10x10 = 100, union 400 + 400 - 100 = 700,
    # IoU = 1/7; enclosing box 30x30 = 900, GIoU = 1/7 - (900 - 700)/900 = 1/7 - 2/9.
    iou, giou = box_iou_giou((20, 20, 40, 40), (10, 10, 30, 30))
    assert iou == pytest.approx(1 / 7) and giou == pytest.approx(1 / 7 - 2 / 9)
    # disjoint [40,40,50,50] vs [10,10,30,30]: IoU 0; hull 40x40 = 1600, union 100 + 400 = 500,
    # GIoU = 0 - 1100/1600 = -0.6875
    assert box_iou_giou((40, 40, 50, 50), (10, 10, 30, 30)) == pytest.approx((0.0, -0.6875))
    assert box_iou_giou((10, 10, 10, 30), (10, 10, 30, 30)) == (0.0, -1.0)  # no area


@pytest.mark.parametrize("response", [
    '{"bbox_2d": [10, 10, 30, 30]}',
    '```json\n[{"bbox_2d": [10, 10, 30, 30], "label": "circle"}]\n```',
    "{'box': (10, 10, 30, 30)}",
    "[10, 10, 30, 30]", "(10,10,30,30)", "The box is [30, 30, 10, 10].",  # swapped corners
    "[[10, 10], [30, 30]]", "(10,10),(30,30)",
    "[0.1, 0.2, 0.3, 0.6]",  # relative: 0.1*100 = 10, 0.2*50 = 10, 0.3*100 = 30, 0.6*50 = 30
    "<|box_start|>(100,200),(300,600)<|box_end|>",  # Qwen2-VL 0-1000: 100/1000*100 = 10, 200/1000*50 = 10, ...
    "<answer>[10, 10, 30, 30]</answer>",
])
def test_grounding_parses_every_format(response: str) -> None:
    out = grounding_iou(response, [10, 10, 30, 30], IMG_100x50)
    assert out["score"] == pytest.approx(1.0) and out["parsed"] == 1.0


def test_grounding_iou_giou_modes_and_frames() -> None:
    out = grounding_iou("[20, 20, 40, 40]", [10, 10, 30, 30], IMG_100x50)
    assert out["iou"] == pytest.approx(1 / 7) and out["score"] == pytest.approx(1 / 7)
    assert out["giou"] == pytest.approx(1 / 7 - 2 / 9)
    g = grounding_iou("[20, 20, 40, 40]", [10, 10, 30, 30], IMG_100x50, metric="giou")
    assert g["score"] == pytest.approx((1 / 7 - 2 / 9 + 1) / 2)
    assert grounding_iou("[40, 40, 50, 50]", [10, 10, 30, 30], IMG_100x50, metric="giou")["score"] == pytest.approx(
        (1 - 0.6875) / 2)  # a near miss still gets some credit under GIoU
    two = '[{"bbox_2d": [0, 0, 5, 5]}, {"bbox_2d": [10, 10, 30, 30]}]'
    assert grounding_iou(two, [10, 10, 30, 30], IMG_100x50)["score"] == 0.0  # first box counts
    assert grounding_iou(two, [10, 10, 30, 30], IMG_100x50, multiple="best")["score"] == pytest.approx(1.0)
    assert grounding_iou(two, [10, 10, 30, 30], IMG_100x50)["n_boxes"] == 2.0
    # explicit frames: 100,200,300,600 in qwen1000 on a 100x50 image is [10,10,30,30] in pixels
    assert grounding_iou("[100, 200, 300, 600]", [10, 10, 30, 30], IMG_100x50, coords="qwen1000")["score"] == pytest.approx(1.0)
    # auto: a box beyond the image (but <= 1000) is read as qwen1000
    assert grounding_iou("[100, 200, 300, 600]", [10, 10, 30, 30], IMG_100x50)["score"] == pytest.approx(1.0)
    # answer given relative (the recipe's metadata.box_rel)
    assert grounding_iou("[10, 10, 30, 30]", [0.1, 0.2, 0.3, 0.6], IMG_100x50, answer_coords="rel")["score"] == pytest.approx(1.0)
    # no image: the size comes from metadata, or pixels are compared with pixels
    assert grounding_iou("[10, 10, 30, 30]", [10, 10, 30, 30], None, {"image_size": [100, 50]})["score"] == pytest.approx(1.0)
    assert grounding_iou("[20, 20, 40, 40]", [10, 10, 30, 30], None)["score"] == pytest.approx(1 / 7)
    with pytest.raises(ValueError, match="image size"):
        grounding_iou("[0.1, 0.1, 0.3, 0.3]", [10, 10, 30, 30], None)
    with pytest.raises(ValueError, match="coords"):
        grounding_iou("[1, 1, 2, 2]", [1, 1, 2, 2], IMG_100x50, coords="pixels")
    # several answer boxes: the best match counts; a dict answer works too
    assert grounding_iou("[10, 10, 30, 30]", [[0, 0, 5, 5], [10, 10, 30, 30]], IMG_100x50)["score"] == pytest.approx(1.0)
    assert grounding_iou("[10, 10, 30, 30]", {"bbox_2d": [10, 10, 30, 30]}, IMG_100x50)["score"] == pytest.approx(1.0)


def test_grounding_degenerate_garbage_and_huge() -> None:
    assert grounding_iou("[10, 10, 10, 30]", [10, 10, 30, 30], IMG_100x50)["score"] == 0.0
    assert grounding_iou("[10, 10, 10, 30]", [10, 10, 30, 30], IMG_100x50, metric="giou")["score"] == 0.0
    assert grounding_iou("[200, 200, 300, 300]", [10, 10, 30, 30], IMG_100x50, coords="abs")["score"] == 0.0  # clipped away
    for bad in GARBAGE:
        out = _fast(grounding_iou, bad, [10, 10, 30, 30], IMG_100x50)
        assert out["score"] == 0.0 and out["parsed"] == 0.0
    assert grounding_iou("[10, 10, 30, 30]", "red", IMG_100x50)["score"] == 0.0  # unusable answer
    many = _fast(grounding_iou, "[1, 2, 3, 4], " * 30_000, [1, 2, 3, 4], IMG_100x50, multiple="best")
    assert many["score"] == pytest.approx(1.0) and many["n_boxes"] == 100.0  # capped
    assert parse_boxes("no box") == []


def test_grounding_on_the_recipe_sample_through_a_reward_set() -> None:
    from mmrl.plugins.data.recipes.grounding import draw, prompt_for

    pixels, info = draw("circle", np.random.default_rng(0))
    sample = Sample(key="g0", messages=messages_from_prompt(prompt_for("circle"), n_images=1),
                    images=[Image.fromarray(pixels)], answer=info["box"], metadata=info)
    x1, y1, x2, y2 = info["box"]
    rs = RewardSet([{"name": "grounding_iou", "weight": 1.0},
                    {"name": "format_tags", "weight": 0.5, "args": {"think_tag": ""}}])
    good = rs(sample, f"<answer>[{x1}, {y1}, {x2}, {y2}]</answer>", [1, 2, 3])
    assert good["score"] == pytest.approx(1.5) and good["grounding_iou/iou"] == pytest.approx(1.0)
    rel = call_reward(grounding_iou, **reward_kwargs(sample, str(info["box_rel"])))
    assert rel["score"] == pytest.approx(1.0, abs=1e-3)  # box_rel is rounded to 4 decimals
    assert rs(sample, "", [])["score"] == 0.0


# ----------------------------------------------------------------------------- counting

@pytest.mark.parametrize("response, answer, expected", [
    ("three", "three", 1.0), ("Three.", "three", 1.0), ("There are 3 circles", "three", 1.0),
    ("I count 4.", 4, 1.0), ("three circles in 2 rows", "three", 1.0),  # the first number
    ("2 rows of three", "three", 0.0), ("twenty", "20", 1.0), ("zero", 0, 1.0),
    ("someone has none", "one", 0.0),  # "one" inside a word does not count
    ("<think>maybe 2</think><answer>five</answer>", "five", 1.0),
    ("3.0", "three", 1.0), ("4", ["four", "4"], 1.0),
])
def test_counting(response: str, answer, expected: float) -> None:
    assert counting(response, answer)["score"] == expected


def test_counting_garbage_and_huge() -> None:
    for bad in GARBAGE:
        assert _fast(counting, bad, "three") == {"score": 0.0, "parsed": 0.0}
    assert _fast(counting, "two " + HUGE, "two")["score"] == 1.0
    assert first_count("x3 y4 a1b") is None  # digits glued to letters are not counts
    assert counting("three", "red")["score"] == 0.0 and counting("three", None)["score"] == 0.0


# ----------------------------------------------------------------------------- ocr_edit_distance

def test_levenshtein_by_hand() -> None:
    assert levenshtein("kitten", "sitting") == 3  # k->s, e->i, +g
    assert levenshtein("flaw", "lawn") == 2  # -f, +n
    assert levenshtein("intention", "execution") == 5
    assert levenshtein("", "abc") == 3 and levenshtein("abc", "") == 3 and levenshtein("same", "same") == 0


def test_ocr_edit_distance() -> None:
    # "helo world" vs "hello world": 1 insertion; max length 11 -> score 1 - 1/11, cer 1/11
    out = ocr_edit_distance("helo world", "hello world")
    assert out == pytest.approx({"score": 1 - 1 / 11, "cer": 1 / 11, "distance": 1.0})
    # whitespace collapsed by default; case kept unless ignore_case ("H"->"h", "W"->"w": 2 edits)
    assert ocr_edit_distance("Hello \n World", "hello world")["distance"] == 2.0
    assert ocr_edit_distance("Hello \n World", "hello world", ignore_case=True)["score"] == 1.0
    assert ocr_edit_distance("a  b", "a b", normalize_whitespace=False)["distance"] == 1.0
    assert ocr_edit_distance("hello, world!", "hello world", ignore_punctuation=True)["score"] == 1.0
    assert ocr_edit_distance("STOP", ["GO", "STOP"])["score"] == 1.0  # best of the accepted texts
    assert ocr_edit_distance("", "") == {"score": 1.0, "cer": 0.0, "distance": 0.0}
    assert ocr_edit_distance("", "abc") == {"score": 0.0, "cer": 1.0, "distance": 3.0}
    assert ocr_edit_distance("<answer>hello</answer>", "hello")["score"] == 1.0


def test_ocr_garbage_and_huge_are_fast() -> None:
    for bad in GARBAGE:
        out = _fast(ocr_edit_distance, bad, "hello world")
        assert 0.0 <= out["score"] < 0.5
    # "blue " * 20000 + "@@##!!" normalises to 100,005 chars; vs "red" nearly every char is an edit
    out = _fast(ocr_edit_distance, HUGE, "red")
    assert out["score"] < 1e-4 and out["distance"] >= 100_005 - 3
    rng = np.random.default_rng(0)
    a, b = ("".join(rng.choice(list("abcdefgh"), 3000)) for _ in range(2))
    out = _fast(ocr_edit_distance, a, b, max_chars=1000)  # both capped: ~1000x1000 cells
    assert 0.0 <= out["score"] <= 1.0
    with pytest.raises(ValueError):
        ocr_edit_distance("a", "a", max_chars=0)


# ----------------------------------------------------------------------------- temporal_iou

@pytest.mark.parametrize("response", [
    "[2.5, 4.0]", "(2.5, 4)", "from 2.5s to 4s", "between 2.5 and 4 seconds", "2.5 - 4.0 seconds",
    "2.5s-4s", "from 00:02.5 to 00:04", "The event happens from 4 to 2.5.",  # swapped
    "<answer>[2.5, 4]</answer>",
])
def test_temporal_parse_forms(response: str) -> None:
    assert parse_interval(response) == (2.5, 4.0)
    # vs [2, 4]: intersection [2.5, 4] = 1.5, union [2, 4] = 2 -> IoU 0.75
    assert temporal_iou(response, [2, 4]) == {"score": 0.75, "iou": 0.75, "parsed": 1.0}


def test_temporal_iou_cases() -> None:
    assert parse_interval("0:01:05 - 0:01:10") == (65.0, 70.0)
    # [0, 2] vs [1, 3]: intersection 1, union 3
    assert temporal_iou("[0, 2]", "[1, 3]")["score"] == pytest.approx(1 / 3)
    assert temporal_iou("[0, 2]", {"start": 1, "end": 3})["score"] == pytest.approx(1 / 3)
    assert temporal_iou("[0, 2]", [[5, 6], [1, 2]])["score"] == pytest.approx(0.5)  # best of two
    assert temporal_iou("[5, 6]", [1, 3])["score"] == 0.0
    assert interval_iou((1.0, 1.0), (1.0, 1.0)) == 1.0 and interval_iou((1.0, 1.0), (0.0, 2.0)) == 0.0
    for bad in GARBAGE + ["[1, 2, 3, 4]", "At 3 seconds"]:
        assert _fast(temporal_iou, bad, [1, 2]) == {"score": 0.0, "iou": 0.0, "parsed": 0.0}
    assert temporal_iou("[1, 2]", "red")["score"] == 0.0


# ----------------------------------------------------------------------------- dapo_overlong

def test_dapo_overlong_by_hand() -> None:
    # L_max = 20, L_cache = 8: no penalty up to 12 tokens, then (12 - |y|)/8, floored at -1
    def r(n: int, **kw) -> float:
        return dapo_overlong("x", list(range(n)), max_length=20, cache_length=8, **kw)["score"]

    assert r(1) == 0.0 and r(12) == 0.0
    assert r(13) == pytest.approx(-1 / 8) and r(16) == pytest.approx(-0.5) and r(20) == -1.0
    assert r(25) == -1.0  # floored
    assert r(16, penalty_factor=0.5) == pytest.approx(-0.25)
    out = dapo_overlong("x", list(range(20)), max_length=20, cache_length=8)
    assert out == {"score": -1.0, "length": 20.0, "overlong": 1.0, "truncated": 1.0}
    assert dapo_overlong("", [], max_length=20, cache_length=8)["score"] == 0.0
    assert _fast(dapo_overlong, HUGE, list(range(100_000)), max_length=20, cache_length=8)["score"] == -1.0
    with pytest.raises(ValueError, match="response_ids"):
        dapo_overlong("some text", [], max_length=20, cache_length=8)
    with pytest.raises(ValueError, match="cache_length"):
        dapo_overlong("x", [1], max_length=8, cache_length=20)


def test_dapo_overlong_beside_a_correctness_reward() -> None:
    sample = Sample(key="m0", messages=messages_from_prompt("2+2?"), answer="4")
    rs = RewardSet([{"name": "math_answer", "weight": 1.0},
                    {"name": "dapo_overlong", "weight": 1.0, "args": {"max_length": 20, "cache_length": 8}}])
    assert rs(sample, "\\boxed{4}", list(range(5)))["score"] == 1.0
    assert rs(sample, "\\boxed{4}", list(range(16)))["score"] == pytest.approx(0.5)  # 1 - 0.5
    with pytest.raises(ValueError, match="max_length"):  # required args are checked up front
        RewardSet([{"name": "dapo_overlong"}])
