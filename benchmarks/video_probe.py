"""Can the tiny random Qwen2.5-VL see motion at all? A supervised probe of the video task.

    .venv/bin/python benchmarks/video_probe.py [--steps 600] [--eval-every 50] [--out benchmarks/results/video_probe.json]

RL on `video_motion` (which way does the shape move: left / right / up / down) stayed at chance
(0.25 held-out) for 300+ steps. This probe removes RL from the question: it trains the same model
with plain cross-entropy on the answer token, through the same data and model path as training:

  shards (`mmrl data build video_motion`)
  -> `mmrl.data.stream.load_all` with `DecodeOptions.from_config(DecodeConfig(), processor.media_limits)`
     (the default `data.decode` section: fps=2, so an 8-frame 4 fps clip gives 4 frames)
  -> `build_processor("auto", model)` and one processor call per sample (`ProcessedPrompt`)
  -> `TrainSequence.from_prompt` + `trainer.batch.collate` -> `model(**micro_batch.model_inputs())`
  -> `AutoModelForImageTextToText.from_pretrained(model, dtype=float32)`, as the trainer loads it.

Only the loss differs: cross-entropy of the answer token (Adam, full fine-tuning). Every condition
starts from the same weights and sees the same batches. Conditions:

  main              the decoded clips, true labels
  reversed_flipped  each clip reversed in time, label flipped (left<->right, up<->down): the same
                    task, so it must be as learnable as `main` if the model sees frame order
  shuffled          each clip's frames in a fixed random order, true labels: order is gone, the
                    path's axis is not -> an order-blind ceiling of 0.5 (axis known, sign a coin)
  first_frame       every frame replaced by the clip's first frame: no motion at all. NOT a 0.25
                    ceiling: the recipe starts a left-moving shape in the right half of its room
                    (travel >= half the room), so the first position alone predicts some of the
                    label; `static_ceiling` estimates that (k-NN on the first-frame centre)
  image_pair        first and last frame as two images of one prompt (no video path): separates
                    "cannot see motion" from "the video path (temporal patches) loses it"
  frames8           decode with num_frames=8 (4 temporal patches instead of 2)
  frames2           decode with num_frames=2: the first and last frame in ONE temporal patch, so
                    the vision tower's 3-D patch embedding sees both ends of the path in one
                    patch (motion becomes a local, linear feature instead of a relation between
                    two tokens)
  colour            positive control: the same clips, answer = the shape's colour (6 words): does
                    the probe learn a static visual property through the same video path?

`main`, `frames8` and `frames2` are also scored on the held-out clips reversed in time with the TRUE label
(`heldout_reversed`): a model that reads order gets those wrong (~0 accuracy, axis still right).

Also checks, on held-out samples, that frame order survives decode -> processor: the processor's
`pixel_values_videos` are un-patchified back to frames, de-normalised, and each frame t is matched
against every decoded frame (resized to the processor's size): the best match must be t.

Writes `--out` (JSON) and the same path with `.txt` (a table of the curves). One CPU thread.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DIRECTIONS = ("left", "right", "up", "down")
OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}
AXIS = {"left": 0, "right": 0, "up": 1, "down": 1}
CONDITIONS = ("main", "reversed_flipped", "shuffled", "first_frame", "image_pair", "frames8", "frames2", "colour")
# conditions that decode another number of frames (data.decode.num_frames) than the default
DECODED_FRAMES = {"frames8": 8, "frames2": 2}
# the answer words of a condition (argmax over these); the direction conditions use DIRECTIONS
COLOURS = ("red", "green", "blue", "yellow", "purple", "orange")
WORDS = {"colour": COLOURS}


# ------------------------------------------------------------------------------------ set-up

def ensure_model(path: Path, fallback: Path) -> Path:
    """The tiny model at `path` if its words hold the four directions as single tokens, else one
    built (once) at `fallback` with `--words` listing them."""
    for cand in (path, fallback):
        info = cand / "mmrl_tiny.json"
        if info.exists() and set(DIRECTIONS + COLOURS) <= set(json.loads(info.read_text()).get("words", [])):
            return cand
    subprocess.run([sys.executable, "-m", "mmrl.cli", "tiny-model", "--arch", "qwen2_5_vl", "--out", str(fallback),
                    "--words", ",".join(DIRECTIONS + COLOURS)], check=True, cwd=REPO)
    return fallback


def ensure_data(out: Path, train_size: int, heldout_size: int, seed: int) -> dict[str, Any]:
    """video_motion shards in `out`, built unless a build with these sizes and seed is there."""
    manifest = out / "dataset.json"
    if manifest.exists():
        info = json.loads(manifest.read_text())
        a = info.get("args", {})
        if (info.get("recipe"), a.get("train_size"), a.get("heldout_size"), a.get("seed")) == \
                ("video_motion", train_size, heldout_size, seed):
            return info
    from mmrl.plugins.data.recipes.video_motion import build

    return build(str(out), train_size=train_size, heldout_size=heldout_size, shard_size=256, seed=seed)


def shard_urls(data: Path, info: dict[str, Any], split: str) -> list[str]:
    return [str(data / f"{split}-{i:06d}.tar") for i in range(info["num_shards"][split])]


def load_split(data: Path, info: dict[str, Any], split: str, processor: Any, **decode_overrides: Any) -> list[Any]:
    """Samples as training decodes them: the default `data.decode` config (plus overrides)."""
    from mmrl.config.schema import DecodeConfig
    from mmrl.data.decode import DecodeOptions
    from mmrl.data.stream import load_all

    decode = DecodeOptions.from_config(DecodeConfig(**decode_overrides), getattr(processor, "media_limits", None))
    return load_all(shard_urls(data, info, split), decode=decode)


# ------------------------------------------------------------------------------ conditions

def with_frames(sample: Any, frames: np.ndarray) -> Any:
    video = dataclasses.replace(sample.videos[0], frames=np.ascontiguousarray(frames))
    return dataclasses.replace(sample, videos=[video])


def transform(condition: str, sample: Any, seed: int) -> tuple[Any, str]:
    """(sample as the condition shows it, its label)."""
    from PIL import Image

    from mmrl.data.sample import messages_from_prompt

    frames, label = sample.videos[0].frames, sample.answer
    if condition == "main" or condition in DECODED_FRAMES:
        return sample, label
    if condition == "colour":
        return sample, sample.metadata["colour"]
    if condition == "reversed_flipped":
        return with_frames(sample, frames[::-1]), OPPOSITE[label]
    if condition == "reversed_true_label":
        return with_frames(sample, frames[::-1]), label
    if condition == "shuffled":
        rng = np.random.default_rng([seed, int(sample.metadata["index"]), 0x5F])
        return with_frames(sample, frames[rng.permutation(len(frames))]), label
    if condition == "first_frame":
        return with_frames(sample, np.repeat(frames[:1], len(frames), axis=0)), label
    if condition == "image_pair":
        text = sample.prompt_text
        return dataclasses.replace(sample, messages=messages_from_prompt(text, n_images=2), videos=[],
                                   images=[Image.fromarray(frames[0]), Image.fromarray(frames[-1])]), label
    raise ValueError(f"unknown condition {condition!r}")


def static_ceiling(train: list[Any], heldout: list[Any], k: int = 15) -> dict[str, float]:
    """Held-out accuracy of a k-NN on what an order-blind or motion-blind model could use, from the
    recipe's metadata (shape centres): the first-frame centre, and the unordered end points."""
    def feats(samples: list[Any], kind: str) -> np.ndarray:
        rows = []
        for s in samples:
            c = np.asarray(s.metadata["centres"], np.float64)
            if kind == "first":
                rows.append(c[0])
            else:  # the set {first, last} without order: per-axis min and max
                rows.append(np.concatenate([np.minimum(c[0], c[-1]), np.maximum(c[0], c[-1])]))
        return np.stack(rows)

    ytr = np.array([DIRECTIONS.index(s.answer) for s in train])
    yte = np.array([DIRECTIONS.index(s.answer) for s in heldout])
    out = {}
    for kind in ("first", "unordered_endpoints"):
        a, b = feats(train, kind), feats(heldout, kind)
        d = ((b[:, None, :] - a[None, :, :]) ** 2).sum(-1)
        nn = np.argsort(d, axis=1)[:, :k]
        pred = np.array([np.bincount(ytr[row], minlength=4).argmax() for row in nn])
        out[kind] = float((pred == yte).mean())
    return out


