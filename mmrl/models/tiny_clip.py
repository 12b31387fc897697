"""A tiny random-weight CLIP, built locally, for testing the `clip_score` reward offline.

Like `tiny_vlm.py`: no hub. The tokenizer is a CLIP-style byte-level BPE (lower-cased, words end
in `</w>`) trained on a small local corpus; the model is a `CLIPModel` from a config with tiny
sizes and seeded random weights. The folder is an ordinary Hugging Face folder:
`AutoModel.from_pretrained` and `AutoProcessor.from_pretrained` load it offline.

    python -m mmrl.models.tiny_clip --out work/tiny-clip
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from mmrl.models.tiny_vlm import DEFAULT_WORDS

__all__ = ["build_tiny_clip", "build_clip_tokenizer"]

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
# transformers' CLIPTokenizer splits words like this before the byte-level step
_CLIP_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


def _corpus(words: Sequence[str]) -> list[str]:
    lines = []
    for w in words:
        lines += [w, f"a photo of {w}", f"a {w} shape", f"the answer is {w}", f"a {w} square on grey"]
    return lines * 10


def build_clip_tokenizer(out_dir: str | Path, words: Sequence[str] = DEFAULT_WORDS, vocab_size: int = 600) -> Any:
    """Train a CLIP-style BPE tokenizer on a local corpus, save it to `out_dir`, return it."""
    from transformers import CLIPTokenizer

    trainer_tok = Tokenizer(models.BPE(end_of_word_suffix="</w>", unk_token=None))
    trainer_tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                                   normalizers.Lowercase()])
    trainer_tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_CLIP_SPLIT), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[], show_progress=False,
                                  initial_alphabet=alphabet, end_of_word_suffix="</w>")
    trainer_tok.train_from_iterator(_corpus(words), trainer=trainer)
    merges = json.loads(trainer_tok.to_str())["model"]["merges"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]
    # Every byte, alone and word-final, so no input ever needs the unknown token; then one token
    # per merge and the two specials (CLIP's layout).
    vocab: dict[str, int] = {}
    for token in alphabet + [c + "</w>" for c in alphabet] + [a + b for a, b in merges] + [BOS, EOS]:
        vocab.setdefault(token, len(vocab))
    tok = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    return tok


def build_tiny_clip(out_dir: str | Path, *, seed: int = 0, hidden_size: int = 32, num_layers: int = 2,
                    image_size: int = 32, patch_size: int = 8, projection_dim: int = 32,
                    words: Sequence[str] = DEFAULT_WORDS) -> Path:
    """Build a tiny random CLIP (model, tokenizer, image processor) into `out_dir`; return it.

    Weights come from `seed` alone (the global torch RNG is left untouched).
    """
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    if image_size % patch_size:
        raise ValueError(f"image_size ({image_size}) must be a multiple of patch_size ({patch_size})")
    out = Path(out_dir)
    tokenizer = build_clip_tokenizer(out, words)
    layer = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                 num_attention_heads=2)
    config = CLIPConfig(
        text_config=dict(**layer, vocab_size=len(tokenizer), max_position_embeddings=77,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(**layer, image_size=image_size, patch_size=patch_size),
        projection_dim=projection_dim,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPModel(config)
    model.save_pretrained(out)
    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out)
    (out / "mmrl_tiny.json").write_text(json.dumps({
        "builder": "mmrl.models.tiny_clip.build_tiny_clip", "seed": seed, "hidden_size": hidden_size,
        "num_layers": num_layers, "image_size": image_size, "patch_size": patch_size,
        "vocab_size": len(tokenizer), "num_parameters": sum(p.numel() for p in model.parameters()),
    }, indent=2) + "\n")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build a tiny random CLIP locally (for clip_score tests).")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"tiny CLIP written to {build_tiny_clip(args.out, seed=args.seed)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
