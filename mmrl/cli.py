"""The `mmrl` command line: train, tiny-model, data build/convert/inspect, plugins list."""
from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
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


def cmd_train(args: argparse.Namespace) -> int:
    from mmrl.config import load_config, to_yaml

    cfg = load_config(args.config, args.overrides)
    if args.dry_run:
        from mmrl.controller.placement import format_plan, placement_plan
        from mmrl.utils.env import resolve_device

        device = resolve_device(cfg.cluster.device.value)
        print("# resolved config\n" + to_yaml(cfg))
        print(f"# placement (device: {device})\n" + format_plan(placement_plan(cfg, device)))
        return 0
    import signal

    from mmrl.controller.loop import train

    # SIGTERM (a scheduler's kill) unwinds like Ctrl-C, so the engines shut down cleanly and
    # release their shared memory.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    summary = train(cfg)
    curve = summary.pop("heldout_curve", [])
    print("held-out accuracy by step: " + ", ".join(f"{s}:{a:.3f}" for s, a, _ in curve))
    print(json.dumps(summary, indent=2, default=str))
    return 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from mmrl.models.tiny_vlm import DEFAULT_WORDS, build_tiny_vlm

    words = args.words.split(",") if args.words else DEFAULT_WORDS
    path = build_tiny_vlm(args.arch, args.out, words=words, seed=args.seed, dtype=args.dtype)
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
    from mmrl.data.convert import convert, format_report

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmrl", description="Multimodal RL post-training.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train from a YAML config, with key=value overrides")
    p.add_argument("config", help="YAML config file, e.g. configs/colors_demo.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.group_size=8 trainer.lr=1e-3")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and the process placement")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("tiny-model", help="build a tiny random VLM (tokenizer + processor) locally")
    p.add_argument("--arch", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--words", default=None, help="comma-separated answer words kept as single tokens")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse gives a trailing nargs="*" positional nothing once an option sits between it
        # and the positional before it (`data build NAME --out DIR k=v`): collect those here.
        if getattr(args, "func", None) is cmd_data_build and all(
                "=" in e and not e.startswith("-") for e in extra):
            args.options = list(args.options) + extra
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
