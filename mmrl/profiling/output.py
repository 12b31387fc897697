"""The outputs of `mmrl profile-data`: terminal table (rich), report.json (validated against
report.schema.json), report.md, trace.json (Chrome/Perfetto) and chart.png."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mmrl.profiling.pipeline import PipelineRun

SCHEMA_PATH = Path(__file__).with_name("report.schema.json")


def load_schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


def validate_report(report: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError when `report` does not follow report.schema.json."""
    import jsonschema  # installed with ray and vllm

    jsonschema.validate(report, load_schema())


def write_all(report: dict[str, Any], run: PipelineRun, out_dir: Path) -> None:
    """Write every output into out_dir and record the paths in report["outputs"]."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"dir": str(out_dir), "report_json": str(out_dir / "report.json"),
             "report_md": str(out_dir / "report.md"), "trace": str(out_dir / "trace.json"),
             "chart": str(out_dir / "chart.png")}
    report["outputs"] = paths
    write_trace(run, Path(paths["trace"]))
    write_chart(report, Path(paths["chart"]))
    Path(paths["report_md"]).write_text(markdown(report))
    validate_report(report)
    Path(paths["report_json"]).write_text(json.dumps(report, indent=1) + "\n")


# ------------------------------------------------------------------------------------------ trace

def write_trace(run: PipelineRun, path: Path) -> Path:
    """Per-sample spans: one track per loader worker (read, decode with its images/videos nested)
    and the consumer's track (wait, processor, serialise)."""
    from mmrl.utils.trace import TraceWriter

    loader_track = "in-process (0 workers)" if run.workers == 0 else "worker {}"
    spans: list[tuple[float, float, str, str, str, dict[str, Any]]] = []  # start, dur, process, thread, name, args
    for s in run.samples:
        w = s.worker
        thread = loader_track.format(w.get("worker", 0))
        if "read_start" in w:
            spans.append((w["read_start"], w["read_s"], "loader", thread, "read",
                          {"key": s.key, "bytes": w.get("bytes", 0), "io_ms": round(w.get("io_s", 0.0) * 1e3, 3)}))
        if "decode_start" in w:
            spans.append((w["decode_start"], w["decode_s"], "loader", thread, "decode", {"key": s.key}))
        for i in w.get("images", []):
            spans.append((i["start"], i["s"], "loader", thread, "image_decode", {"pixels": i["pixels"]}))
        for v in w.get("videos", []):
            spans.append((v["start"], v["s"], "loader", thread, f"video_decode ({v['backend']})",
                          {"frames": v["frames"], "pixels": v["pixels"]}))
        start = s.wait_start
        spans.append((start, s.wait_s, "consumer", "main", "handoff_wait", {"key": s.key}))
        start += s.wait_s
        spans.append((start, s.processor_s, "consumer", "main", "processor",
                      {"tokens": s.tokens, "rejected": s.rejected}))
        if not s.rejected:
            spans.append((start + s.processor_s, s.serialise_s, "consumer", "main", "serialise",
                          {"bytes": s.serialise_bytes}))
    trace = TraceWriter(path)
    for start, dur, process, thread, name, args in sorted(spans, key=lambda x: x[0]):  # t0 = earliest span
        trace.span(name, start, dur, process=process, thread=thread, category=name.split(" ")[0], args=args)
    return trace.flush()


# ---------------------------------------------------------------------------------------- helpers

def _num(value: Any, fmt: str = ".1f") -> str:
    return "–" if value is None else format(value, fmt)


def _pct(value: Any) -> str:
    return "–" if value is None else f"{value:.0%}"


def _stage_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for s in report["stages"]:
        if not s["count"]:
            continue
        rows.append([s["name"], s["side"], str(s["count"]), _num(s["total_s"], ".3f"), _num(s["mean_ms"], ".2f"),
                     _num(s["p50_ms"], ".2f"), _num(s["p95_ms"], ".2f"), _num(s["max_ms"], ".2f"), _pct(s["share"]),
                     _num(s["items_per_s"], ".0f"), _num(s["mb_per_s"], ".1f")])
    return rows


STAGE_HEAD = ["stage", "side", "count", "total s", "mean ms", "p50 ms", "p95 ms", "max ms", "share", "items/s", "MB/s"]
SCALE_HEAD = ["workers", "samples/s", "consumer/s", "loader/s", "speedup", "efficiency", "wait", "startup s"]


def _scale_rows(report: dict[str, Any]) -> list[list[str]]:
    return [[str(p["workers"]), _num(p["samples_per_s"]), _num(p["consumer_samples_per_s"]),
             _num(p["loader_samples_per_s"]), _num(p["speedup"], ".2f"), _pct(p["efficiency"]),
             _pct(p["wait_share"]), _num(p["startup_s"], ".2f")] for p in report["scaling"]["points"]]


def _summary_lines(report: dict[str, Any]) -> list[str]:
    e, c = report["end_to_end"], report["config"]
    lines = [f"end-to-end: {e['samples_per_s']:.1f} samples/s with {report['workers']} worker(s) "
             f"(consumer {e['consumer_samples_per_s']:.1f}/s, loader {_num(e['loader_samples_per_s'])}/s); "
             f"consumer waits {e['wait_share']:.0%}; {e['busy_cores']:.2f} of {report['machine']['cpus']} cores busy; "
             f"per sample {e['worker_ms_per_sample']:.2f} ms in a worker, {e['consumer_ms_per_sample']:.2f} ms "
             f"in the consumer; start-up {e['startup_s']:.2f} s"]
    b = report["decode_bound"]
    if b:
        lines.append(f"decode-only bound ({b['workers']} worker(s), {b['samples']} samples): "
                     f"{b['samples_per_s']:.1f} samples/s; pipeline efficiency {_pct(b['pipeline_efficiency'])}")
    sm = report["samples"]
    lines.append(f"samples: {sm['measured']} measured after {sm['warmup']} warm-up; {sm['images']} images, "
                 f"{sm['videos']} videos, {sm['mean_tokens']:.0f} prompt tokens on average; "
                 f"bad {sum(sm['bad'].values())}, rejected by the processor {sm['rejected']}")
    lines.append(f"config: {c['path']} {' '.join(c['overrides'])}".rstrip())
    return lines


