"""Convert datasets in other frameworks' layouts into mmrl's webdataset shards.

    mmrl data convert --from jsonl   --src data.jsonl   --out DIR [--media-root DIR]
    mmrl data convert --from parquet --src train.parquet --out DIR [--shard-size-mb 64]
    mmrl data convert --from hf      --src saved_dataset/ --out DIR   # Dataset.save_to_disk folder

Sources (one row = one sample):
  jsonl    one JSON object per line (a file, or a folder of *.jsonl files); media are paths
           relative to --media-root (default: the folder of the source file).
  parquet  a file or a folder of *.parquet files, in the verl / EasyR1 column conventions:
           `prompt` (a string, or a list of chat messages) or `problem` / `question`; `answer`
           (or `solution`, `ground_truth`, `reward_model.ground_truth`); `images` as a list of
           {"bytes": ..., "path": ...} structs, raw bytes or paths; `videos` likewise.
  hf       a folder written by `datasets.Dataset.save_to_disk` (arrow stream files named in
           state.json, dataset_info.json) or `DatasetDict.save_to_disk` (one sub-folder per
           split, dataset_dict.json). Read with pyarrow alone: `datasets` is not needed. Columns of
           feature type Image / Video are media whatever their name.

Prompts may mark media positions with `<image>` / `<video>` tokens (as verl and EasyR1 do); then
the sample's chat messages put the placeholders there, and the number of tokens must match the
number of media. Without tokens, the media come first, then the text (mmrl's plain `prompt`).

Output: `{split}-%06d.tar` shards of about `shard_size_mb` MB (1 MB = 10^6 bytes; a shard is closed
before a sample would push it past the target, so only a single larger sample makes a larger
shard) in the format `mmrl.data.stream.decode_sample` reads: `KEY.json` ({"prompt"} or
{"messages"}, "answer", "metadata", "images"/"videos": the member names), `KEY.png` for one image
or `KEY.0.png`, `KEY.1.jpg` ... for several, `KEY.mp4` (or `KEY.0.mp4` ...) for video. Image bytes
are kept as they are for PNG, JPEG and WebP (no re-encoding: the pixels are unchanged) and
re-encoded as PNG otherwise. Other JSON-serialisable columns go into `metadata` next to
`source_index` (the row number in the source). DIR/dataset.json records counts, shards and the
rows that could not be converted: a bad row is counted by reason and skipped, never fatal.
"""
from __future__ import annotations

import base64
import glob
import io
import json
import os
import re
from collections import Counter
from typing import Any, Iterable, Iterator

from mmrl.data.decode import VIDEO_EXTS
from mmrl.data.recipes._common import ShardSink, brace, clean_out_dir, record_bytes, write_manifest
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


# ------------------------------------------------------------------------------------ sources

def _files(src: str, exts: tuple[str, ...]) -> list[str]:
    if os.path.isdir(src):
        files = sorted(f for ext in exts for f in glob.glob(os.path.join(src, "**", "*" + ext), recursive=True))
        if not files:
            raise FileNotFoundError(f"no {'/'.join(exts)} files under {src}")
        return files
    if not os.path.isfile(src):
        raise FileNotFoundError(f"source {src} does not exist")
    return [src]


def iter_jsonl(src: str) -> Iterator[dict[str, Any] | RowError]:
    """Rows of a JSONL file (or folder of them); a line that does not parse yields a RowError."""
    for path in _files(src, (".jsonl",)):
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    yield RowError("invalid json line", f"{os.path.basename(path)}:{lineno}: {e}")
                    continue
                yield row if isinstance(row, dict) else RowError(
                    "invalid json line", f"{os.path.basename(path)}:{lineno}: not an object")


def iter_parquet(src: str, batch_size: int = 256) -> Iterator[dict[str, Any]]:
    """Rows of a Parquet file (or folder of them), streamed in record batches."""
    import pyarrow.parquet as pq

    for path in _files(src, (".parquet",)):
        pf = pq.ParquetFile(path)
        for batch in pf.iter_batches(batch_size=batch_size):
            yield from batch.to_pylist()


def _media_columns(features: Any) -> dict[str, str]:
    """column -> "image" / "video" for HF features of type Image / Video (or lists of them)."""
    out: dict[str, str] = {}
    if not isinstance(features, dict):
        return out

    def kind(feat: Any) -> str | None:
        if isinstance(feat, list) and feat:  # the [Image()] shorthand
            return kind(feat[0])
        if not isinstance(feat, dict):
            return None
        t = feat.get("_type")
        if t in ("Image", "Video"):
            return t.lower()
        if t in ("Sequence", "List", "LargeList"):
            return kind(feat.get("feature"))
        return None

    for name, feat in features.items():
        k = kind(feat)
        if k:
            out[name] = k
    return out