# ------------------------------------------------------------------------------ frame order

def frame_order_check(processor: Any, sample: Any) -> dict[str, Any]:
    """Does frame t of the processor's pixel_values_videos show decoded frame t?

    The processor's frames are de-normalised back to 0..255 and compared with every decoded frame
    resized (bicubic) to the processor's size; returns the mean absolute difference matrix
    [processor frame][decoded frame], the best match per processor frame, and the number of frames.
    """
    import torch.nn.functional as F

    prompt = processor(sample)
    seen = processor.video_frames(prompt.mm_inputs)
    decoded = torch.from_numpy(np.asarray(sample.videos[0].frames)).permute(0, 3, 1, 2).float()
    ref = F.interpolate(decoded, size=seen.shape[-2:], mode="bicubic", align_corners=False, antialias=True)
    n = decoded.shape[0]
    diff = (seen[:n, None] - ref[None]).abs().mean(dim=(2, 3, 4))  # (processor frame, decoded frame)
    return {"frames_decoded": n, "frames_processed": int(seen.shape[0]),
            "grid_thw": [int(x) for x in prompt.mm_inputs["video_grid_thw"][0]],
            "second_per_grid_ts": [float(x) for x in prompt.mm_inputs.get("second_per_grid_ts", torch.zeros(0))],
            "mad": diff.tolist(), "best_match": diff.argmin(dim=1).tolist(),
            "diagonal_mad_max": float(diff.diagonal().max()),
            "off_diagonal_mad_min": float((diff + torch.eye(n) * 1e9).min()) if n > 1 else None}


