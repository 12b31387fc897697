"""Where `mmrl data convert` reads rows from: JSONL files, Parquet files, and folders written by
`datasets` (arrow streams, read with pyarrow alone)."""
from __future__ import annotations

import glob
import json
import os
from typing import Any, Iterable, Iterator

from mmrl.plugins.data.convert_rows import RowError

# ------------------------------------------------------------------------------------ sources

def source_files(src: str, exts: tuple[str, ...]) -> list[str]:
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
    for path in source_files(src, (".jsonl",)):
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

    for path in source_files(src, (".parquet",)):
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


def arrow_media_columns(path: str) -> dict[str, str]:
    """Media columns from the 'huggingface' schema metadata of an arrow file."""
    try:
        meta = _open_arrow(path).schema.metadata or {}
        hf = json.loads(meta.get(b"huggingface", b"{}"))
        return _media_columns(hf.get("info", {}).get("features"))
    except Exception:
        return {}
