"""Tiny random-weight VLMs, built locally, for tests and the offline demo.

No model hub is reachable where mmrl is developed and tested, so every model the tests use is
built here from a config: a byte-level BPE tokenizer trained on a small local corpus and a
Qwen2-VL / Qwen2.5-VL / Qwen3-VL (dense or MoE: `qwen3_vl_moe`, MOE_EXPERTS experts, top
MOE_TOP_K), or a LLaVA (CLIP vision tower, MLP projector, a Qwen2 text
model, plain 1-D positions, `<image>` expanded to a fixed number of tokens), with random
(seeded) weights. The output folder is an ordinary
Hugging Face folder: `AutoProcessor`, `AutoModelForImageTextToText` and `vllm.LLM` load it
offline and nothing in it depends on mmrl (`mmrl_tiny.json` only records how it was built).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ARCHS = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "llava", "internvl", "qwen3_vl_moe")
QWEN_ARCHS = (*ARCHS[:3], "qwen3_vl_moe")
QWEN3_ARCHS = ("qwen3_vl", "qwen3_vl_moe")  # one vision tower, processor and positions rule

# The MoE text layers of `qwen3_vl_moe`: few experts, top-2, so that routing is a real choice
# (and R3 has something to replay) while the model stays tiny.
MOE_EXPERTS = 4
MOE_TOP_K = 2

# Answer words of the built-in tasks. Each must be ONE token ("red", " red", "Red") so a reward
# or a probe can read a one-word answer from a single sampled token.
DEFAULT_WORDS: tuple[str, ...] = (
    "red", "green", "blue", "yellow", "purple", "orange",
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
    "left", "right", "up", "down",
    "yes", "no",
    "square", "circle", "triangle",
)

# The Qwen-VL special tokens, in the order (and so with the relative ids) the real models use.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)

# LLaVA adds its image placeholder (expanded by its processor to one token per vision patch).
LLAVA_IMAGE_TOKEN = "<image>"

# InternVL's image tokens: the template writes one <IMG_CONTEXT> per image, the processor (and
# vLLM) expand it to <img> + <IMG_CONTEXT> x (tokens per tile x tiles) + </img>. Its processor
# finds them by these names on the tokenizer; vLLM also needs <video> to be one token.
INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>",
                   "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}

# Qwen2's pre-tokenizer split: words keep their leading space/punctuation, digits split singly.
QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Qwen2-VL-style chat template: one <|image_pad|>/<|video_pad|> placeholder per media item (the
# processor and vLLM expand it to the real token count), optional "Picture N:" labels.
CHAT_TEMPLATE = "".join([
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}",
    "{% for message in messages %}",
    "{% if loop.first and message['role'] != 'system' %}",
    "<|im_start|>system\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\n",
    "{% endif %}",
    "<|im_start|>{{ message['role'] }}\n",
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n",
    "{% else %}{% for content in message['content'] %}",
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}",
    "{% set image_count.value = image_count.value + 1 %}",
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}",
    "<|vision_start|><|image_pad|><|vision_end|>",
    "{% elif content['type'] == 'video' or 'video' in content %}",
    "{% set video_count.value = video_count.value + 1 %}",
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}",
    "<|vision_start|><|video_pad|><|vision_end|>",
    "{% elif 'text' in content %}{{ content['text'] }}",
    "{% endif %}{% endfor %}<|im_end|>\n",
    "{% endif %}{% endfor %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
])

# LLaVA's template: the same chat format, one <image> per image (its processor expands it).
LLAVA_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", LLAVA_IMAGE_TOKEN)
LLAVA_IMAGE_SIDE = 56  # pixels: CLIP's fixed input, 4 x 4 patches of 14 -> 16 image tokens

# InternVL's template writes its placeholder and a newline, as the released -hf templates do.
INTERNVL_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "<|vision_start|><|image_pad|><|vision_end|>", "<IMG_CONTEXT>\n").replace(
    "<|vision_start|><|video_pad|><|vision_end|>", "<video>\n")
INTERNVL_TILE_SIDE = 56  # pixels per tile: 4 x 4 patches of 14, pixel-shuffled to 2 x 2 = 4 tokens
INTERNVL_MAX_TILES = 4  # tiles per image at most (plus a thumbnail when there are several)

# Text that looks like the prompts and answers the tokenizer will see, so that BPE spends its
# merges on them (short prompts -> short sequences -> fast tests).
_PROMPTS = (
    "What colour is the shape? Answer with one word.",
    "What color is this? Answer with one word.",
    "How many shapes are in the picture? Answer with a number word.",
    "How many objects are there? Answer with one word.",
    "Which direction does the arrow point? Answer left, right, up or down.",
    "Which shape is this: square, circle or triangle?",
    "Is there a red square in the image? Answer yes or no.",
    "Describe this image. What is in the picture? Describe the video.",
    "Look at the image and answer the question. The answer is",
    "Think step by step, then give the final answer in one word.",
    "Picture 1: Video 1: a frame of a video with a moving shape.",
    "The quick brown fox jumps over the lazy dog. 0123456789",
)


def _corpus(words: Sequence[str]) -> list[str]:
    """Deterministic training text: the prompts plus every answer word in context."""
    lines = [DEFAULT_SYSTEM_PROMPT, *_PROMPTS]
    for w in words:
        lines += [w, w.capitalize(), f"The answer is {w}.", f"{w.capitalize()}. It is {w}."]
    return (lines * 20)


def _base_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    """A byte-level BPE with Qwen2's normaliser, pre-tokeniser and decoder."""
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False,
                               byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _train_merges(corpus: list[str], vocab_size: int) -> list[tuple[str, str]]:
    """BPE merges learnt from `corpus`, in priority order."""
    tok = _base_tokenizer({}, [])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def _vocab_from(merges: list[tuple[str, str]]) -> dict[str, int]:
    """Sorted byte alphabet first, then one token per merge: ids depend only on the merges."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return vocab


def _force_single_tokens(merges: list[tuple[str, str]], forms: Sequence[str]) -> list[tuple[str, str]]:
    """Append merges so each form encodes to exactly one token.

    New merges go last (lowest priority), so they fire only after every learnt merge is spent:
    they never change how a form that is already one token encodes, and each form's chain is
    computed against the merges added before it, so earlier chains stay valid.
    """
    merges = list(merges)
    for form in forms:
        while len(pieces := _base_tokenizer(_vocab_from(merges), merges).encode(form).tokens) > 1:
            merges.append((pieces[0], pieces[1]))
    return merges


def _word_forms(words: Sequence[str]) -> list[str]:
    """The three surface forms of each answer word: bare, after a space, capitalised."""
    forms: list[str] = []
    for w in words:
        if not w or not w.isalpha():
            raise ValueError(f"answer words must be non-empty letters only, got {w!r}")
        for f in (w, " " + w, w.capitalize()):
            if f not in forms:
                forms.append(f)
    return forms


def build_tokenizer(out_dir: str | Path, words: Sequence[str] = DEFAULT_WORDS,
                    vocab_size: int = 512, special_tokens: Sequence[str] = SPECIAL_TOKENS,
                    extra_special_tokens: dict[str, str] | None = None,
                    chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """Train a tiny Qwen-style tokenizer, save it to `out_dir`, and return it.

    `vocab_size` counts everything, the 14 special tokens included; when the corpus is too small
    to learn that many merges the vocabulary is smaller. Same arguments -> byte-identical files.
    """
    forms = _word_forms(words)
    budget = vocab_size - len(special_tokens)
    learnt = _train_merges(_corpus(words), budget)
    # Forced word merges take room from the learnt ones: drop the lowest-priority learnt merges
    # (their tokens are used by no other learnt merge) until everything fits.
    keep = len(learnt)
    while True:
        merges = _force_single_tokens(learnt[:keep], forms)
        vocab = _vocab_from(merges)
        overflow = len(vocab) - budget
        if overflow <= 0:
            break
        if keep == 0:
            raise ValueError(f"vocab_size={vocab_size} is too small for {len(words)} answer words")
        keep = max(0, keep - overflow)

    tok = _base_tokenizer(vocab, merges)
    tok.add_special_tokens(list(special_tokens))
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
        chat_template=chat_template,
        extra_special_tokens=extra_special_tokens or {},
    )
    bad = [f for f in forms if len(hf_tok.encode(f, add_special_tokens=False)) != 1]
    if bad:  # cannot happen unless the tokenizers library changes its BPE
        raise RuntimeError(f"answer words that are not single tokens: {bad}")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    hf_tok.save_pretrained(str(out_dir))
    return hf_tok


@dataclass(frozen=True)
class _Sizes:
    hidden_size: int
    num_layers: int
    num_heads: int
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_min_pixels: int
    image_max_pixels: int


HEAD_DIM = 64  # the vLLM CPU attention kernels support head_dim 64 (not e.g. 32)
MROPE_SECTION = [8, 12, 12]  # (t, h, w) rotary sections, summing to HEAD_DIM / 2


def _config(arch: str, s: _Sizes, ids: dict[str, int], vocab_size: int) -> Any:
    """The HF config of one arch, with the tiny sizes and our tokenizer's ids."""
    import transformers

    text: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=s.hidden_size, intermediate_size=2 * s.hidden_size,
        num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads, num_key_value_heads=1,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": MROPE_SECTION},
    )
    vision: dict[str, Any] = dict(
        depth=s.vision_depth, num_heads=s.vision_heads, patch_size=s.patch_size,
        spatial_merge_size=s.merge_size, temporal_patch_size=s.temporal_patch_size, in_channels=3,
    )
    if arch == "llava":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
        clip = transformers.CLIPVisionConfig(
            hidden_size=s.vision_hidden, intermediate_size=2 * s.vision_hidden, num_hidden_layers=s.vision_depth,
            num_attention_heads=s.vision_heads, image_size=LLAVA_IMAGE_SIDE, patch_size=s.patch_size,
            projection_dim=s.vision_hidden)
        return transformers.LlavaConfig(
            text_config=transformers.Qwen2Config(**text), vision_config=clip, image_token_id=ids[LLAVA_IMAGE_TOKEN],
            vision_feature_select_strategy="default", vision_feature_layer=-1, projector_hidden_act="gelu",
            tie_word_embeddings=False)
    if arch == "internvl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
        tower = transformers.InternVLVisionConfig(
            hidden_size=s.vision_hidden, intermediate_size=2 * s.vision_hidden, num_hidden_layers=s.vision_depth,
            num_attention_heads=s.vision_heads, image_size=INTERNVL_TILE_SIDE, patch_size=s.patch_size)
        # the last layer, CLS dropped: what vLLM's InternVL always does (no setting there)
        return transformers.InternVLConfig(
            text_config=transformers.Qwen2Config(**text), vision_config=tower,
            image_token_id=ids[INTERNVL_TOKENS["context_image_token"]], image_seq_length=_internvl_tokens_per_tile(s),
            downsample_ratio=0.5, vision_feature_layer=-1, vision_feature_select_strategy="default",
            tie_word_embeddings=False)
    if arch == "qwen2_vl":
        cls = transformers.Qwen2VLConfig
        # Qwen2-VL names the vision width embed_dim and its output width hidden_size
        vision.update(embed_dim=s.vision_hidden, hidden_size=s.hidden_size, mlp_ratio=2)
    elif arch == "qwen2_5_vl":
        cls = transformers.Qwen2_5_VLConfig
        vision.update(hidden_size=s.vision_hidden, intermediate_size=2 * s.vision_hidden,
                      out_hidden_size=s.hidden_size, window_size=112,
                      fullatt_block_indexes=[s.vision_depth - 1], tokens_per_second=2)
    elif arch in QWEN3_ARCHS:
        cls = transformers.Qwen3VLConfig
        text.update(head_dim=HEAD_DIM)  # Qwen3 does not derive it from hidden / heads
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6,
                                   "mrope_section": MROPE_SECTION, "mrope_interleaved": True}
        vision.update(hidden_size=s.vision_hidden, intermediate_size=2 * s.vision_hidden,
                      out_hidden_size=s.hidden_size, num_position_embeddings=256,
                      deepstack_visual_indexes=[0])
        if arch == "qwen3_vl_moe":  # every text layer sparse: MOE_EXPERTS experts, top MOE_TOP_K
            cls = transformers.Qwen3VLMoeConfig
            text.update(num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K,
                        # 3/2 of the width: expert weights must not be square (see finish_saved_model)
                        moe_intermediate_size=3 * s.hidden_size // 2, decoder_sparse_step=1, mlp_only_layers=[],
                        # vLLM's Qwen3-MoE layer reads it (the released configs carry it); transformers'
                        # router always renormalises the top-k weights, so it must be true
                        norm_topk_prob=True)
    else:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")
    return cls(
        text_config=text, vision_config=vision, tie_word_embeddings=False,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )


