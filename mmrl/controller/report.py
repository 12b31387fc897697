"""`mmrl report RUN_DIR`: where a run's step time goes, its throughput, and plots of its curves.

Reads RUN_DIR/metrics.jsonl (and RUN_DIR/config.yaml when present) and writes RUN_DIR/report/:
summary.json (the numbers), summary.md (the same for humans) and PNG plots; with RUN_DIR/rollouts/
(logged rollouts) also RUN_DIR/rollouts.html (controller/rollouts_html.py). A run that is still
going is fine: a half-written last line of metrics.jsonl is ignored.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

TIME_PREFIX, TIME_SUFFIX = "time/", "_s"
NOT_SPANS = {"step", "wall"}  # time/step_s is the whole step, time/wall_s the clock since the start
OTHER = "other/unaccounted"


class ReportError(ValueError):
    """A problem with RUN_DIR the user has to fix (no metrics yet, wrong folder)."""


@dataclass
class SpanStats:
    name: str
    mean_s: float  # seconds per step, averaged over every timed step (0 where the span did not run)
    share: float  # of the total step time
    p50_s: float  # percentiles over the steps where the span ran
    p95_s: float
    steps: int  # steps where the span ran
    nested: bool = False  # a sub-span ("rollout/engine_0") inside a top-level one: not added to the sum
    cores: float | None = None  # mean CPU seconds of the run's processes per wall second in the span


@dataclass
class MetricsLog:
    rows: list[dict[str, Any]]
    notes: list[str]


def load_metrics(run_dir: Path) -> MetricsLog:
    """The rows of RUN_DIR/metrics.jsonl for the latest run in it, skipping a partial last line."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        where = (f"the folder {run_dir} does not exist" if not run_dir.exists()
                 else f"there is no metrics.jsonl in {run_dir}")
        raise ReportError(
            f"cannot report on {path}: {where}. `mmrl report` reads the metrics a training run writes to "
            f"its output folder (run.output_dir in the config, e.g. runs/colors-demo); pass that folder, "
            f"or start a run first with `mmrl train CONFIG`.")
    notes: list[str] = []
    lines = path.read_text(encoding="utf-8").split("\n")
    rows: list[dict[str, Any]] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            # the last line of a live run may be mid-write; anything else is real damage
            if lineno < len(lines):
                notes.append(f"skipped unreadable line {lineno} of {path.name}")
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)):
            notes.append(f"skipped line {lineno} of {path.name}: no 'step'")
            continue
        if rows and row["step"] <= rows[-1]["step"]:
            # MetricsLogger appends: a second `mmrl train` into the same folder restarts the step count
            notes.append(f"{path.name} holds more than one run; reporting the last one (from line {lineno})")
            rows = []
        rows.append(row)
    if not timed_rows(rows):
        raise ReportError(
            f"{path} has no finished training step yet ({len(rows)} row(s), none with time/step_s; step 0 "
            f"holds only the first evaluation). Run `mmrl report {run_dir}` again once the run has logged a step.")
    return MetricsLog(rows=rows, notes=notes)