def hf_splits(src: str) -> dict[str, str]:
    """split name -> folder, for a `save_to_disk` folder (a Dataset: {"train": src})."""
    if not os.path.isdir(src):
        raise FileNotFoundError(f"hf source {src} is not a folder written by save_to_disk")
    dd = os.path.join(src, "dataset_dict.json")
    if os.path.isfile(dd):
        with open(dd) as f:
            splits = json.load(f).get("splits") or []
        return {s: os.path.join(src, s) for s in splits}
    if not os.path.isfile(os.path.join(src, "state.json")):
        raise FileNotFoundError(
            f"{src} has neither state.json (Dataset.save_to_disk) nor dataset_dict.json "
            f"(DatasetDict.save_to_disk)")
    return {"": src}


def hf_arrow_files(folder: str) -> tuple[list[str], dict[str, str]]:
    """The arrow files of one saved Dataset (in state.json order) and its media columns."""
    with open(os.path.join(folder, "state.json")) as f:
        state = json.load(f)
    files = [os.path.join(folder, d["filename"]) for d in state.get("_data_files", [])]
    if not files:
        files = sorted(glob.glob(os.path.join(folder, "*.arrow")))
    missing = [p for p in files if not os.path.isfile(p)]
    if missing or not files:
        raise FileNotFoundError(f"arrow files named in {folder}/state.json are missing: {missing or '(none listed)'}")
    media: dict[str, str] = {}
    info_path = os.path.join(folder, "dataset_info.json")
    if os.path.isfile(info_path):
        with open(info_path) as f:
            media = _media_columns(json.load(f).get("features"))
    return files, media


def _open_arrow(path: str) -> Any:
    import pyarrow as pa

    try:  # save_to_disk writes the IPC stream format
        return pa.ipc.open_stream(pa.memory_map(path))
    except pa.ArrowInvalid:
        return pa.ipc.open_file(pa.memory_map(path))


def iter_arrow(files: list[str]) -> Iterator[dict[str, Any]]:
    for path in files:
        reader = _open_arrow(path)
        if not hasattr(reader, "__iter__"):  # RecordBatchFileReader
            batches: Iterable[Any] = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            batches = reader
        for batch in batches:
            yield from batch.to_pylist()


def _arrow_media_columns(path: str) -> dict[str, str]:
    """Media columns from the 'huggingface' schema metadata of an arrow file."""
    try:
        meta = _open_arrow(path).schema.metadata or {}
        hf = json.loads(meta.get(b"huggingface", b"{}"))
        return _media_columns(hf.get("info", {}).get("features"))
    except Exception:
        return {}


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


# ------------------------------------------------------------------------------------- driver

class _Report:
    def __init__(self) -> None:
        self.rows = 0
        self.good = 0
        self.reasons: Counter[str] = Counter()
        self.examples: list[str] = []

    def bad(self, where: str, err: RowError) -> None:
        self.reasons[err.reason] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {err}")

    def as_dict(self) -> dict[str, Any]:
        return {"count": sum(self.reasons.values()), "reasons": dict(self.reasons.most_common()),
                "examples": list(self.examples)}


def _write_split(rows: Iterable[dict[str, Any] | RowError], out_dir: str, split: str, *,
                 media_root: str | None, media_columns: dict[str, str], maxbytes: float,
                 require_answer: bool, report: _Report, limit: int | None,
                 source_name: str) -> tuple[int, int]:
    n_good = 0
    with ShardSink(os.path.join(out_dir, f"{split}-%06d.tar"), maxbytes=maxbytes) as sink:
        for index, row in enumerate(rows):
            if limit is not None and index >= limit:
                break
            report.rows += 1
            where = f"{source_name} row {index}"
            try:
                if isinstance(row, RowError):
                    raise row
                record, members = convert_row(row, media_root=media_root, media_columns=media_columns,
                                              require_answer=require_answer)
            except RowError as e:
                report.bad(where, e)
                continue
            except Exception as e:  # an exotic row must not stop a long conversion
                report.bad(where, RowError("conversion error", f"{type(e).__name__}: {e}"))
                continue
            record["metadata"].setdefault("source_index", index)
            sink.write({"__key__": f"{split}-{index:08d}", "json": record_bytes(record), **members})
            n_good += 1
    report.good += n_good
    return n_good, len(sink.shards)