def _internvl_tokens_per_tile(s: _Sizes) -> int:
    """(tile side / patch)^2 patches, pixel-shuffled by 0.5 in each direction."""
    return (INTERNVL_TILE_SIDE // s.patch_size // 2) ** 2


def _processor(arch: str, s: _Sizes, tokenizer: PreTrainedTokenizerFast) -> Any:
    """Image + video processor with a tiny pixel budget, bundled with the tokenizer."""
    import transformers

    if arch == "internvl":
        tile = {"height": INTERNVL_TILE_SIDE, "width": INTERNVL_TILE_SIDE}
        image_proc = transformers.GotOcr2ImageProcessor(size=tile, crop_to_patches=True, min_patches=1,
                                                        max_patches=INTERNVL_MAX_TILES)
        return transformers.InternVLProcessor(
            image_processor=image_proc, tokenizer=tokenizer, video_processor=transformers.InternVLVideoProcessor(size=tile),
            image_seq_length=_internvl_tokens_per_tile(s), chat_template=INTERNVL_CHAT_TEMPLATE)

    if arch == "llava":
        image_proc = transformers.CLIPImageProcessor(size={"shortest_edge": LLAVA_IMAGE_SIDE},
                                                     crop_size={"height": LLAVA_IMAGE_SIDE, "width": LLAVA_IMAGE_SIDE})
        return transformers.LlavaProcessor(image_processor=image_proc, tokenizer=tokenizer, patch_size=s.patch_size,
                                           vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                           chat_template=LLAVA_CHAT_TEMPLATE, image_token=LLAVA_IMAGE_TOKEN)

    size = {"shortest_edge": s.image_min_pixels, "longest_edge": s.image_max_pixels}
    grid = dict(patch_size=s.patch_size, merge_size=s.merge_size,
                temporal_patch_size=s.temporal_patch_size)
    # Qwen3-VL normalises pixels with mean/std 0.5 (Qwen2/2.5-VL: the CLIP statistics)
    norm = dict(image_mean=[0.5] * 3, image_std=[0.5] * 3) if arch in QWEN3_ARCHS else {}
    image_proc = transformers.Qwen2VLImageProcessor(size=size, **grid, **norm)
    if arch in QWEN3_ARCHS:
        video_proc = transformers.Qwen3VLVideoProcessor(size=size, **grid)
        proc_cls = transformers.Qwen3VLProcessor
    else:
        video_proc = transformers.Qwen2VLVideoProcessor(size=size, **grid)
        proc_cls = (transformers.Qwen2_5_VLProcessor if arch == "qwen2_5_vl"
                    else transformers.Qwen2VLProcessor)
    return proc_cls(image_processor=image_proc, tokenizer=tokenizer, video_processor=video_proc,
                    chat_template=CHAT_TEMPLATE)


def build_tiny_vlm(arch: str, out_dir: str | Path, *, words: Sequence[str] = DEFAULT_WORDS,
                   seed: int = 0, hidden_size: int = 128, num_layers: int = 2, vision_depth: int = 1,
                   image_min_pixels: int | None = None, image_max_pixels: int | None = None,
                   dtype: str = "float32") -> Path:
    """Build a tiny random VLM (`arch` in ARCHS: the Qwen-VL families, LLaVA, InternVL) with its processor into `out_dir`.

    Weights come from `seed` alone (the global torch RNG is left untouched). The default pixel
    budget is 4..64 merged patches, so a 56x56 image costs 4 image tokens. Returns the folder.
    """
    import torch

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if hidden_size % HEAD_DIM or hidden_size <= 0:
        raise ValueError(f"hidden_size must be a positive multiple of {HEAD_DIM}, got {hidden_size}")
    if vision_depth < 1 or num_layers < 1:
        raise ValueError("num_layers and vision_depth must be >= 1")

    patch = 16 if arch in QWEN3_ARCHS else 14
    merge = 2
    unit = (patch * merge) ** 2  # pixels per image token
    sizes = _Sizes(
        hidden_size=hidden_size, num_layers=num_layers, num_heads=hidden_size // HEAD_DIM,
        vision_depth=vision_depth, vision_hidden=64, vision_heads=2, patch_size=patch,
        merge_size=merge, temporal_patch_size=2,
        image_min_pixels=unit * 4 if image_min_pixels is None else image_min_pixels,
        image_max_pixels=unit * 64 if image_max_pixels is None else image_max_pixels,
    )
    if sizes.image_min_pixels > sizes.image_max_pixels:
        raise ValueError("image_min_pixels must not exceed image_max_pixels")

    out = Path(out_dir)
    llava = arch == "llava"
    specials, named, template = SPECIAL_TOKENS, None, CHAT_TEMPLATE
    if llava:
        specials, template = (*SPECIAL_TOKENS, LLAVA_IMAGE_TOKEN), LLAVA_CHAT_TEMPLATE
    elif arch == "internvl":
        specials, named, template = (*SPECIAL_TOKENS, *INTERNVL_TOKENS.values()), INTERNVL_TOKENS, INTERNVL_CHAT_TEMPLATE
    tokenizer = build_tokenizer(out, words, special_tokens=specials, extra_special_tokens=named, chat_template=template)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in specials}
    config = _config(arch, sizes, ids, len(tokenizer))

    from transformers import AutoModelForImageTextToText

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model = model.to(torch_dtype)
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = (
        ids["<|endoftext|>"], ids["<|im_end|>"], ids["<|endoftext|>"])
    model.save_pretrained(out)
    if llava:
        from mmrl.plugins.processors.llava import LlavaProcessor

        LlavaProcessor.finish_saved_model(out)
    elif arch == "qwen3_vl_moe":  # the experts in the layout vLLM loads
        from mmrl.plugins.processors.qwen_vl import QwenVLProcessor

        QwenVLProcessor.finish_saved_model(out)
    _processor(arch, sizes, tokenizer).save_pretrained(out)

    provenance = {
        "builder": "mmrl.models.tiny_vlm.build_tiny_vlm",
        "arch": arch, "seed": seed, "dtype": dtype, "words": list(words),
        "vocab_size": len(tokenizer), "num_parameters": sum(p.numel() for p in model.parameters()),
        **asdict(sizes),
    }
    (out / "mmrl_tiny.json").write_text(json.dumps(provenance, indent=2) + "\n")
    return out