def temporal_positions(processor: Any, sample: Any) -> list[int]:
    """The distinct M-RoPE temporal positions of the prompt's video tokens (relative to the first)."""
    prompt = processor(sample)
    ids = torch.tensor(prompt.prompt_ids)
    t = prompt.positions_AP[0][ids == processor.video_token_id]
    return sorted({int(x - t.min()) for x in t})


# ------------------------------------------------------------------------------------ probe

def process_all(processor: Any, samples: list[Any], condition: str, seed: int) -> tuple[list[Any], torch.Tensor]:
    words = WORDS.get(condition, DIRECTIONS)
    prompts, labels = [], []
    for s in samples:
        shown, label = transform(condition, s, seed)
        prompts.append(processor(shown))
        labels.append(words.index(label))
    return prompts, torch.tensor(labels)


def batch_logits(model: Any, prompts: list[Any], answer_ids: list[int], pad_id: int,
                 train_labels: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) logits of the answer position, through the trainer's collate and model inputs.
    The response is the answer token (`train_labels`) or, in evaluation, any one (it is not seen:
    logits at column P-1 predict response token 0)."""
    from mmrl.trainer.batch import TrainSequence, collate

    responses = train_labels.tolist() if train_labels is not None else [0] * len(prompts)
    seqs = [TrainSequence.from_prompt(p, [answer_ids[y]], [0.0], [1]) for p, y in zip(prompts, responses)]
    mb = collate(seqs, pad_id)
    return model(**mb.model_inputs()).logits[:, 0, :].float()


@torch.no_grad()
def evaluate(model: Any, prompts: list[Any], labels: torch.Tensor, answer_ids: list[int], pad_id: int,
             batch: int = 64) -> dict[str, float]:
    model.eval()
    logits = torch.cat([batch_logits(model, prompts[i:i + batch], answer_ids, pad_id)
                        for i in range(0, len(prompts), batch)])
    model.train()
    four = logits[:, answer_ids].argmax(-1)  # argmax over the condition's answer words (4 directions)
    full = logits.argmax(-1)
    ids = torch.tensor(answer_ids)
    loss = torch.nn.functional.cross_entropy(logits, ids[labels]).item()
    out = {"acc4": float((four == labels).float().mean()), "acc_vocab": float((full == ids[labels]).float().mean()),
           "loss": loss, "pred_counts": torch.bincount(four, minlength=len(answer_ids)).tolist()}
    if len(answer_ids) == len(DIRECTIONS):  # same or other axis (horizontal / vertical)
        axis = torch.tensor([AXIS[d] for d in DIRECTIONS])
        out["axis_acc"] = float((axis[four] == axis[labels]).float().mean())
    return out


def train_probe(model_path: Path, train: tuple[list[Any], torch.Tensor], evals: dict[str, tuple[list[Any], torch.Tensor]],
                answer_ids: list[int], pad_id: int, *, steps: int, eval_every: int, batch: int, lr: float,
                seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_pretrained(str(model_path), dtype=torch.float32)
    model.config.use_cache = False
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    prompts, labels = train
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor(answer_ids)
    curve: list[dict[str, Any]] = []
    losses: list[float] = []
    t0 = time.time()

    def record(step: int) -> None:
        row: dict[str, Any] = {"step": step, "train_loss": float(np.mean(losses)) if losses else None,
                               "wall_s": round(time.time() - t0, 1)}
        for name, (p, y) in evals.items():
            row[name] = evaluate(model, p, y, answer_ids, pad_id)
        curve.append(row)
        losses.clear()
        log("  step %4d  loss %s  " % (step, "%.3f" % row["train_loss"] if row["train_loss"] is not None else "  -  ")
            + "  ".join(f"{n}: acc4 {r['acc4']:.3f} vocab {r['acc_vocab']:.3f} axis {r.get('axis_acc', float('nan')):.3f}"
                        for n, r in row.items() if isinstance(r, dict)))

    record(0)
    for step in range(1, steps + 1):
        idx = torch.randint(len(prompts), (batch,), generator=gen)
        y = labels[idx]
        logits = batch_logits(model, [prompts[i] for i in idx.tolist()], answer_ids, pad_id, train_labels=y)
        loss = torch.nn.functional.cross_entropy(logits, ids[y])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % eval_every == 0 or step == steps:
            record(step)
    return {"curve": curve, "train_s": round(time.time() - t0, 1),
            "final": {k: v for k, v in curve[-1].items() if isinstance(v, dict)},
            "best_heldout_acc4": max(r["heldout"]["acc4"] for r in curve)}


def main() -> None:
    from mmrl.utils.paths import repo_relative

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(REPO / "work" / "tiny-vlm"))
    ap.add_argument("--fallback-model", default="/tmp/mmrl-video-probe-tiny-vlm",
                    help="built here when --model lacks the direction words")
    ap.add_argument("--data", default=str(REPO / "work" / "data" / "video_probe"))
    ap.add_argument("--train-size", type=int, default=1024)
    ap.add_argument("--heldout-size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=CONDITIONS)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "video_probe.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)

    from mmrl.processors import build_processor

    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    t_start = time.time()
    model_path = ensure_model(Path(args.model), Path(args.fallback_model))
    data = Path(args.data)
    info = ensure_data(data, args.train_size, args.heldout_size, args.seed)
    processor = build_processor("auto", str(model_path))  # as the run builds it (processor.name=auto)
    tok = processor.tokenizer
    token = {}
    for w in DIRECTIONS + COLOURS:
        ids = tok(w, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise SystemExit(f"{w!r} is {len(ids)} tokens in {model_path}; the probe needs one token per answer word")
        token[w] = ids[0]
    pad_id = processor.pad_token_id
    log(f"model {repo_relative(model_path, REPO)}  data {repo_relative(data, REPO)}  answer ids {token}")

    splits = {"train": load_split(data, info, "train", processor), "heldout": load_split(data, info, "heldout", processor)}
    v0 = splits["heldout"][0].videos[0]
    clip = {"recipe_frames": info["args"]["frames"], "recipe_fps": info["args"]["fps"],
            "decoded_frames": int(len(v0.frames)), "decoded_frame_indices": list(v0.frame_indices),
            "decoded_fps": v0.fps, "decoded_size": list(v0.frames.shape[1:3]), "decoder": v0.backend,
            "temporal_patch_size": int(processor.hf.video_processor.temporal_patch_size),
            "tokens_per_second": float(getattr(processor.config.vision_config, "tokens_per_second", 0)),
            "video_tokens": int(sum(t == processor.video_token_id for t in processor(splits["heldout"][0]).prompt_ids)),
            "temporal_positions_of_video_tokens": temporal_positions(processor, splits["heldout"][0])}
    log(f"clip: {clip}")

    # frame order: decode -> processor, on every held-out sample
    checks = [frame_order_check(processor, s) for s in splits["heldout"]]
    order = {"samples": len(checks),
             "all_best_match_diagonal": all(c["best_match"] == list(range(c["frames_decoded"])) for c in checks),
             "diagonal_mad_max": max(c["diagonal_mad_max"] for c in checks),
             "off_diagonal_mad_min": min(c["off_diagonal_mad_min"] for c in checks),
             "example": checks[0]}
    log(f"frame order decode->processor: best match diagonal on all {len(checks)} held-out clips: "
        f"{order['all_best_match_diagonal']}; mean |diff| same frame <= {order['diagonal_mad_max']:.2f}/255, "
        f"other frames >= {order['off_diagonal_mad_min']:.2f}/255")

    ceilings = static_ceiling(splits["train"], splits["heldout"])
    ceilings["order_blind_theory"] = 0.5
    log(f"k-NN on metadata centres (held-out acc): first-frame centre {ceilings['first']:.3f}, "
        f"unordered end points {ceilings['unordered_endpoints']:.3f}")

    results: dict[str, Any] = {}
    for cond in args.conditions:
        log(f"== {cond}")
        t0 = time.time()
        if cond in DECODED_FRAMES:
            n = DECODED_FRAMES[cond]
            tr_s = load_split(data, info, "train", processor, num_frames=n, min_frames=min(n, 4))
            he_s = load_split(data, info, "heldout", processor, num_frames=n, min_frames=min(n, 4))
        else:
            tr_s, he_s = splits["train"], splits["heldout"]
        train = process_all(processor, tr_s, cond, args.seed)
        evals = {"heldout": process_all(processor, he_s, cond, args.seed)}
        if cond == "main" or cond in DECODED_FRAMES:
            evals["heldout_reversed"] = process_all(processor, he_s, "reversed_true_label", args.seed)
        prep_s = time.time() - t0
        answer_ids = [token[w] for w in WORDS.get(cond, DIRECTIONS)]
        r = train_probe(model_path, train, evals, answer_ids, pad_id, steps=args.steps, eval_every=args.eval_every,
                        batch=args.batch, lr=args.lr, seed=args.seed, log=log)
        r["prep_s"] = round(prep_s, 1)
        r["prompt_tokens"] = len(train[0][0].prompt_ids)
        r["mm_shapes"] = {k: list(v.shape) for k, v in train[0][0].mm_inputs.items()}
        results[cond] = r

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"args": {**vars(args), "model": repo_relative(model_path, REPO), "data": repo_relative(data, REPO),
                    "out": repo_relative(out, REPO), "fallback_model": args.fallback_model},
           "torch_threads": torch.get_num_threads(), "clip": clip, "frame_order": order,
           "static_ceilings": ceilings, "conditions": results, "total_s": round(time.time() - t_start, 1)}
    out.write_text(json.dumps(doc, indent=1) + "\n")

    table = ["", "held-out acc4 (argmax over the 4 direction tokens) / acc over the full vocab, per step:"]
    for cond, r in results.items():
        for name in r["curve"][0]:
            if name in ("step", "train_loss", "wall_s"):
                continue
            table.append(f"{cond:17s} {name:17s} " + " ".join(
                f"{row['step']}:{row[name]['acc4']:.2f}/{row[name]['acc_vocab']:.2f}" for row in r["curve"]))
    for line in table:
        log(line)
    out.with_suffix(".txt").write_text(
        f"$ .venv/bin/python benchmarks/video_probe.py {' '.join(sys.argv[1:])}\n" + "\n".join(lines) + "\n")
    print(f"wrote {repo_relative(out, REPO)} and {repo_relative(out.with_suffix('.txt'), REPO)}")


if __name__ == "__main__":
    main()
