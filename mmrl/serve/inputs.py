"""Tinker model inputs (text and image chunks) -> what the trainer and the samplers take.

An `ImageChunk` stands for the image's vision tokens (its `expected_tokens`, what `ModelInput.length`
counts); the client puts the model's `<|vision_start|>` / `<|vision_end|>` text around it, as the
tinker-cookbook renderers do. The server decodes the image, puts ONE image pad token in its place
(the engine prompt, which vLLM expands itself) and expands it with the model family's processor
adapter (`processor.expand`: the trainer's ids, vision tensors and M-RoPE positions) — the same
single source of truth `mmrl train` uses for both sides.
"""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import torch

from mmrl.serve.trainer import UserInputError

MAX_IMAGE_BYTES = 20 * 2**20
MAX_IMAGE_PIXELS = 64_000_000  # decompression-bomb guard (data.decode.pixel_limit's default)
FORMATS = {"png": "PNG", "jpeg": "JPEG"}


@dataclass
class Prompt:
    """One model input: the trainer's ids (vision blocks expanded), and, with images, their positions,
    vision tensors and the engine prompt (one pad per image + the PIL images)."""

    ids: list[int]
    engine_ids: list[int]
    images: list[Any] = field(default_factory=list)
    positions_AP: torch.Tensor | None = None
    next_position: int = 0
    mm_inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    def engine_prompt(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt_token_ids": list(self.engine_ids)}
        if self.images:
            out["multi_modal_data"] = {"image": list(self.images)}
        return out


def decode_image(data: bytes, fmt: str, where: str) -> Any:
    from PIL import Image

    if fmt not in FORMATS:
        raise UserInputError(f"{where}.format must be png or jpeg, got {fmt!r}", f"{where}.format")
    if len(data) > MAX_IMAGE_BYTES:
        raise UserInputError(f"{where}.data: {len(data)} bytes > {MAX_IMAGE_BYTES}", f"{where}.data")
    try:
        img = Image.open(io.BytesIO(data))
        if img.format != FORMATS[fmt]:
            raise UserInputError(f"{where}: format says {fmt} but the data is {img.format}", f"{where}.format")
        if img.width * img.height > MAX_IMAGE_PIXELS:
            raise UserInputError(f"{where}: {img.width}x{img.height} pixels > {MAX_IMAGE_PIXELS}", f"{where}.data")
        img.load()
    except UserInputError:
        raise
    except Exception as e:  # truncated or corrupt bytes: PIL raises several kinds
        raise UserInputError(f"{where}.data: not a readable {fmt} image ({type(e).__name__}: {e})",
                             f"{where}.data") from None
    return img.convert("RGB")


def vocab_size(model_path: str, trust_remote_code: bool = False) -> int | None:
    """Rows of the model's token embedding, from its config (None when the config does not say):
    a prompt id at or past it would fail inside the queued job instead of as a 400 on the call."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    size = getattr(config.get_text_config(), "vocab_size", None)
    return int(size) if isinstance(size, int) else None


def build_prompt(chunks: list[Any], processor: Any, where: str, vocab: int | None = None) -> Prompt:
    """`chunks`: wire.Chunk objects (or dicts with the same fields, from JSON bodies); token ids must
    be below `vocab` when given."""
    ids: list[int] = []
    images, expected = [], []
    for i, c in enumerate(chunks):
        kind = getattr(c, "kind", None) or (c.get("type", "encoded_text") if isinstance(c, dict) else None)
        here = f"{where}.chunks[{i}]"
        if kind == "encoded_text":
            toks = c.tokens if hasattr(c, "tokens") else c.get("tokens")
            if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                     for t in toks):
                raise UserInputError(f"{here}.tokens must be a list of token ids", f"{here}.tokens")
            if vocab is not None and toks and max(toks) >= vocab:
                raise UserInputError(f"{here}.tokens: ids must be in [0, {vocab}) for this model, got {max(toks)}",
                                     f"{here}.tokens")
            ids += toks
        elif kind == "image":
            if processor is None:
                raise UserInputError(f"{here}: this model takes no images", here)
            data, fmt = (c.data, c.format) if hasattr(c, "data") else (_b64(c.get("data"), here), c.get("format"))
            images.append(decode_image(data, fmt, here))
            expected.append((here, c.expected_tokens if hasattr(c, "expected_tokens") else c.get("expected_tokens")))
            ids.append(processor.image_token_id)
        else:
            raise UserInputError(f"{here}: {kind} chunks are not supported (text and image chunks)", here)
    if not ids:
        raise UserInputError(f"{where} is empty", where)
    if not images:
        return Prompt(ids=ids, engine_ids=ids)
    try:
        view = processor.expand({"prompt_token_ids": ids, "multi_modal_data": {"image": images}})
    except Exception as e:  # PromptRejected (a pad outside a vision block) and processor errors
        raise UserInputError(f"{where}: {e} (put <|vision_start|> before and <|vision_end|> after each image "
                             f"chunk)", where) from None
    counts = _runs(view.prompt_ids, processor.image_token_id)
    for (here, want), got in zip(expected, counts):
        if want is not None and want != got:
            raise UserInputError(f"{here}: expected_tokens={want} but this image is {got} tokens for this model",
                                 f"{here}.expected_tokens")
    return Prompt(ids=list(view.prompt_ids), engine_ids=ids, images=images, positions_AP=view.positions_AP,
                  next_position=int(view.next_position), mm_inputs=dict(view.mm_inputs))


def _runs(ids: list[int], token: int) -> list[int]:
    out, n = [], 0
    for t in ids + [-1]:
        if t == token:
            n += 1
        elif n:
            out.append(n)
            n = 0
    return out


def _b64(data: Any, where: str) -> bytes:
    import base64

    if not isinstance(data, str):
        raise UserInputError(f"{where}.data must be base64 text", f"{where}.data")
    try:
        return base64.b64decode(data, validate=True)
    except ValueError:
        raise UserInputError(f"{where}.data is not valid base64", f"{where}.data") from None


def full_positions(prompt: Prompt, n_extra: int) -> torch.Tensor | None:
    """(A, P + n_extra) positions of the prompt followed by n_extra text tokens; None for text-only."""
    if prompt.positions_AP is None:
        return None
    A = prompt.positions_AP.shape[0]
    tail = (prompt.next_position + torch.arange(n_extra)).expand(A, n_extra)
    return torch.cat([prompt.positions_AP, tail], dim=1)
