"""clip_score on a tiny random CLIP built locally (mmrl.models.tiny_clip): the similarity it
computes is CLIP's own, batching changes nothing, normalisations and arguments behave."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmrl.data.sample import Sample, messages_from_prompt
from mmrl.rewards import RewardSet, call_reward, reward_kwargs, traits_of
from mmrl.plugins.rewards.clip_score import clip_score, load_clip
from mmrl.rewards.scorer import GroupScorer


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> str:
    from mmrl.models.tiny_clip import build_tiny_clip

    return str(build_tiny_clip(tmp_path_factory.mktemp("clip") / "tiny-clip", seed=0))


def make_sample(images: list[Image.Image]) -> Sample:
    return Sample(key="c0", messages=messages_from_prompt("Describe the image.", n_images=len(images)),
                  images=images, answer="red")


RED = Image.new("RGB", (48, 40), (220, 30, 30))
BLUE = Image.new("RGB", (40, 48), (30, 60, 220))


def test_builder_writes_a_folder_transformers_loads_offline(tiny_clip) -> None:
    from transformers import AutoModel, AutoProcessor

    names = {p.name for p in Path(tiny_clip).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "processor_config.json"} <= names
    model, processor = AutoModel.from_pretrained(tiny_clip), AutoProcessor.from_pretrained(tiny_clip)
    assert type(model).__name__ == "CLIPModel" and type(processor).__name__ == "CLIPProcessor"
    ids = processor.tokenizer("A photo of Red")["input_ids"]
    assert processor.tokenizer.convert_ids_to_tokens(ids) == ["<|startoftext|>", "a</w>", "photo</w>", "of</w>",
                                                              "red</w>", "<|endoftext|>"]


def test_cosine_is_clips_own_similarity(tiny_clip) -> None:
    """Against CLIPModel's forward: logits_per_text / logit_scale is the cosine."""
    texts = ["red", "a blue square", "seven"]
    out = clip_score(texts, [[RED]] * 3, model=tiny_clip, normalise="cosine")
    model, processor = load_clip(tiny_clip)
    inputs = processor(text=texts, images=[RED], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**inputs).logits_per_text[:, 0] / model.logit_scale.exp()
    assert [o["cosine"] for o in out] == pytest.approx(logits.tolist(), abs=1e-5)
    assert [o["score"] for o in out] == pytest.approx(logits.tolist(), abs=1e-5)
    assert traits_of(clip_score).batched


def test_batching_and_templates(tiny_clip) -> None:
    sample = make_sample([RED, BLUE])
    texts = ["red", "<think>hmm</think><answer>blue</answer>", "", "blue " * 20000]
    rs = RewardSet([{"name": "clip_score", "args": {"model": tiny_clip, "normalise": "unit", "reduce": "max",
                                                    "template": "a photo of {response}"}}])
    batched = GroupScorer(rs, timeout_s=None).score_group(sample, texts)
    assert not batched["failures"]
    for text, scores in zip(texts, batched["scores"]):
        single = rs.score(sample, text)
        assert scores["clip_score/cosine"] == pytest.approx(single["clip_score/cosine"], abs=1e-5)
        assert 0.0 <= scores["score"] <= 1.0
        assert scores["score"] == pytest.approx((scores["clip_score/cosine"] + 1) / 2)
    # the answer block is what is scored
    answer_only = clip_score(["a photo of blue"], [[RED, BLUE]], model=tiny_clip, reduce="max")[0]
    assert batched["scores"][1]["clip_score/cosine"] == pytest.approx(answer_only["cosine"], abs=1e-5)
    # max over the images >= their mean
    mean = clip_score(["red"], [[RED, BLUE]], model=tiny_clip, normalise="cosine")[0]["cosine"]
    best = clip_score(["red"], [[RED, BLUE]], model=tiny_clip, normalise="cosine", reduce="max")[0]["cosine"]
    assert best >= mean


def test_normalisations_and_scale(tiny_clip) -> None:
    kw = reward_kwargs(make_sample([RED]), "red")
    cos = call_reward(clip_score, **kw, model=tiny_clip, normalise="cosine")["cosine"]
    assert call_reward(clip_score, **kw, model=tiny_clip)["score"] == pytest.approx(max(cos, 0.0))
    assert call_reward(clip_score, **kw, model=tiny_clip, scale=2.5, normalise="unit")["score"] == \
        pytest.approx(2.5 * (cos + 1) / 2)
    model, _ = load_clip(tiny_clip)
    z = float(model.logit_scale.detach().exp()) * cos  # CLIP has no logit_bias
    assert call_reward(clip_score, **kw, model=tiny_clip, normalise="sigmoid")["score"] == \
        pytest.approx(1 / (1 + math.exp(-z)), abs=1e-6)


def test_configuration_errors_name_the_fix(tiny_clip) -> None:
    kw = reward_kwargs(make_sample([RED]), "red")
    with pytest.raises(ValueError, match="normalise must be one of"):
        call_reward(clip_score, **kw, model=tiny_clip, normalise="softmax")
    with pytest.raises(ValueError, match=r"\{response\}"):
        call_reward(clip_score, **kw, model=tiny_clip, template="a photo")
    with pytest.raises(ValueError, match="needs the sample's image"):
        call_reward(clip_score, **reward_kwargs(make_sample([]), "red"), model=tiny_clip)
    with pytest.raises(ValueError, match="not parameters"):
        RewardSet([{"name": "clip_score", "args": {"model": tiny_clip, "templat": "{response}"}}])
