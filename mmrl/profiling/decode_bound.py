"""The decode-only bound: the same decoders on the same number of processes, with no pipeline.

Raw sample bytes are read into memory first and split evenly; each process decodes its part with
`mmrl.data.decode.decode_sample`. No tar reading, shuffle buffer or queue between processes
(beyond handing back a count), so samples/s here is what the loader could reach if its only
cost were decoding. Used by `mmrl profile-data` (pipeline efficiency = measured / bound) and by
benchmarks/data_pipeline.py.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

from mmrl.data.decode import DecodeOptions, decode_sample
from mmrl.data.shards import expand_urls, read_shard
from mmrl.data.stream import worker_start_method


def read_raw_samples(urls: Any, limit: int | None = None, max_bytes: int | None = None) -> list[dict[str, Any]]:
    """Raw samples (member bytes) of the shards in order, at most `limit` of them and about
    `max_bytes` in all; bad ones are left out."""
    out: list[dict[str, Any]] = []
    held = 0
    for url in expand_urls(urls):
        for raw in read_shard(url):
            if isinstance(raw, dict):
                out.append(raw)
                held += sum(len(v) for k, v in raw.items() if not k.startswith("__"))
                if (limit is not None and len(out) >= limit) or (max_bytes is not None and held >= max_bytes):
                    return out
    return out


def _decode_all(raws: list[dict[str, Any]], options: DecodeOptions) -> int:
    done = 0
    for raw in raws:
        try:
            decode_sample(raw, options)
            done += 1
        except Exception:  # a bad sample costs its decode attempt, like in the loader
            pass
    return done


# Set in each pool process before timing starts, so the bytes never cross a pipe inside the
# timed region (the bound must not pay for a transfer the loader's workers do not make either).
_RAWS: list[dict[str, Any]] = []
_OPTIONS = DecodeOptions()


def _init_worker(raws: list[dict[str, Any]], options: DecodeOptions) -> None:
    global _RAWS, _OPTIONS
    _RAWS, _OPTIONS = raws, options


def _decode_part(part: int, parts: int, warm: bool) -> int:
    mine = _RAWS[part::parts]
    return _decode_all(mine[:1] if warm else mine, _OPTIONS)


def decode_bound(raws: list[dict[str, Any]], workers: int, options: DecodeOptions | None = None) -> float:
    """Samples/s of decoding `raws` on `workers` processes (0 = in this process), start-up excluded."""
    options = options or DecodeOptions()
    if not raws:
        raise ValueError("decode_bound needs at least one raw sample")
    if workers == 0:
        _decode_all(raws[:1], options)  # imports and first-call costs are not throughput
        start = time.perf_counter()
        _decode_all(raws, options)
        return len(raws) / (time.perf_counter() - start)
    with mp.get_context(worker_start_method(default="fork")).Pool(workers, _init_worker, (raws, options)) as pool:
        pool.starmap(_decode_part, [(i, workers, True) for i in range(workers)])  # warm imports
        start = time.perf_counter()
        pool.starmap(_decode_part, [(i, workers, False) for i in range(workers)], chunksize=1)
        return len(raws) / (time.perf_counter() - start)