def timed_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The training steps (step 0, the first evaluation, has no time/step_s)."""
    return [r for r in rows if isinstance(r.get("time/step_s"), (int, float))]


def span_names(rows: list[dict[str, Any]]) -> list[str]:
    """Span names in first-seen order, from the time/<span>_s keys of the rows."""
    names: dict[str, None] = {}
    for row in rows:
        for key in row:
            if key.startswith(TIME_PREFIX) and key.endswith(TIME_SUFFIX):
                name = key[len(TIME_PREFIX):-len(TIME_SUFFIX)]
                if name not in NOT_SPANS:
                    names[name] = None
    return list(names)


def _stats(name: str, per_step: list[float | None], total_step_s: float, nested: bool = False) -> SpanStats:
    present = [v for v in per_step if v is not None]
    return SpanStats(
        name=name, mean_s=sum(present) / len(per_step), share=sum(present) / total_step_s if total_step_s else 0.0,
        p50_s=float(np.percentile(present, 50)) if present else 0.0,
        p95_s=float(np.percentile(present, 95)) if present else 0.0, steps=len(present), nested=nested)


def breakdown(rows: list[dict[str, Any]]) -> tuple[list[SpanStats], SpanStats, list[int]]:
    """Per-span stats over the timed steps, the unaccounted rest, and the steps covered."""
    timed = timed_rows(rows)
    total = sum(r["time/step_s"] for r in timed)
    spans = []
    for name in span_names(timed):
        values = [r.get(f"{TIME_PREFIX}{name}{TIME_SUFFIX}") for r in timed]
        stats = _stats(name, values, total, nested="/" in name)
        cores = [r[f"cores/{name}"] for r in timed if isinstance(r.get(f"cores/{name}"), (int, float))]
        stats.cores = sum(cores) / len(cores) if cores else None
        spans.append(stats)
    # What no top-level span measured; negative when spans overlap (then it is reported as such).
    top = [s.name for s in spans if not s.nested]
    other = [r["time/step_s"] - sum(r.get(f"{TIME_PREFIX}{n}{TIME_SUFFIX}", 0.0) for n in top) for r in timed]
    top_level = sorted((s for s in spans if not s.nested), key=lambda s: -s.mean_s)
    ordered = [x for s in top_level for x in [s] + [n for n in spans if n.nested and n.name.startswith(s.name + "/")]]
    ordered += [s for s in spans if s not in ordered]  # a sub-span whose parent was never logged
    return ordered, _stats(OTHER, other, total), [int(r["step"]) for r in timed]


def _cfg(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _trainer_hint(config: dict[str, Any]) -> str:
    """Micro-batching only helps while a rank splits its sequences into several micro-batches."""
    micro, world = _cfg(config, "trainer.micro_batch_size"), _cfg(config, "trainer.world_size")
    prompts, group = _cfg(config, "rollout.prompts_per_step"), _cfg(config, "rollout.group_size")
    more = f"raise trainer.world_size (now {world}) with more devices"
    if all(isinstance(v, int) and v > 0 for v in (micro, world, prompts, group)):
        per_rank = math.ceil(prompts * group / world)
        if micro < per_rank:
            return (f"trainer forward/backward: raise trainer.micro_batch_size (now {micro}, each rank has "
                    f"{per_rank} sequences) if memory allows, or {more}")
        return (f"trainer forward/backward: each rank already takes its {per_rank} sequences in one micro-batch; "
                f"{more}, or train on fewer responses (rollout.prompts_per_step × rollout.group_size)")
    return f"trainer forward/backward: {more}, or raise trainer.micro_batch_size if memory allows"


def hint(span: str, config: dict[str, Any], rows: list[dict[str, Any]], run_dir: Path) -> str:
    """A concrete next step for the span that takes most of the step, named by config keys."""
    c = lambda key: _cfg(config, key)  # noqa: E731
    kind = span.split("/")[0]
    if kind == "rollout":
        engines, cap = c("rollout.num_engines"), c("rollout.max_new_tokens")
        more = f"add engines (rollout.num_engines={engines}, one per GPU)"
        lengths = [r["rollout/response_length"] for r in rows if "rollout/response_length" in r]
        if lengths and isinstance(cap, int) and np.mean(lengths) >= 0.9 * cap:
            return (f"generation: {more}, or lower rollout.max_new_tokens={cap}: responses run to the cap "
                    f"(mean {np.mean(lengths):.1f} tokens), so a lower cap cuts generation time (and truncates)")
        return f"generation: {more}, or lower rollout.group_size (responses per prompt)"
    if kind == "data_wait":
        return (f"the loader is not keeping up: run `mmrl profile-data {run_dir / 'config.yaml'}` to find the "
                f"slow stage, then raise data.num_workers (now {c('data.num_workers')}) or lower "
                f"data.decode.max_pixels / processor.max_pixels for large media")
    if kind == "reward":
        return (f"reward scoring: raise reward_execution.num_workers (now {c('reward_execution.num_workers')}) "
                f"so rewards score in parallel; a slow reward shows in reward/seconds")
    if kind in ("train", "logprob"):
        return _trainer_hint(config)
    if kind == "weight_sync":
        bucket, sent = c("weight_sync.bucket_mb"), [r["weight_sync/mb"] for r in rows if "weight_sync/mb" in r]
        spread = "a larger rollout.prompts_per_step spreads this fixed per-step cost over more samples"
        if sent and isinstance(bucket, (int, float)) and max(sent) <= bucket:
            return f"pushing weights to the engines ({max(sent):.1f} MB, already one bucket): {spread}"
        return (f"pushing weights to the engines each step: raise weight_sync.bucket_mb (now {bucket}) for "
                f"fewer, larger transfers; {spread}")
    if kind == "eval":
        return (f"held-out evaluation: raise eval.every_steps (now {c('eval.every_steps')}) or cap "
                f"eval.num_prompts (now {c('eval.num_prompts') or 'all'})")
    if kind == "checkpoint":
        return "checkpoint saves: save less often, or to a faster local disk"
    trace = run_dir / "trace.json"
    where = (f"open {trace} in https://ui.perfetto.dev" if trace.is_file()
             else "the run's trace.json (once it writes one) shows it")
    if span == OTHER:
        return f"time outside the named spans (batching, advantages, logging, Ray calls): {where}"
    return f"{where} to see what this span does"


def summarize(run_dir: Path, log: MetricsLog) -> dict[str, Any]:
    """Everything the report prints and writes, as plain data (also summary.json)."""
    import yaml

    spans, other, steps = breakdown(log.rows)
    config_path = run_dir / "config.yaml"
    config = (yaml.safe_load(config_path.read_text()) or {}) if config_path.is_file() else {}
    timed = timed_rows(log.rows)
    total_s = sum(r["time/step_s"] for r in timed)
    steps_per_min = 60.0 * len(timed) / total_s if total_s > 0 else 0.0
    prompts, group = _cfg(config, "rollout.prompts_per_step"), _cfg(config, "rollout.group_size")
    throughput: dict[str, Any] = {"steps_per_min": steps_per_min}
    if isinstance(prompts, int) and isinstance(group, int):
        throughput.update(samples_per_step=prompts * group, samples_per_min=steps_per_min * prompts * group)
    candidates = [s for s in spans if not s.nested] + [other]
    top = max(candidates, key=lambda s: s.mean_s)
    max_steps = _cfg(config, "run.max_steps")
    return {
        "run_dir": str(run_dir),
        "steps": {"first": steps[0], "last": steps[-1], "count": len(steps), "max_steps": max_steps},
        "step_time_s": {"mean": total_s / len(timed), "total": total_s,
                        "wall": max((r.get("time/wall_s", 0.0) for r in timed), default=0.0)},
        "spans": [asdict(s) for s in spans],
        "other": asdict(other),
        "throughput": throughput,
        "cores_available": next((r["cores/available"] for r in reversed(timed) if "cores/available" in r), None),
        "startup": _startup(timed),
        "startup_cpu": _startup_cpu(timed),
        "startup_ready": _startup_ready(timed),
        "top": {"span": top.name, "share": top.share, "mean_s": top.mean_s,
                "hint": hint(top.name, config, log.rows, run_dir)},
        "notes": log.notes,
    }


def startup_phases(row: dict[str, Any], prefix: str = "startup/") -> dict[str, float]:
    """`<prefix><name>_s` of a first step's metrics row as {name: seconds}, in logged order:
    the start-up phases ("startup/") or the CPU seconds per kind of process ("startup_cpu/")."""
    return {k[len(prefix):-2]: v for k, v in row.items() if k.startswith(prefix) and k.endswith("_s")}


def _startup_row(timed: list[dict[str, Any]]) -> dict[str, Any]:
    """The latest process's first-step row, which carries its start-up metrics ({} if none)."""
    return next((r for r in reversed(timed) if "startup/total_s" in r), {})


