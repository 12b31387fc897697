"""The tiny VLM kit builds ordinary HF folders that transformers (and vLLM) load offline. vLLM's side
is checked wherever an engine serves a tiny folder: the prompt tokens and logprobs vLLM computes
against the HF processor and model in tests/test_parity.py and tests/test_parity_families.py."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer  # noqa: E402

from mmrl.models import ARCHS, DEFAULT_WORDS, SPECIAL_TOKENS, build_tiny_vlm, build_tokenizer  # noqa: E402

PROMPT = "What colour is the shape? Answer with one word."


def _image(size: int = 56) -> Image.Image:
    return Image.new("RGB", (size, size), (220, 30, 30))


def _chat(processor) -> str:
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    return processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_forward(arch: str, tmp_path: Path) -> None:
    out = build_tiny_vlm(arch, tmp_path / arch)
    processor = AutoProcessor.from_pretrained(out)
    model = AutoModelForImageTextToText.from_pretrained(out).eval()
    assert model.config.model_type == arch
    assert next(model.parameters()).dtype == torch.float32

    text = _chat(processor)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")
    enc = processor(text=[text], images=[_image()], return_tensors="pt")
    image_pad = model.config.image_token_id
    # Qwen: 56x56 -> 2x2 merged patches; LLaVA: 4x4 CLIP patches of 14 (the CLS token dropped);
    # InternVL: one 56-px tile, 4x4 patches pixel-shuffled to 2x2
    assert int((enc["input_ids"] == image_pad).sum()) == (16 if arch == "llava" else 4)
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (1, enc["input_ids"].shape[1], len(processor.tokenizer))
    assert torch.isfinite(logits).all()

    meta = json.loads((out / "mmrl_tiny.json").read_text())
    assert meta["arch"] == arch and meta["seed"] == 0 and meta["words"] == list(DEFAULT_WORDS)
    assert meta["vocab_size"] == len(processor.tokenizer) == model.config.text_config.vocab_size


def test_config_matches_brief(tmp_path: Path) -> None:
    for arch, patch in (("qwen2_5_vl", 14), ("qwen3_vl", 16)):
        model = AutoModelForImageTextToText.from_pretrained(build_tiny_vlm(arch, tmp_path / arch))
        text, vision = model.config.text_config, model.config.vision_config
        assert (text.hidden_size, text.num_hidden_layers) == (128, 2)
        assert (text.num_attention_heads, text.num_key_value_heads) == (2, 1)
        assert getattr(text, "head_dim", 64) == 64
        assert sum(text.rope_parameters["mrope_section"]) == 32
        assert (vision.depth, vision.patch_size, vision.spatial_merge_size) == (1, patch, 2)
        assert model.config.tie_word_embeddings is False
    assert model.config.text_config.rope_parameters["mrope_interleaved"] is True


def test_cli_sizes(tmp_path: Path) -> None:
    """`mmrl tiny-model --hidden-size/--num-layers/--vision-depth`: the sizes benchmarks need
    (compute that matters); a width off the head size is refused with the rule, exit 2."""
    from mmrl.cli import main

    assert main(["tiny-model", "--out", str(tmp_path / "m"), "--hidden-size", "192", "--num-layers", "3",
                 "--vision-depth", "2"]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    assert (text["hidden_size"], text["num_hidden_layers"], text["num_attention_heads"]) == (192, 3, 3)
    assert (vision["depth"], vision["out_hidden_size"]) == (2, 192)
    assert main(["tiny-model", "--out", str(tmp_path / "bad"), "--hidden-size", "100"]) == 2
    assert not (tmp_path / "bad" / "config.json").exists()


def test_answer_words_are_single_tokens(tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tok) == 512
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for word in DEFAULT_WORDS:
        for form in (word, " " + word, word.capitalize()):
            assert len(tok.encode(form, add_special_tokens=False)) == 1, form
        assert tok.convert_ids_to_tokens(tok.encode(" " + word, add_special_tokens=False)) == ["Ġ" + word]
        # ... and in context, as a model's answer would appear
        assert tok.tokenize(f"The answer is {word}.")[-2] == "Ġ" + word
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(512 - len(SPECIAL_TOKENS), 512))
    for t, i in zip(SPECIAL_TOKENS, ids):
        assert tok.encode(t, add_special_tokens=False) == [i]


def test_custom_words_and_determinism(tmp_path: Path) -> None:
    words = ("magenta", "hexagon", "seventeen")
    a = build_tokenizer(tmp_path / "a", words=words, vocab_size=400)
    build_tokenizer(tmp_path / "b", words=words, vocab_size=400)
    assert len(a) == 400
    for w in words:
        for form in (w, " " + w, w.capitalize()):
            assert len(a.encode(form, add_special_tokens=False)) == 1, form
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError):
        build_tokenizer(tmp_path / "c", words=("two words",))


def test_seeding(tmp_path: Path) -> None:
    def weights(name: str, seed: int) -> dict[str, torch.Tensor]:
        return load_file(build_tiny_vlm("qwen2_vl", tmp_path / name, seed=seed) / "model.safetensors")

    a, b, c = weights("a", 0), weights("b", 0), weights("c", 1)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_bfloat16_and_pixel_budget(tmp_path: Path) -> None:
    out = build_tiny_vlm("qwen2_5_vl", tmp_path / "m", dtype="bfloat16", image_max_pixels=28 * 28 * 4)
    weights = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    processor = AutoProcessor.from_pretrained(out)
    enc = processor(text=[_chat(processor)], images=[_image(112)], return_tensors="pt")
    assert int(enc["image_grid_thw"].prod()) // 4 == 4  # 112x112 capped to the 4-token budget
    with pytest.raises(ValueError):
        build_tiny_vlm("llava_next", tmp_path / "x")  # not a family the kit builds
