"""The `mmrl` command line: train, report, profile-data, tiny-model, data build/convert/inspect, plugins list, rewards check, new."""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import textwrap
import threading
from typing import Any, Sequence


def _parse_kv(pairs: Sequence[str]) -> dict[str, Any]:
    """key=value pairs with YAML-typed values (ints, floats, bools, lists)."""
    import yaml

    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise SystemExit(f"mmrl: expected key=value, got {pair!r}")
        key, value = pair.split("=", 1)
        out[key.replace("-", "_")] = yaml.safe_load(value)
    return out


def _check_rewards(cfg: Any) -> None:
    """Resolve the config's rewards and check their args (names, YAML booleans for text) before
    Ray starts: a typo then costs a second, not an engine start-up."""
    import dataclasses

    from mmrl.rewards.base import RewardSet

    try:
        RewardSet([dataclasses.asdict(r) for r in cfg.rewards])
    except ValueError as e:
        raise SystemExit(f"mmrl: error: {e}") from None


def cmd_train(args: argparse.Namespace) -> int:
    from mmrl.config import load_config, to_yaml

    from mmrl.config.load import check_named_files

    # mistakes inside the config first (they cost a second to fix), then the files it names
    cfg = load_config(args.config, args.overrides, check_files=False)
    _check_rewards(cfg)
    check_named_files(cfg)
    if args.dry_run:
        from mmrl.controller.placement import format_plan, placement_plan
        from mmrl.utils.env import resolve_device

        from mmrl.controller.memory_plan import check_memory_plan, describe_memory_plan

        device = resolve_device(cfg.cluster.device.value)  # cluster.device=cuda plans for GPUs absent here
        print("# resolved config\n" + to_yaml(cfg))
        print(f"# placement (device: {device})\n" + format_plan(placement_plan(cfg, device)))
        text, plan = describe_memory_plan(cfg, device)
        print(f"# memory plan (device: {device}; estimates, docs/training.md#large-models)\n" + text, flush=True)
        if plan is not None:
            check_memory_plan(plan)  # a plan that cannot fit stops here, naming the biggest term and the fix
        return 0
    import shlex

    from mmrl.controller.restarts import RunStopped, train_with_restarts
    from mmrl.rollout.workers import ActorRestartsExhausted
    from mmrl.utils.signals import sigterm_unwinds

    # SIGTERM (a scheduler's kill) unwinds like Ctrl-C, so the engines shut down cleanly and
    # release their shared memory; the exit status is then 143 (mmrl/utils/signals.py)
    with sigterm_unwinds() as terminated:
        try:  # a trainer rank that dies: restarted from the newest checkpoint (run.max_restarts), then this
            summary = train_with_restarts(cfg, command=shlex.join(["mmrl", "train", args.config, *args.overrides]))
        except (RunStopped, ActorRestartsExhausted) as e:
            print(f"mmrl: error: {e}", file=sys.stderr)
            return e.exit_code
        except KeyboardInterrupt:
            if not terminated:  # Ctrl-C: Python's own exit (130, with the traceback)
                raise
            print("mmrl: stopped by SIGTERM; the run closed as at its end", file=sys.stderr)
            return 143
    curve = summary.pop("heldout_curve", [])
    print("held-out accuracy by step: " + ", ".join(f"{s}:{a:.3f}" for s, a, _ in curve))
    print(json.dumps(summary, indent=2, default=str))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from mmrl.config import load_config
    from mmrl.serve import serve
    from mmrl.serve.auth import KeyConfigError

    cfg = load_config(args.config, args.overrides, check_data=False)  # it reads no shards
    try:
        serve(cfg, host=args.host, port=args.port)
    except KeyConfigError as e:  # no API keys, or keys without the tml- prefix
        print(f"mmrl: error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_serve_rollout(args: argparse.Namespace) -> int:
    from mmrl.config import load_config
    from mmrl.rollout.serve import serve_rollout

    cfg = load_config(args.config, args.overrides, check_data=False)  # it reads no shards
    serve_rollout(cfg, host=args.host, port=args.port, on_drift=args.on_drift, parser=args.parser or None)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from rich.console import Console

    from mmrl.controller.report import ReportError, write_report

    try:
        write_report(args.run_dir, Console())
    except ReportError as e:  # wrapped without splitting the paths it names
        print("mmrl: error: " + textwrap.fill(str(e), width=100, subsequent_indent="  ", break_on_hyphens=False,
                                              break_long_words=False), file=sys.stderr)
        return 2
    return 0


def cmd_new(args: argparse.Namespace) -> int:
    from mmrl.scaffold import new_plugin

    try:
        made = new_plugin(args.kind, args.name, args.dir, force=args.force)
    except (ValueError, FileExistsError) as e:
        print(f"mmrl new: {e}", file=sys.stderr)
        return 2
    print(f"wrote {made.plugin}\n      {made.test}\n\ntest it:  python -m pytest {made.test}\n\nuse it in a config:\n"
          f"{textwrap.indent(made.usage, '  ')}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from mmrl.trainer.export import ExportError, export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype)
    except ExportError as e:
        print("mmrl: error: " + textwrap.fill(str(e), width=100, subsequent_indent="  ", break_on_hyphens=False,
                                              break_long_words=False), file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {out} (load it with transformers or vllm, or set model.path={out})")
    return 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from mmrl.models.tiny_vlm import DEFAULT_WORDS, build_tiny_vlm

    words = args.words.split(",") if args.words else DEFAULT_WORDS
    try:
        path = build_tiny_vlm(args.arch, args.out, words=words, seed=args.seed, dtype=args.dtype,
                              hidden_size=args.hidden_size, num_layers=args.num_layers,
                              vision_depth=args.vision_depth)
    except ValueError as e:
        print(f"mmrl: error: {e}", file=sys.stderr)
        return 2
    print(f"tiny {args.arch} model written to {path}")
    return 0


def _user_value_errors(fn: Any) -> Any:
    """Data commands: a ValueError (a bad option value) is the user's to fix: print it, exit 2."""
    import functools

    @functools.wraps(fn)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (ValueError, TypeError) as e:
            print("mmrl: error: " + textwrap.fill(str(e), width=100, subsequent_indent="  "), file=sys.stderr)
            return 2
    return wrapper


def _worker_list(text: str) -> list[int]:
    try:
        return [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected worker counts like 0,1,2, got {text!r}") from None


@_user_value_errors
def cmd_profile_data(args: argparse.Namespace) -> int:
    from mmrl.profiling.data_profile import profile_data
    from mmrl.profiling.output import print_report

    report = profile_data(args.config, args.overrides, samples=args.samples, workers=args.workers,
                          out_dir=args.out, probe_samples=args.probe_samples, bound=not args.no_bound,
                          say=lambda m: print(f"[profile-data] {m}", file=sys.stderr, flush=True))
    print_report(report)
    return 0


@_user_value_errors
def cmd_data_build(args: argparse.Namespace) -> int:
    from mmrl import registry

    import inspect

    build = registry.resolve("dataset", args.name)
    options = _parse_kv(args.options)
    params = inspect.signature(build).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        known = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(unknown)} for dataset recipe {args.name!r}; "
                             f"its options are: {', '.join(known)}")
    info = build(args.out, **options)
    print(json.dumps(info, indent=2, default=str))
    return 0


@_user_value_errors
def cmd_data_convert(args: argparse.Namespace) -> int:
    from mmrl.plugins.data.convert import convert, format_report

    info = convert(args.src, args.out, source_format=args.source_format, media_root=args.media_root,
                   shard_size_mb=args.shard_size_mb, split=args.split, limit=args.limit,
                   require_answer=not args.allow_no_answer)
    print(format_report(info))
    print(f"manifest: {os.path.join(args.out, 'dataset.json')}")
    return 0 if sum(info["converted"].values()) else 1


@_user_value_errors
def cmd_data_inspect(args: argparse.Namespace) -> int:
    from mmrl.data.inspect import inspect_shards, print_report

    stats = inspect_shards(args.shards, model=args.model, limit=args.limit)
    if args.json:
        print(json.dumps(stats, indent=2, default=str))
    else:
        print_report(stats)
    return 0 if stats["samples"]["good"] else 1


def cmd_plugins_list(args: argparse.Namespace) -> int:
    from mmrl import registry

    rows = [(e.kind, e.name, e.origin, registry.describe(e.obj)) for e in registry.entries(args.kind)]
    width = [max(len(r[i]) for r in rows) for i in range(3)] if rows else [4, 4, 6]
    print(f"{'kind':<{width[0]}}  {'name':<{width[1]}}  {'origin':<{width[2]}}  description")
    for kind, name, origin, doc in rows:
        print(f"{kind:<{width[0]}}  {name:<{width[1]}}  {origin:<{width[2]}}  {doc}")
    return 0


def _read_responses(path: str) -> list[tuple[str | None, str]]:
    """(key or None, response) rows from a JSONL of {"key", "response"} objects or plain lines
    (a line that is a JSON string is unquoted, so responses may contain escaped newlines)."""
    rows: list[tuple[str | None, str]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                obj = line
            if isinstance(obj, dict):
                if "response" not in obj:
                    raise ValueError(f"{path}:{lineno}: a JSON object needs a 'response' key "
                                     f"(and optionally 'key'), got keys {sorted(obj)}")
                key = obj.get("key")
                rows.append((None if key is None else str(key), str(obj["response"])))
            else:
                rows.append((None, obj if isinstance(obj, str) else line))
    return rows


def _cell(value: Any, width: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = text.replace("\n", "\\n").replace("\t", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


@_user_value_errors
def cmd_rewards_check(args: argparse.Namespace) -> int:
    from mmrl.data.inspect import shard_urls
    from mmrl.data.stream import ShardStream
    from mmrl.rewards import RewardSet
    from mmrl.rewards.workers import GroupScorer

    try:
        reward_args = json.loads(args.args) if args.args else {}
    except ValueError as e:
        raise ValueError(f"--args must be a JSON object, e.g. '{{\"first_word\": true}}': {e}") from e
    if not isinstance(reward_args, dict):
        raise ValueError(f"--args must be a JSON object, e.g. '{{\"first_word\": true}}', got {args.args}")
    rewards = RewardSet([{"name": args.reward, "args": reward_args}])  # PluginError: exit 2 in main()
    rows_in = _read_responses(args.responses) if args.responses else None
    keyed = rows_in is not None and any(k is not None for k, _ in rows_in)
    if keyed and any(k is None for k, _ in rows_in or []):
        raise ValueError(f"{args.responses}: mix of rows with and without 'key'; give every row a key, "
                         f"or none (then rows apply to the samples in order)")
    limit = args.limit if args.limit is not None else (len(rows_in) if rows_in else 16)

    # (sample, response) pairs to score
    pairs: list[tuple[Any, str]] = []
    stream = ShardStream(shard_urls(args.shards), epochs=1, shuffle_buffer=0, num_workers=0, split_by_node=False,
                         shuffle_shards=False, max_bad_ratio=None)
    try:
        if keyed:
            wanted: dict[str, list[str]] = {}
            for k, r in (rows_in or [])[:limit]:
                wanted.setdefault(str(k), []).append(r)
            found: dict[str, Any] = {}
            for sample in stream:
                if sample.key in wanted and sample.key not in found:
                    found[sample.key] = sample
                    if len(found) == len(wanted):
                        break
            missing = [k for k in wanted if k not in found]
            if missing:
                print(f"mmrl: warning: {len(missing)} response key(s) not found in the shards: "
                      f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}", file=sys.stderr)
            pairs = [(found[k], r) for k, rs in wanted.items() if k in found for r in rs]
        else:
            for i, sample in enumerate(stream):
                if rows_in is not None:
                    if i >= min(limit, len(rows_in)):
                        break
                    pairs.append((sample, rows_in[i][1]))
                else:
                    if i >= limit:
                        break
                    ref = sample.answer if isinstance(sample.answer, str) else json.dumps(sample.answer)
                    pairs += [(sample, "" if sample.answer is None else ref), (sample, "")]
    finally:
        stream.close()
    if not pairs:
        print("mmrl: no samples to score (empty shards, or no response matched a sample)", file=sys.stderr)
        return 1

    scorer = GroupScorer(rewards, timeout_s=args.timeout)
    label = rewards.names[0]
    table: list[tuple[str, str, str, str, str]] = []
    scores: list[float] = []
    failures: list[tuple[str, dict[str, str]]] = []
    for sample, response in pairs:
        out, fails = scorer.score_response(sample, response)
        comps = {k.split("/", 1)[1]: v for k, v in out.items() if "/" in k and k.split("/", 1)[1] != "score"}
        if fails:  # the error (or timeout) in place of the score
            failures.append((sample.key, fails[0]))
            score_cell, comp_cell = fails[0]["kind"].upper(), _cell(fails[0]["message"], 60)
        else:
            scores.append(out["score"])
            score_cell = f"{out['score']:.4g}"
            comp_cell = " ".join(f"{k}={v:.4g}" for k, v in comps.items())
        table.append((sample.key, _cell(sample.answer, 24), _cell(response, 40), score_cell, comp_cell))
    head = ("key", "answer", "response", "score", "components")
    widths = [max(len(r[i]) for r in table + [head]) for i in range(4)]
    print("  ".join(f"{h:<{w}}" for h, w in zip(head, widths)) + "  " + head[4])
    for row in table:
        print("  ".join(f"{c:<{w}}" for c, w in zip(row, widths)) + "  " + row[4])
    if failures:
        key, f = failures[0]
        print(f"\n{len(failures)} of {len(pairs)} call(s) failed; the first (sample {key!r}): "
              f"{f['message']}\n{f['traceback'].rstrip()}")
    mean = sum(scores) / len(scores) if scores else float("nan")
    print(f"\nmean score of {label!r}: {mean:.4f} over {len(scores)} scored response(s)"
          + (f" ({len(failures)} failed)" if failures else ""))
    return 1 if failures else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmrl", description="Multimodal RL post-training.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train from a YAML config, with key=value overrides")
    p.add_argument("config", help="YAML config file, e.g. configs/colors_demo.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.group_size=8 trainer.lr=1e-3")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config, the process placement and "
                                                          "the memory plan (refused when it cannot fit)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("serve", help="a Tinker API server (the official tinker SDK drives it): LoRA training "
                                      "and sampling of the config's model (docs/service.md)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p.add_argument("--host", default=None, help="default: serve.host")
    p.add_argument("--port", type=int, default=None, help="default: serve.port; 0 = any free port (printed)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("serve-rollout", help="serve the config's rollout engines as an OpenAI-compatible, "
                                              "token-recording endpoint for outside agents")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port (printed when the server is up)")
    p.add_argument("--on-drift", choices=["splice", "flag"], default="splice")
    p.add_argument("--parser", default="hermes", help="tool-call parser for replies' tool_calls ('' = none)")
    p.set_defaults(func=cmd_serve_rollout)

    p = sub.add_parser("new", help="write a plugin from a commented template, with a test against its kind's contract")
    p.add_argument("kind", choices=["reward", "agent_loop", "tool", "processor"])
    p.add_argument("name", help="a lower-case Python identifier: the file, function/class and registered name")
    p.add_argument("--dir", default=".", help="where to write NAME.py and test_NAME.py (default: here)")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.set_defaults(func=cmd_new)

    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model folder (LoRA merged)")
    p.add_argument("checkpoint", help="RUN_DIR/checkpoints/step_N, or a run folder (its newest checkpoint)")
    p.add_argument("--out", required=True, help="a new folder for the HF model")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: the model config's")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("report", help="step-time breakdown, throughput and plots of a run (live or finished)",
                       description="Print where a run's step time goes and write RUN_DIR/report/ "
                                   "(summary.json, summary.md, PNG plots), and RUN_DIR/rollouts.html when the "
                                   "run logged rollouts.")
    p.add_argument("run_dir", help="the run's output folder (run.output_dir), e.g. runs/colors-demo")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("profile-data", help="time every stage of the config's data path (no training) "
                                            "and say what to change",
                       description="Run the config's data path alone (shards -> decode in data.num_workers "
                                   "workers -> processor -> pickle), time every stage, sweep worker counts, "
                                   "and write report.json, report.md, trace.json and chart.png (docs/profiling.md).")
    p.add_argument("config", help="YAML config file, e.g. configs/colors_demo.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.num_workers=2 data.decode.fps=1")
    p.add_argument("--samples", type=int, default=256, help="measured samples per worker count (default 256)")
    p.add_argument("--workers", type=_worker_list, default=None,
                   help="worker counts to sweep, e.g. 0,1,2 (default: 1, data.num_workers and twice it within "
                        "the cores; data.num_workers is always included)")
    p.add_argument("--out", default=None, help="output folder (default: profiles/<run.name>)")
    p.add_argument("--probe-samples", type=int, default=8,
                   help="samples each proposed change is measured on (default 8)")
    p.add_argument("--no-bound", action="store_true", help="skip the decode-only bound")
    p.set_defaults(func=cmd_profile_data)

    p = sub.add_parser("tiny-model", help="build a tiny random VLM (tokenizer + processor) locally")
    p.add_argument("--arch", default="qwen2_5_vl",
                   choices=["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "llava", "internvl"])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--words", default=None, help="comma-separated answer words kept as single tokens")
    # larger sizes for benchmarks where compute must matter (e.g. --hidden-size 1024 --num-layers 6: ~60 M)
    p.add_argument("--hidden-size", type=int, default=128, help="text width (a multiple of the head size)")
    p.add_argument("--num-layers", type=int, default=2, help="text decoder layers")
    p.add_argument("--vision-depth", type=int, default=1, help="vision tower blocks")
    p.set_defaults(func=cmd_tiny_model)

    p = sub.add_parser("data", help="dataset recipes, converters and inspection")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    b = data_sub.add_parser("build", help="write a dataset recipe's webdataset shards")
    b.add_argument("name", help="recipe name (see `mmrl plugins list --kind dataset`)")
    b.add_argument("--out", required=True)
    b.add_argument("options", nargs="*", help="recipe options as key=value, e.g. train_size=2048")
    b.set_defaults(func=cmd_data_build)
    c = data_sub.add_parser(
        "convert", help="convert JSONL + media, Parquet (verl/EasyR1 columns) or a save_to_disk "
                        "folder into webdataset shards")
    c.add_argument("--from", dest="source_format", required=True, choices=["jsonl", "parquet", "hf"])
    c.add_argument("--src", required=True, help="source file or folder")
    c.add_argument("--out", required=True, help="output folder for the shards and dataset.json")
    c.add_argument("--shard-size-mb", type=float, default=64.0, help="target shard size (MB, default 64)")
    c.add_argument("--media-root", default=None,
                   help="folder that relative media paths start from (default: the source's folder)")
    c.add_argument("--split", default="train", help="shard name prefix (default: train; an hf "
                                                    "DatasetDict keeps its own split names)")
    c.add_argument("--limit", type=int, default=None, help="convert at most N source rows per split")
    c.add_argument("--allow-no-answer", action="store_true", help="keep rows without an answer")
    c.set_defaults(func=cmd_data_convert)
    i = data_sub.add_parser("inspect", help="counts, media sizes, answers, prompt lengths and bad "
                                            "samples of shards")
    i.add_argument("shards", nargs="+", help="shard files, brace patterns (DIR/train-{000000..000003}.tar) "
                                            "or a folder of .tar files")
    i.add_argument("--model", default=None, help="model folder whose tokenizer measures prompt lengths "
                                                 "(default: characters)")
    i.add_argument("--limit", type=int, default=None, help="look at the first N samples only")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.set_defaults(func=cmd_data_inspect)

    p = sub.add_parser("plugins", help="registered plugins")
    plug_sub = p.add_subparsers(dest="plugins_command", required=True)
    lst = plug_sub.add_parser("list", help="name, kind and origin of every registered plugin")
    lst.add_argument("--kind", default=None)
    lst.set_defaults(func=cmd_plugins_list)

    p = sub.add_parser("rewards", help="debug reward plugins on real samples")
    rew_sub = p.add_subparsers(dest="rewards_command", required=True)
    chk = rew_sub.add_parser(
        "check", help="score responses with one reward on samples from shards and print a table",
        description="Score responses with one reward on samples from shards. Without --responses, each "
                    "sample's own answer is scored as the response (a reference check: it should score "
                    "1) together with an empty response.")
    chk.add_argument("reward", help="registered name, module:function or path/to/file.py:function")
    chk.add_argument("--shards", nargs="+", required=True,
                     help="shard files, brace patterns or a folder of .tar files")
    chk.add_argument("--responses", default=None,
                     help='JSONL of {"key": ..., "response": ...}, or one response per line applied to '
                          'the samples in order')
    chk.add_argument("--limit", type=int, default=None,
                     help="score at most N samples/rows (default: all rows of --responses, else 16 samples)")
    chk.add_argument("--args", default=None,
                     help='reward arguments as a JSON object, e.g. \'{"first_word": true}\'')
    chk.add_argument("--timeout", type=float, default=30.0, help="seconds per reward call (default 30)")
    chk.set_defaults(func=cmd_rewards_check)
    return parser


def _stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` prints every thread's stack to the process's stderr: for a run or a
    server that hangs. Not where stderr has no file descriptor (a caller capturing it in Python)."""
    if not hasattr(signal, "SIGUSR1") or threading.current_thread() is not threading.main_thread():
        return
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    except (AttributeError, OSError, ValueError):  # no sys.__stderr__, or one without a fileno
        pass


def main(argv: Sequence[str] | None = None) -> int:
    # The hub is the user's: a hub id in model.path downloads when online. Offline runs set
    # HF_HUB_OFFLINE=1 themselves (the Makefile's demo and the tests do).
    _stacks_on_sigusr1()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse gives a trailing nargs="*" positional nothing once an option sits between it
        # and the positional before it (`data build NAME --out DIR k=v`, `train CONFIG --dry-run
        # k=v`): collect those here, for every command that takes key=value pairs.
        trailing = "options" if getattr(args, "func", None) is cmd_data_build else (
            "overrides" if isinstance(getattr(args, "overrides", None), list) else None)
        if trailing and all("=" in e and not e.startswith("-") for e in extra):
            setattr(args, trailing, list(getattr(args, trailing)) + extra)
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from mmrl.config.load import ConfigError
    from mmrl.registry import PluginError

    user_errors: tuple[type[BaseException], ...] = (ConfigError, PluginError, FileNotFoundError)
    try:
        return args.func(args)
    except user_errors as e:
        print("mmrl: error: " + textwrap.fill(str(e), width=100, subsequent_indent="  "), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