# ---------------------------------------------------------------------------------------- terminal

def print_report(report: dict[str, Any], console: Any = None) -> None:
    """The terminal view (rich tables; plain text when not a terminal)."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console(width=shutil.get_terminal_size((130, 40)).columns)
    c = report["config"]
    console.print(f"[bold]mmrl profile-data[/bold] {c['name']}: {report['samples']['measured']} samples, "
                  f"{report['workers']} worker(s), {report['machine']['cpus']} cores")
    table = Table(title="stages (share = of all work seconds; handoff rows are waiting, not work)")
    for i, h in enumerate(STAGE_HEAD):
        table.add_column(h, justify="left" if i < 2 else "right")
    for row in _stage_rows(report):
        table.add_row(*row)
    console.print(table)
    if report["decoders"]:
        dec = Table(title="video decoders")
        for h in ("decoder", "videos", "frames", "mean ms", "frames/s"):
            dec.add_column(h, justify="right")
        for d in report["decoders"]:
            dec.add_row(d["backend"], str(d["videos"]), str(d["frames"]), _num(d["mean_ms"], ".1f"),
                        _num(d["frames_per_s"], ".0f"))
        console.print(dec)
    scale = Table(title=f"worker sweep (efficiency vs {report['scaling']['baseline_workers']} worker(s))")
    for h in SCALE_HEAD:
        scale.add_column(h, justify="right")
    for row in _scale_rows(report):
        scale.add_row(*row)
    console.print(scale)
    for line in _summary_lines(report):
        console.print(line, highlight=False)
    console.print(f"[bold]bottleneck:[/bold] {report['bottleneck']['text']}", highlight=False)
    for a in report["advice"] or [{"text": "no change is predicted to help by 5% or more"}]:
        console.print(f"  • {a['text']}", highlight=False)
    console.print(f"outputs: {report['outputs'].get('dir', '')} (report.json, report.md, trace.json, chart.png)",
                  highlight=False)


# ---------------------------------------------------------------------------------------- markdown

def _md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    c = report["config"]
    parts = [f"# Data profile: {c['name']}", "",
             f"{report['samples']['measured']} samples, {report['workers']} worker(s), "
             f"{report['machine']['cpus']} cores, {report['created']}.", "",
             "## Stages", "", "share = of all work seconds; `handoff_*` rows are waiting, not work.", "",
             _md_table(STAGE_HEAD, _stage_rows(report)), ""]
    if report["decoders"]:
        parts += ["## Video decoders", "", _md_table(
            ["decoder", "videos", "frames", "mean ms", "frames/s"],
            [[d["backend"], str(d["videos"]), str(d["frames"]), _num(d["mean_ms"]), _num(d["frames_per_s"], ".0f")]
             for d in report["decoders"]]), ""]
    parts += ["## Worker sweep", "", report["scaling"]["definition"], "",
              _md_table(SCALE_HEAD, _scale_rows(report)), "", "## Summary", ""]
    parts += [f"- {line}" for line in _summary_lines(report)]
    parts += ["", "## Bottleneck", "", report["bottleneck"]["text"], "", "## Advice", ""]
    parts += [f"- {a['text']}" + (f" — basis: {a['basis']}" if a.get("basis") else "") for a in report["advice"]]
    if not report["advice"]:
        parts.append("- no change is predicted to help by 5% or more")
    return "\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------------ chart

def write_chart(report: dict[str, Any], path: Path) -> Path:
    """Stage breakdown (bar) and the worker scaling curve with ideal scaling and the bound."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # work stages plus the consumer's wait; handoff_latency is a delay, not a cost per sample
    stages = [s for s in report["stages"] if s["count"] and s["name"] != "handoff_latency"]
    colours = {"worker": "tab:blue", "consumer": "tab:orange", "handoff": "tab:gray"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [s["name"] for s in stages][::-1]
    left.barh(names, [s["total_s"] / max(report["samples"]["measured"], 1) * 1e3 for s in stages][::-1],
              color=[colours[s["side"]] for s in stages][::-1])
    left.set_xlabel("ms per sample (blue: loader worker, orange: consumer, grey: waiting)")
    left.set_title(f"stages ({report['workers']} worker(s)); bottleneck: {report['bottleneck']['stage']}")
    points = report["scaling"]["points"]
    ws = [p["workers"] for p in points]
    right.plot(ws, [p["samples_per_s"] for p in points], "o-", label="measured")
    base_w = report["scaling"]["baseline_workers"]
    base = next((p["samples_per_s"] for p in points if p["workers"] == base_w), None)
    if base:
        right.plot(ws, [base * max(w, 1) for w in ws], "--", color="gray", label="ideal (linear)")
    bound = report["decode_bound"]
    if bound:
        right.plot([bound["workers"]], [bound["samples_per_s"]], "s", color="tab:red", label="decode-only bound")
    top = max([p["samples_per_s"] for p in points] + [bound["samples_per_s"] if bound else 0.0])
    if top > 5 * min(p["samples_per_s"] for p in points if p["samples_per_s"] > 0):
        right.set_yscale("log")  # a far-off bound would flatten the measured curve
    right.set_xlabel("data.num_workers")
    right.set_ylabel("samples/s")
    right.set_xticks(ws)
    right.set_title("scaling")
    right.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