def _startup(timed: list[dict[str, Any]]) -> dict[str, float] | None:
    """The latest process's start-up phases (logged with its first step), in order."""
    return startup_phases(_startup_row(timed)) or None


def _startup_cpu(timed: list[dict[str, Any]]) -> dict[str, float] | None:
    """CPU seconds per kind of process up to the end of the latest process's first step, largest first."""
    cpu = startup_phases(_startup_row(timed), "startup_cpu/")
    return dict(sorted(cpu.items(), key=lambda kv: -kv[1])) or None


def _startup_ready(timed: list[dict[str, Any]]) -> dict[str, float] | None:
    """When each kind of process that starts side by side was up (seconds from the process start), first first."""
    ready = startup_phases(_startup_row(timed), "startup_ready/")
    return dict(sorted(ready.items(), key=lambda kv: kv[1])) or None


def _startup_cpu_line(cpu: dict[str, float], cores: float | None) -> str:
    kinds = ", ".join(f"{name} {s:.1f}" for name, s in cpu.items())
    bound = f" (>= {sum(cpu.values()) / cores:.1f} s of wall time on {cores:g} cores)" if cores else ""
    return f"start-up CPU: {sum(cpu.values()):.1f} s over the run's processes{bound}: {kinds}"


def _startup_line(startup: dict[str, float], ready: dict[str, float] | None = None) -> str:
    phases = ", ".join(f"{name} {s:.1f}" for name, s in startup.items() if name != "total")
    line = f"start-up: {startup['total']:.1f} s from the process start to the end of the first step ({phases})"
    if ready:
        line += "; ready at " + ", ".join(f"{name.replace('_', ' ')} {s:.1f} s" for name, s in ready.items())
    return line


