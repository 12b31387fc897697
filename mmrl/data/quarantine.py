"""Bad samples: the reasons, the marker that carries one from a worker, and the main-process ledger
that counts them, writes the quarantine report and stops a run that is mostly garbage.

A bad sample never crashes training: the worker that finds it yields a `BadSample` in its place,
and the stream's main-process iterator hands it to `QuarantineLedger.record_bad` (one writer, so
the report file needs no locking across workers). When bad samples pass `max_bad_ratio` of
everything read, the stream raises `TooManyBadSamples` instead of silently training on a trickle.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger(__name__)

#: reason code -> what it means. The codes are the keys of `ShardStream.bad_counts` and the
#: "reason" field of the report; docs/data.md lists them too.
REASONS: dict[str, str] = {
    "missing_json": "the sample has no KEY.json member",
    "bad_json": "KEY.json is not UTF-8 JSON, or its top level is not an object",
    "missing_field": "the JSON has neither a non-empty 'prompt' nor 'messages'",
    "bad_field": "a JSON field has the wrong type ('messages', 'metadata', 'images', 'videos', 'system')",
    "empty_member": "a zero-byte member (KEY.json or a media file)",
    "corrupt_image": "an image member PIL cannot decode (truncated, garbage)",
    "corrupt_video": "a video member no decoder can decode (garbage, truncated, unknown codec)",
    "video_timeout": "every video decoder ran past DecodeOptions.timeout_s",
    "too_many_pixels": "an image or video frame above DecodeOptions.pixel_limit (decompression bomb)",
    "unsupported_media": "a media member of a type mmrl does not decode (gif, tiff, audio ...)",
    "missing_media": "the JSON names an image/video member the sample does not have",
    "media_count_mismatch": "image/video placeholders in the messages != images/videos of the sample",
    "duplicate_member": "two members of one sample have the same name",
    "truncated_sample": "the shard broke while this sample was being read (members may be missing)",
    "shard_open_error": "a shard could not be opened (missing file, permissions)",
    "shard_read_error": "a shard broke while reading (truncated tar, failing pipe: command)",
    "decode_error": "an unexpected exception while decoding (a bug or an exotic input; see detail)",
    "processor_limit": "an image or video outside what the model's processor accepts (e.g. aspect ratio > 200 "
                       "for Qwen-VL); checked in the loader worker",
    "prompt_rejected": "the processor refused the prompt (e.g. it would be cut inside a vision block)",
    "processor_error": "the processor raised on this sample (see detail for the error)",
}


class BadSampleError(ValueError):
    """A sample that cannot be used. `reason` is one of `REASONS`."""

    def __init__(self, reason: str, detail: str = "", key: str = "", url: str = ""):
        self.reason, self.detail, self.key, self.url = reason, detail, key, url
        where = f"sample {key!r}" + (f" in {url}" if url else "")
        super().__init__(f"{where}: {reason}" + (f" ({detail})" if detail else ""))


@dataclass
class BadSample:
    """Stands in for a bad sample on its way from a worker to the main process (small, picklable)."""
    reason: str
    key: str = ""
    url: str = ""
    detail: str = ""

    @classmethod
    def from_error(cls, error: BadSampleError) -> "BadSample":
        return cls(error.reason, error.key, error.url, error.detail)


class TooManyBadSamples(RuntimeError):
    """More than `max_bad_ratio` of the samples read were bad: the data, not the model, needs work."""

    def __init__(self, ratio: float, max_bad_ratio: float, bad: int, seen: int, counts: Counter[str],
                 report_path: str | None):
        self.ratio, self.max_bad_ratio, self.bad, self.seen = ratio, max_bad_ratio, bad, seen
        self.counts, self.report_path = dict(counts), report_path
        top = ", ".join(f"{reason}: {n}" for reason, n in counts.most_common(5))
        where = (f"every bad sample is listed in {report_path}" if report_path else
                 "pass quarantine_path=... to get a JSONL report of every bad sample")
        super().__init__(
            f"{bad} of {seen} samples read were bad ({ratio:.1%} > max_bad_ratio {max_bad_ratio:.1%}); "
            f"top reasons: {top}. {where}. Fix or rebuild the shards, or raise max_bad_ratio "
            f"(None turns the check off)")


class QuarantineLedger:
    """Counts good and bad samples, appends every bad one to a JSONL report, enforces the ratio.

    Lives in the main process only. Its counters are part of the stream's resume state, so the
    ratio and the counts continue across a restart instead of starting over.
    """

    def __init__(self, report_path: str | os.PathLike | None = None, max_bad_ratio: float | None = None,
                 min_samples_for_ratio: int = 1000, rank: int = 0):
        if max_bad_ratio is not None and not 0 <= max_bad_ratio <= 1:
            raise ValueError(f"max_bad_ratio must be in [0, 1] or None, got {max_bad_ratio}")
        # "{rank}" in the path gives each data-parallel rank its own report
        self.report_path = os.fspath(report_path).format(rank=rank) if report_path is not None else None
        self.max_bad_ratio, self.min_samples_for_ratio, self.rank = max_bad_ratio, min_samples_for_ratio, rank
        self.counts: Counter[str] = Counter()
        self.examples: deque[BadSample] = deque(maxlen=20)
        self.seen = 0  # good + bad items read
        if self.report_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.report_path)), exist_ok=True)

    @property
    def bad(self) -> int:
        return sum(self.counts.values())

    def record_good(self) -> None:
        self.seen += 1  # the ratio is checked at bad samples only: a good one is always delivered

    def record_bad(self, bad: BadSample, epoch: int | None = None, *, already_counted: bool = False) -> None:
        """`already_counted`: the sample was delivered as good and rejected later (by the
        processor), so it is not seen a second time."""
        if not already_counted:
            self.seen += 1
        self.counts[bad.reason] += 1
        self.examples.append(bad)
        first = self.counts[bad.reason] == 1
        (logger.warning if first else logger.debug)(
            "skipping bad sample (%s): key=%r url=%s %s%s", bad.reason, bad.key, bad.url, bad.detail,
            " [first of this reason; later ones at debug level; see stream.bad_counts"
            + (f" and {self.report_path}]" if self.report_path else "]") if first else "")
        if self.report_path:
            record = {**asdict(bad), "epoch": epoch, "rank": self.rank, "time": round(time.time(), 3)}
            # open-append-close per record: bad samples are rare, and nothing is lost on a crash
            with open(self.report_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._check_ratio()

    def _check_ratio(self) -> None:
        if self.max_bad_ratio is None or self.seen < max(1, self.min_samples_for_ratio):
            return
        ratio = self.bad / self.seen
        if ratio > self.max_bad_ratio:
            raise TooManyBadSamples(ratio, self.max_bad_ratio, self.bad, self.seen, self.counts,
                                    self.report_path)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = int(state.get("seen", 0))
        self.counts = Counter({str(k): int(v) for k, v in state.get("counts", {}).items()})
