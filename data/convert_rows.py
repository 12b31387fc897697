"""One source row -> one mmrl sample (the JSON record and its media members), for `mmrl data
convert` (data/convert.py documents the column conventions). A row that cannot be converted
raises RowError with a short reason for the report."""
from __future__ import annotations

import base64
import io
import json
import os
import re
from typing import Any

from mmrl.data.decode import VIDEO_EXTS
from mmrl.data.sample import messages_from_prompt

SOURCE_FORMATS = ("jsonl", "parquet", "hf")
PROMPT_KEYS = ("prompt", "problem", "question")
ANSWER_KEYS = ("answer", "solution", "ground_truth")
IMAGE_KEYS = ("images", "image")
VIDEO_KEYS = ("videos", "video")
KEEP_IMAGE_FORMATS = {"PNG": "png", "JPEG": "jpg", "MPO": "jpg", "WEBP": "webp"}
_PLACEHOLDER = re.compile(r"(<image>|<video>)")
MAX_EXAMPLES = 5


class RowError(ValueError):
    """A row that cannot be converted; `reason` is a short category for the report."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


# ------------------------------------------------------------------------------- row -> sample

def _load_bytes(value: Any, media_root: str | None, what: str) -> tuple[bytes, str]:
    """(bytes, source path or "") from a path, raw bytes, a data URI or a {"bytes", "path"} dict."""
    if isinstance(value, dict):
        data = value.get("bytes")
        if data:
            return bytes(data), str(value.get("path") or "")
        value = value.get("path")
        if not value:
            raise RowError(f"missing {what}", "struct has neither bytes nor path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value), ""
    if not isinstance(value, str) or not value:
        raise RowError(f"missing {what}", f"expected a path, bytes or {{bytes, path}}, got {type(value).__name__}")
    if value.startswith("data:"):
        try:
            return base64.b64decode(value.split(",", 1)[1]), ""
        except Exception as e:
            raise RowError(f"undecodable {what}", f"bad data URI: {e}") from None
    if re.match(r"^[a-z][a-z0-9+.-]*://", value) and not value.startswith("file://"):
        raise RowError(f"remote {what}", f"{value}: download it first and give a local path")
    path = value[len("file://"):] if value.startswith("file://") else value
    if os.path.isabs(path):
        # an absolute path from the machine that made the dataset (HF Image structs keep one):
        # as given, else the file of that name in the media root
        candidates = [path] + ([os.path.join(media_root, os.path.basename(path))] if media_root else [])
    else:
        candidates = [os.path.join(media_root, path)] if media_root else [path]
    for p in candidates:
        if os.path.isfile(p):
            with open(p, "rb") as f:
                return f.read(), p
    raise RowError(f"missing {what}", f"{value} not found" + (f" under {media_root}" if media_root else ""))


def _image_member(value: Any, media_root: str | None) -> tuple[bytes, str]:
    """(bytes, extension): original bytes for PNG/JPEG/WebP, PNG re-encoding otherwise."""
    from PIL import Image, ImageOps

    data, _ = _load_bytes(value, media_root, "image")
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            fmt = im.format or ""
            if fmt in KEEP_IMAGE_FORMATS:
                return data, KEEP_IMAGE_FORMATS[fmt]
            im = ImageOps.exif_transpose(im)
            if im.mode not in ("1", "L", "LA", "P", "RGB", "RGBA", "I;16"):
                im = im.convert("RGB")
            buf = io.BytesIO()
            im.save(buf, "PNG")
            return buf.getvalue(), "png"
    except RowError:
        raise
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError ...
        raise RowError("undecodable image", f"{type(e).__name__}: {e}") from None


def _video_member(value: Any, media_root: str | None) -> tuple[bytes, str]:
    """(bytes, extension) of a video that PyAV can open and decode a frame of."""
    import av

    if isinstance(value, list):
        raise RowError("unsupported video", "videos given as frame lists; encode them to a video file first")
    data, path = _load_bytes(value, media_root, "video")
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise RowError("undecodable video", "no video stream")
            next(container.decode(video=0))
            names = container.format.name.split(",")
    except RowError:
        raise
    except Exception as e:
        raise RowError("undecodable video", f"{type(e).__name__}: {e}") from None
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if ext not in VIDEO_EXTS:
        ext = "mp4" if "mp4" in names else "webm" if "webm" in names else "mkv" if "matroska" in names \
            else "avi" if "avi" in names else "mp4"
    return data, ext


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _split_text(text: str) -> list[dict[str, Any]]:
    """'<image>What is this?' -> [{"type": "image"}, {"type": "text", "text": "What is this?"}]."""
    parts: list[dict[str, Any]] = []
    for piece in _PLACEHOLDER.split(text):
        if piece == "<image>":
            parts.append({"type": "image"})
        elif piece == "<video>":
            parts.append({"type": "video"})
        elif piece.strip():
            parts.append({"type": "text", "text": piece.strip()})
    return parts


def _content_parts(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return _split_text(content)
    if isinstance(content, list):
        parts = []
        for c in content:
            if isinstance(c, str):
                parts += _split_text(c)
            elif isinstance(c, dict):
                t = c.get("type")
                if t in ("image", "image_url"):
                    parts.append({"type": "image"})
                elif t in ("video", "video_url"):
                    parts.append({"type": "video"})
                elif t == "text" and isinstance(c.get("text"), str):
                    parts += _split_text(c["text"])
                else:
                    raise RowError("invalid messages", f"unknown content part {c!r:.80}")
        return parts
    raise RowError("invalid messages", f"content must be a string or a list, got {type(content).__name__}")


def _messages(row: dict[str, Any]) -> tuple[list[dict[str, Any]], set[str]]:
    """Chat messages with media placeholders (as written in the source) and the keys used."""
    system = row.get("system") if isinstance(row.get("system"), str) and row["system"].strip() else None
    used = {"system"} if system else set()
    source = row.get("messages")
    if source is not None:
        used.add("messages")
    else:
        for key in PROMPT_KEYS:
            if row.get(key) is not None:
                source = row[key]
                used.add(key)
                break
    if isinstance(source, str):
        if not source.strip():
            raise RowError("no prompt", "empty prompt")
        source = [{"role": "user", "content": source}]
    if not isinstance(source, list) or not source:
        keys = ", ".join(("messages",) + PROMPT_KEYS)
        raise RowError("no prompt", f"none of {keys} is a non-empty string or message list")
    messages = []
    if system and not any(isinstance(m, dict) and m.get("role") == "system" for m in source):
        messages.append({"role": "system", "content": system})
    for m in source:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RowError("invalid messages", "each message needs a 'role' and a 'content'")
        if m["role"] == "system" and isinstance(m.get("content"), str):
            messages.append({"role": "system", "content": m["content"]})
        else:
            messages.append({"role": m["role"], "content": _content_parts(m.get("content"))})
    if not any(m["role"] == "user" for m in messages):
        raise RowError("no prompt", "no user message")
    return messages, used


def _count(messages: list[dict[str, Any]], kind: str) -> int:
    return sum(1 for m in messages if isinstance(m["content"], list) for c in m["content"] if c["type"] == kind)


def _place_media(messages: list[dict[str, Any]], n_images: int, n_videos: int) -> None:
    """Check the placeholders against the media; with none at all, put them first in the
    first user turn (mmrl's plain-prompt layout)."""
    for kind, n in (("image", n_images), ("video", n_videos)):
        have = _count(messages, kind)
        if have == n:
            continue
        if have == 0:
            first_user = next(m for m in messages if m["role"] == "user")
            at = sum(1 for c in first_user["content"] if c["type"] in ("image", "video"))
            first_user["content"][at:at] = [{"type": kind} for _ in range(n)]
        else:
            raise RowError(f"{kind} count mismatch", f"{have} <{kind}> placeholder(s), {n} {kind}(s)")


def _answer(row: dict[str, Any]) -> tuple[Any, set[str]]:
    for key in ANSWER_KEYS:
        if row.get(key) is not None:
            return row[key], {key}
    rm = row.get("reward_model")
    if isinstance(rm, dict) and rm.get("ground_truth") is not None:
        return rm["ground_truth"], set()
    return None, set()


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def convert_row(row: dict[str, Any], *, media_root: str | None = None,
                media_columns: dict[str, str] | None = None,
                require_answer: bool = True) -> tuple[dict[str, Any], dict[str, bytes]]:
    """One source row -> (the KEY.json record, {member extension: bytes}). Raises RowError."""
    media_columns = dict(media_columns or {})
    for key in IMAGE_KEYS:
        if key in row:
            media_columns.setdefault(key, "image")
    for key in VIDEO_KEYS:
        if key in row:
            media_columns.setdefault(key, "video")
    images: list[tuple[bytes, str]] = []
    videos: list[tuple[bytes, str]] = []
    for col, kind in media_columns.items():
        for i, value in enumerate(_as_list(row.get(col))):
            if value is None:
                raise RowError(f"missing {kind}", f"{col}[{i}] is null")
            if kind == "image":
                images.append(_image_member(value, media_root))
            else:
                videos.append(_video_member(value, media_root))

    messages, used = _messages(row)
    _place_media(messages, len(images), len(videos))
    answer, answer_keys = _answer(row)
    if answer is None and require_answer:
        raise RowError("no answer", f"none of {', '.join(ANSWER_KEYS)}, reward_model.ground_truth")
    if not _jsonable(answer):
        raise RowError("invalid answer", f"not JSON-serialisable: {type(answer).__name__}")
    used |= answer_keys | set(media_columns)

    members: dict[str, bytes] = {}
    record: dict[str, Any] = {}
    for kind, items in (("images", images), ("videos", videos)):
        names = [ext if len(items) == 1 else f"{i}.{ext}" for i, (_, ext) in enumerate(items)]
        members.update({n: data for n, (data, _) in zip(names, items)})
        if names:
            record[kind] = names

    user_turns = [m for m in messages if m["role"] == "user"]
    last = user_turns[-1]["content"]
    text = " ".join(c["text"] for c in last if c["type"] == "text")
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    if messages == messages_from_prompt(text, len(images), len(videos), system=system):
        record["prompt"] = text  # the compact form decode_sample turns back into these messages
        if system:
            record["system"] = system
    else:
        record["messages"] = messages
    record["answer"] = answer

    metadata: dict[str, Any] = {}
    if isinstance(row.get("metadata"), dict):
        metadata.update(row["metadata"])
        used.add("metadata")
    for k, v in row.items():
        if k not in used and v is not None and _jsonable(v):
            metadata.setdefault(k, v)
    record["metadata"] = metadata
    return record, members