def convert(src: str, out_dir: str, *, source_format: str, media_root: str | None = None,
            shard_size_mb: float = 64.0, split: str = "train", limit: int | None = None,
            require_answer: bool = True) -> dict[str, Any]:
    """Convert `src` (jsonl | parquet | hf) into shards under `out_dir`; return the manifest
    (also written to `out_dir/dataset.json`) with counts, shard patterns and the bad rows:
    {"count", "reasons": {reason: n}, "examples": [...]}.

    `split` names the output shards (`{split}-000000.tar` ...); an `hf` DatasetDict folder keeps
    its own split names. `limit` stops after that many source rows per split."""
    if source_format not in SOURCE_FORMATS:
        raise ValueError(f"source format must be one of {', '.join(SOURCE_FORMATS)}, got {source_format!r}")
    if not shard_size_mb > 0:
        raise ValueError(f"shard_size_mb must be > 0, got {shard_size_mb}")
    if not re.fullmatch(r"[A-Za-z0-9_-]+", split):
        raise ValueError(f"split must be letters, digits, '_' or '-', got {split!r}")
    src = os.path.abspath(os.fspath(src))
    if media_root is not None:
        media_root = os.path.abspath(os.fspath(media_root))
        if not os.path.isdir(media_root):
            raise FileNotFoundError(f"media root {media_root} is not a folder")

    jobs: list[tuple[str, Iterable[Any], str | None, dict[str, str], str]] = []
    if source_format == "jsonl":
        root = media_root or (src if os.path.isdir(src) else os.path.dirname(src))
        _files(src, (".jsonl",))  # fail now on a missing source
        jobs.append((split, iter_jsonl(src), root, {}, os.path.basename(src)))
    elif source_format == "parquet":
        root = media_root or (src if os.path.isdir(src) else os.path.dirname(src))
        _files(src, (".parquet",))
        jobs.append((split, iter_parquet(src), root, {}, os.path.basename(src)))
    else:
        for name, folder in hf_splits(src).items():
            files, media = hf_arrow_files(folder)
            media = media or _arrow_media_columns(files[0])
            out_split = name or split
            if not re.fullmatch(r"[A-Za-z0-9_-]+", out_split):
                raise ValueError(f"split name {out_split!r} cannot name shard files")
            jobs.append((out_split, iter_arrow(files), media_root or folder, media,
                         os.path.basename(folder.rstrip("/"))))

    out_dir = os.fspath(out_dir)
    previous = _previous_manifest(out_dir)
    out_dir = clean_out_dir(out_dir, [job[0] for job in jobs])
    report = _Report()
    counts: dict[str, int] = {}
    n_shards: dict[str, int] = {}
    shards: dict[str, str] = {}
    for out_split, rows, root, media, source_name in jobs:
        n, k = _write_split(rows, out_dir, out_split, media_root=root, media_columns=media,
                            maxbytes=shard_size_mb * 1e6, require_answer=require_answer,
                            report=report, limit=limit, source_name=source_name)
        counts[out_split] = n
        if k:
            n_shards[out_split] = k
            shards[out_split] = brace(out_split, k)
    converted = dict(counts)
    # A conversion into a folder that holds other splits from an earlier conversion keeps them.
    if previous:
        for mine, key in ((counts, "counts"), (n_shards, "num_shards"), (shards, "shards")):
            for s, v in (previous.get(key) or {}).items():
                if s not in converted:
                    mine[s] = v
    info = {
        "recipe": f"convert:{source_format}",
        "args": {"src": src, "source_format": source_format, "media_root": media_root,
                 "shard_size_mb": shard_size_mb, "split": split, "limit": limit,
                 "require_answer": require_answer},
        "counts": counts,
        "num_shards": n_shards,
        "shards": shards,
        "converted": converted,  # this conversion's splits (counts also lists earlier ones)
        "rows": report.rows,
        "bad": report.as_dict(),
    }
    write_manifest(out_dir, info)
    return info


def _previous_manifest(out_dir: str) -> dict[str, Any] | None:
    path = os.path.join(out_dir, "dataset.json")
    try:
        with open(path) as f:
            prev = json.load(f)
    except (OSError, ValueError):
        return None
    if isinstance(prev, dict) and str(prev.get("recipe", "")).startswith("convert:"):
        return prev
    return None


def format_report(info: dict[str, Any]) -> str:
    """A few human-readable lines about a conversion."""
    lines = [f"converted {sum(info['converted'].values())} of {info['rows']} row(s) from "
             f"{info['args']['src']} ({info['args']['source_format']})"]
    for split, n in info["converted"].items():
        lines.append(f"  {split}: {n} sample(s) in {info['num_shards'].get(split, 0)} shard(s)"
                     + (f": {info['shards'][split]}" if split in info["shards"] else ""))
    bad = info["bad"]
    if bad["count"]:
        lines.append(f"skipped {bad['count']} bad row(s): "
                     + ", ".join(f"{r} ({n})" for r, n in bad["reasons"].items()))
        lines += [f"  {e}" for e in bad["examples"]]
    return "\n".join(lines)