def _fmt_share(share: float) -> str:
    return f"{100 * share:.1f}%"


def _cores_column(available: float | None) -> str:
    return f"cores (of {available:.0f})" if available else "cores"


def _fmt_cores(cores: float | None) -> str:
    return "-" if cores is None else f"{cores:.2f}"


def render(summary: dict[str, Any], console: Any) -> None:
    """The step-time table, throughput and the call-out, on a rich console."""
    from rich.table import Table

    st, steps = summary["step_time_s"], summary["steps"]
    table = Table(title=f"step time, steps {steps['first']}-{steps['last']} ({steps['count']} steps, "
                        f"{st['mean']:.3f} s/step)")
    available = summary.get("cores_available")
    for col in ("span", "s/step", "share", "p50 s", "p95 s", "steps", _cores_column(available)):
        table.add_column(col, justify="left" if col == "span" else "right", no_wrap=True)
    for s in summary["spans"] + [summary["other"]]:
        name = f"  {s['name']}" if s["nested"] else s["name"]
        share = f"({_fmt_share(s['share'])})" if s["nested"] else _fmt_share(s["share"])
        table.add_row(name, f"{s['mean_s']:.3f}", share, f"{s['p50_s']:.3f}", f"{s['p95_s']:.3f}",
                      f"{s['steps']}/{steps['count']}", _fmt_cores(s.get("cores")),
                      style="dim" if s["nested"] else None)
    console.print(table)
    idle = [f"{s['name']} {s['cores']:.1f}" for s in summary["spans"]
            if s.get("cores") is not None and available and s["cores"] < 0.75 * available]
    if idle:
        console.print(f"cores: these phases kept less than 3/4 of the {available:.0f} CPUs busy: {', '.join(idle)} "
                      "(CPU seconds of all the run's processes per wall second in the phase)", highlight=False)
    if summary["other"]["mean_s"] < 0:
        console.print("note: the spans add up to more than the step time, so some of them overlap")
    if steps["max_steps"] and steps["last"] < steps["max_steps"]:
        console.print(f"steps: {steps['last']} of run.max_steps={steps['max_steps']} (still going, or stopped early)")
    if summary.get("startup"):
        console.print(_startup_line(summary["startup"], summary.get("startup_ready")), highlight=False)
    if summary.get("startup_cpu"):
        console.print(_startup_cpu_line(summary["startup_cpu"], summary.get("cores_available")), highlight=False)
    tp = summary["throughput"]
    line = f"throughput: {tp['steps_per_min']:.2f} steps/min"
    if "samples_per_min" in tp:
        line += (f", {tp['samples_per_min']:.0f} samples/min ({tp['samples_per_step']} per step = "
                 f"rollout.prompts_per_step × rollout.group_size)")
    console.print(line)
    top = summary["top"]
    console.print(f"where the time goes: [bold]{top['span']}[/bold] takes {_fmt_share(top['share'])} of the "
                  f"step time ({top['mean_s']:.3f} s/step) -> {top['hint']}", highlight=False)
    for note in summary["notes"]:
        console.print(f"note: {note}", highlight=False)


