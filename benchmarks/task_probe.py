"""Can the tiny model learn a recipe's task at all? A supervised probe for any one-word-answer task.

    .venv/bin/python benchmarks/task_probe.py --data work/data/counting [--model work/tiny-vlm]
        [--steps 400] [--eval-every 50] [--out benchmarks/results/task_probe_counting.json]

RL can fail for two different reasons: the model (its size, its pixel budget) cannot represent the
task, or the RL signal does not find it. This probe removes RL from the question, like
`video_probe.py` does for the video task but for any recipe whose answer is one word (colours,
counting, multi_image, video_motion): plain cross-entropy on the answer token, through the same
decode -> processor -> collate -> model path that training uses. If the probe also stays at chance,
a config change of the RL side cannot help; grow the model (`mmrl tiny-model --hidden-size ...
--vision-depth ...`) or the pixel budget instead.

The answer words are the distinct answers of the train split; each must be one token. Accuracy is
the argmax over those words (`acc4` in the JSON, named after the video probe's four directions),
and over the full vocabulary (`acc_vocab`). Writes `--out` (JSON) and `.txt` (the log). One CPU thread.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from video_probe import REPO, load_split, train_probe  # noqa: E402


def main() -> None:
    from mmrl.processors import build_processor
    from mmrl.utils.paths import repo_relative

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="a recipe's output folder (mmrl data build RECIPE --out DIR)")
    ap.add_argument("--model", default=str(REPO / "work" / "tiny-vlm"))
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-train", type=int, default=2048, help="train samples loaded (the probe cycles over them)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/task_probe_<data folder>.json")
    args = ap.parse_args()
    torch.set_num_threads(1)

    data = Path(args.data)
    info = json.loads((data / "dataset.json").read_text())
    out = Path(args.out or REPO / "benchmarks" / "results" / f"task_probe_{data.name}.json")
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    t_start = time.time()
    processor = build_processor("auto", args.model)
    train_s = load_split(data, info, "train", processor)[: args.max_train]
    heldout_s = load_split(data, info, "heldout", processor)
    words = sorted({s.answer for s in train_s} | {s.answer for s in heldout_s})
    token = {}
    for w in words:
        ids = processor.tokenizer(w, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise SystemExit(f"answer {w!r} is {len(ids)} tokens in {args.model}; the probe needs one-token answers "
                             f"(build the model with `mmrl tiny-model --words ...` listing them)")
        token[w] = ids[0]
    answer_ids = [token[w] for w in words]

    def prepared(samples: list) -> tuple[list, torch.Tensor]:
        return [processor(s) for s in samples], torch.tensor([words.index(s.answer) for s in samples])

    train, heldout = prepared(train_s), prepared(heldout_s)
    counts = torch.bincount(heldout[1], minlength=len(words))
    majority = float(counts.max()) / len(heldout_s)
    log(f"recipe {info.get('recipe')}  model {repo_relative(Path(args.model), REPO)}  {len(train_s)} train / "
        f"{len(heldout_s)} held-out  words {words}  prompt tokens {len(train[0][0].prompt_ids)}  "
        f"majority-class held-out accuracy {majority:.3f}")
    r = train_probe(Path(args.model), train, {"heldout": heldout}, answer_ids, processor.pad_token_id,
                    steps=args.steps, eval_every=args.eval_every, batch=args.batch, lr=args.lr, seed=args.seed, log=log)
    doc = {"args": {**vars(args), "out": repo_relative(out, REPO)}, "recipe": info.get("recipe"), "words": words,
           "majority_accuracy": majority, "prompt_tokens": len(train[0][0].prompt_ids), **r,
           "total_s": round(time.time() - t_start, 1)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".txt").write_text(
        f"$ .venv/bin/python benchmarks/task_probe.py {' '.join(sys.argv[1:])}\n" + "\n".join(lines) + "\n")
    print(f"wrote {repo_relative(out, REPO)}; best held-out accuracy {r['best_heldout_acc4']:.3f} (majority {majority:.3f})")


if __name__ == "__main__":
    main()
