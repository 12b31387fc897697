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

import json
import os
import re
from collections import Counter
from typing import Any, Iterable

from mmrl.plugins.data.convert_rows import MAX_EXAMPLES, SOURCE_FORMATS, RowError, convert_row
from mmrl.plugins.data.convert_sources import (arrow_media_columns, hf_arrow_files, hf_splits, iter_arrow, iter_jsonl,
                                       iter_parquet, source_files)
from mmrl.plugins.data.recipes._common import ShardSink, brace, clean_out_dir, record_bytes, write_manifest

__all__ = ["convert", "convert_row", "format_report", "RowError", "SOURCE_FORMATS"]

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
        source_files(src, (".jsonl",))  # fail now on a missing source
        jobs.append((split, iter_jsonl(src), root, {}, os.path.basename(src)))
    elif source_format == "parquet":
        root = media_root or (src if os.path.isdir(src) else os.path.dirname(src))
        source_files(src, (".parquet",))
        jobs.append((split, iter_parquet(src), root, {}, os.path.basename(src)))
    else:
        for name, folder in hf_splits(src).items():
            files, media = hf_arrow_files(folder)
            media = media or arrow_media_columns(files[0])
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