def to_markdown(summary: dict[str, Any], plots: list[str], skipped: dict[str, str]) -> str:
    steps, top, tp = summary["steps"], summary["top"], summary["throughput"]
    lines = [f"# Run report: {summary['run_dir']}", "",
             f"Steps {steps['first']}-{steps['last']} ({steps['count']} steps), "
             f"{summary['step_time_s']['mean']:.3f} s/step, {tp['steps_per_min']:.2f} steps/min"
             + (f", {tp['samples_per_min']:.0f} samples/min" if "samples_per_min" in tp else "") + ".", "",
             f"**Where the time goes:** {top['span']} ({_fmt_share(top['share'])}): {top['hint']}", "",
             *([_startup_line(summary["startup"], summary.get("startup_ready")) + ".", ""] if summary.get("startup") else []),
             *([_startup_cpu_line(summary["startup_cpu"], summary.get("cores_available")) + ".", ""]
               if summary.get("startup_cpu") else []),
             f"| span | s/step | share | p50 s | p95 s | steps | {_cores_column(summary.get('cores_available'))} |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for s in summary["spans"] + [summary["other"]]:
        name = f"&nbsp;&nbsp;{s['name']}" if s["nested"] else s["name"]
        lines.append(f"| {name} | {s['mean_s']:.3f} | {_fmt_share(s['share'])} | {s['p50_s']:.3f} | "
                     f"{s['p95_s']:.3f} | {s['steps']}/{steps['count']} | {_fmt_cores(s.get('cores'))} |")
    lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    lines += [f"- {name}: skipped ({why})" for name, why in skipped.items()]
    return "\n".join(lines) + "\n"


def write_report(run_dir: str | Path, console: Any) -> dict[str, Any]:
    """Print the report and write RUN_DIR/report/{summary.json,summary.md,*.png} (and RUN_DIR/rollouts.html
    when the run logged rollouts); return the summary."""
    from mmrl.controller.report_plots import write_plots

    run_dir = Path(run_dir)
    log = load_metrics(run_dir)
    summary = summarize(run_dir, log)
    render(summary, console)
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    plots, skipped = write_plots(log.rows, out)
    summary["plots"] = {"written": [str(p) for p in plots], "skipped": skipped}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "summary.md").write_text(to_markdown(summary, summary["plots"]["written"], skipped))
    for name, why in skipped.items():
        console.print(f"plot {name}: skipped ({why})", highlight=False)
    console.print(f"wrote {len(plots)} plot(s), summary.json and summary.md to {out}", highlight=False)
    if (run_dir / "rollouts").is_dir():
        from mmrl.controller.rollouts_html import write_rollouts_html

        console.print(f"wrote the logged rollouts to {write_rollouts_html(run_dir)}", highlight=False)
    return summary
