"""Look inside webdataset shards before training on them.

    mmrl data inspect DIR/train-{000000..000003}.tar [--model MODEL_DIR] [--limit N] [--json]
    mmrl data inspect DIR                  # every .tar file in DIR

Reads every sample exactly the way the stream does (`read_shard` + `decode_sample`, default
`DecodeOptions`) and reports: shard and sample counts; media per sample, image sizes (min /
median / max), video frame counts, durations, fps and sizes of the source videos; the answer
distribution (top 10); prompt lengths in tokens of the model's tokenizer (`--model`; the text of
the last user turn, without chat template or vision tokens) or in characters; and the bad samples
by reason (the stream's quarantine codes, `mmrl.data.quarantine.REASONS`) with a few keys each.
With `--model`, media are also checked against that model's processor limits (`processor_limit`),
as the training stream checks them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
from collections import Counter, defaultdict
from typing import Any, Callable, Sequence

from mmrl.data.decode import DecodeOptions, decode_sample
from mmrl.data.media_limits import MediaLimits
from mmrl.data.quarantine import BadSample, BadSampleError
from mmrl.data.shards import expand_urls, read_shard

MAX_KEYS_PER_REASON = 5


def shard_urls(specs: str | Sequence[str]) -> list[str]:
    """Shard URLs from brace patterns / lists (see `expand_urls`); a folder means its .tar files."""
    specs = [specs] if isinstance(specs, (str, os.PathLike)) else list(specs)
    urls: list[str] = []
    for spec in specs:
        spec = os.fspath(spec)
        if os.path.isdir(spec):
            tars = sorted(os.path.join(spec, n) for n in os.listdir(spec) if n.endswith(".tar"))
            if not tars:
                raise FileNotFoundError(f"no .tar shard files in the folder {spec}")
            urls += tars
        else:
            urls += expand_urls(spec)
    return urls


# ------------------------------------------------------------------------------------- stats

def _spread(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    vs = sorted(values)
    return {"min": vs[0], "median": statistics.median(vs), "mean": round(statistics.fmean(vs), 3),
            "p95": vs[min(len(vs) - 1, int(round(0.95 * (len(vs) - 1))))], "max": vs[-1]}


def _size_spread(sizes: Sequence[tuple[int, int]]) -> dict[str, list[int]] | None:
    """Smallest, median and largest [width, height] by pixel count."""
    if not sizes:
        return None
    by_area = sorted(sizes, key=lambda wh: (wh[0] * wh[1], wh))
    return {k: list(by_area[i]) for k, i in (("min", 0), ("median", len(by_area) // 2), ("max", -1))}


def _token_counter(model: str | None) -> tuple[str, Callable[[str], int]]:
    if not model:
        return "characters", len
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return "tokens", lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


def _media_limits(model: str | None) -> MediaLimits | None:
    """The limits of the processor `mmrl train` would build for `model` (None: no model, a
    tokenizer-only folder, or a model family without a processor adapter: prompt lengths are
    still counted)."""
    if not model:
        return None
    from mmrl.processors import build_processor
    from mmrl.registry import PluginError

    try:
        return getattr(build_processor("auto", model), "media_limits", None)
    except (PluginError, OSError, ValueError):
        return None


def inspect_shards(specs: str | Sequence[str], *, model: str | None = None, limit: int | None = None,
                   top: int = 10, decode: DecodeOptions | None = None) -> dict[str, Any]:
    """Statistics of the samples in shards (see the module doc), as a JSON-ready dict.
    `limit` stops after that many samples (good or bad, in shard order)."""
    urls = shard_urls(specs)
    options = decode or DecodeOptions()
    if options.media_limits is None:
        options = dataclasses.replace(options, media_limits=_media_limits(model))
    unit, count_tokens = _token_counter(model)
    n_samples = n_good = 0
    shard_samples: dict[str, int] = {}
    answers: Counter[str] = Counter()
    prompt_lengths: list[int] = []
    images_per_sample: Counter[int] = Counter()
    videos_per_sample: Counter[int] = Counter()
    widths: list[int] = []
    heights: list[int] = []
    video_stats: dict[str, list[float]] = defaultdict(list)
    bad_reasons: Counter[str] = Counter()
    bad_examples: dict[str, list[dict[str, str]]] = defaultdict(list)
    shard_errors = 0

    def bad(reason: str, key: str, url: str, detail: str) -> None:
        bad_reasons[reason] += 1
        if len(bad_examples[reason]) < MAX_KEYS_PER_REASON:
            bad_examples[reason].append({"key": key, "shard": url, "detail": detail})

    done = False
    for url in urls:
        if done:
            break
        shard_samples[url] = 0
        for item in read_shard(url):
            if isinstance(item, BadSample) and not item.key:  # the shard itself failed
                bad(item.reason, "", url, item.detail)
                shard_errors += 1
                continue
            if limit is not None and n_samples >= limit:
                done = True
                break
            n_samples += 1
            shard_samples[url] += 1
            if isinstance(item, BadSample):  # truncated_sample, duplicate_member
                bad(item.reason, item.key, url, item.detail)
                continue
            try:
                sample = decode_sample(item, options)
            except BadSampleError as e:
                bad(e.reason, str(item.get("__key__", "?")), url, e.detail)
                continue
            except Exception as e:  # what the stream calls decode_error
                bad("decode_error", str(item.get("__key__", "?")), url, f"{type(e).__name__}: {e}")
                continue
            n_good += 1
            a = sample.answer
            answers[a if isinstance(a, str) else json.dumps(a)] += 1
            prompt_lengths.append(count_tokens(sample.prompt_text))
            images_per_sample[len(sample.images)] += 1
            videos_per_sample[len(sample.videos)] += 1
            for im in sample.images:
                widths.append(im.width)
                heights.append(im.height)
            for v in sample.videos:
                video_stats["frames"].append(v.total_num_frames)
                video_stats["duration"].append(round(v.duration, 3))
                video_stats["fps"].append(round(v.source_fps, 3))
                video_stats["sampled_frames"].append(len(v.frames))
                video_stats["width"].append(int(v.frames.shape[2]))
                video_stats["height"].append(int(v.frames.shape[1]))

    sizes = {u: os.path.getsize(u) for u in shard_samples if os.path.isfile(u)}
    n_images, n_videos = len(widths), len(video_stats["frames"])
    return {
        "shards": {"count": len(shard_samples), "bytes": sum(sizes.values()) if sizes else None,
                   "samples_per_shard": _spread(list(shard_samples.values())), "errors": shard_errors,
                   "files": list(shard_samples)},
        "samples": {"total": n_samples, "good": n_good, "bad": sum(bad_reasons.values()) - shard_errors,
                    "limited": limit is not None and done},
        "media": {
            "images": n_images,
            "images_per_sample": {str(k): v for k, v in sorted(images_per_sample.items())},
            "image_width": _spread(widths), "image_height": _spread(heights),
            "image_size": _size_spread(list(zip(widths, heights))),
            "videos": n_videos,
            "videos_per_sample": {str(k): v for k, v in sorted(videos_per_sample.items())},
            **{f"video_{k}": _spread(video_stats[k]) for k in ("frames", "duration", "fps", "sampled_frames")},
            "video_size": _size_spread(list(zip(video_stats["width"], video_stats["height"]))),
        },
        "answers": {"distinct": len(answers), "top": [[a, n] for a, n in answers.most_common(top)]},
        "prompt_length": {"unit": unit, **(_spread(prompt_lengths) or {})},
        "bad": {"count": sum(bad_reasons.values()), "reasons": dict(bad_reasons.most_common()),
                "examples": dict(bad_examples)},
        "media_limits": dataclasses.asdict(options.media_limits) if options.media_limits else None,
    }


# ------------------------------------------------------------------------------------- output

def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def _spread_text(s: dict[str, Any] | None, suffix: str = "") -> str:
    if not s:
        return "-"
    return f"min {_fmt(s['min'])}  median {_fmt(s['median'])}  max {_fmt(s['max'])}{suffix}"


def _wh_text(s: dict[str, list[int]] | None) -> str:
    if not s:
        return "-"
    return "  ".join(f"{k} {s[k][0]}x{s[k][1]}" for k in ("min", "median", "max"))


def _mb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:.2f} MB"


def report_sections(stats: dict[str, Any]) -> list[tuple[str, list[tuple[str, str]]]]:
    """(section title, [(name, value)]) rows for a table."""
    sh, sa, me, an, pl, bd = (stats[k] for k in ("shards", "samples", "media", "answers",
                                                  "prompt_length", "bad"))
    overview = [("shards", f"{sh['count']} ({_mb(sh['bytes'])})"),
                ("samples", f"{sa['total']} ({sa['good']} good, {sa['bad']} bad)"
                 + (" [stopped at --limit]" if sa["limited"] else "")),
                ("samples per shard", _spread_text(sh["samples_per_shard"]))]
    if sh["errors"]:
        overview.append(("unreadable shard events", str(sh["errors"])))
    media = [("images", f"{me['images']}  (per sample: "
              + ", ".join(f"{k}: {v}" for k, v in me["images_per_sample"].items()) + ")")]
    if me["images"]:
        media.append(("image size (WxH)", _wh_text(me["image_size"])))
    media.append(("videos", str(me["videos"])))
    if me["videos"]:
        media += [("video frames", _spread_text(me["video_frames"])),
                  ("video duration", _spread_text(me["video_duration"], " s")),
                  ("video fps", _spread_text(me["video_fps"])),
                  ("frames the stream samples", _spread_text(me["video_sampled_frames"])),
                  ("video size (WxH, decoded)", _wh_text(me["video_size"]))]
    answers = [(a if len(a) <= 60 else a[:57] + "...", str(n)) for a, n in an["top"]]
    answers.append(("(distinct answers)", str(an["distinct"])))
    prompt = [(f"prompt length ({pl['unit']})", _spread_text(pl if "min" in pl else None)
               + (f"  p95 {_fmt(pl['p95'])}" if "p95" in pl else ""))]
    bad = [(reason, f"{n}  e.g. " + ", ".join(e["key"] or os.path.basename(e["shard"]) for e in bd["examples"][reason]))
           for reason, n in bd["reasons"].items()] or [("(none)", "")]
    limits = stats.get("media_limits")
    bad.append(("(processor limits checked)", limits["owner"] if limits else "none (no --model)"))
    return [("overview", overview), ("media", media), ("answers (top 10)", answers),
            ("prompts", prompt), ("bad samples", bad)]


def format_plain(stats: dict[str, Any]) -> str:
    lines = []
    for title, rows in report_sections(stats):
        lines.append(f"== {title}")
        width = max((len(k) for k, _ in rows), default=0)
        lines += [f"  {k:<{width}}  {v}".rstrip() for k, v in rows]
    return "\n".join(lines)


def print_report(stats: dict[str, Any], file: Any = None) -> None:
    """A rich table on a terminal, plain aligned text otherwise (logs, pipes, tests)."""
    file = file or sys.stdout
    if getattr(file, "isatty", lambda: False)():
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            pass
        else:
            console = Console(file=file)
            for title, rows in report_sections(stats):
                table = Table(title=title, show_header=False, title_justify="left")
                table.add_column(style="bold")
                table.add_column()
                for k, v in rows:
                    table.add_row(k, v)
                console.print(table)
            return
    print(format_plain(stats), file=file)
