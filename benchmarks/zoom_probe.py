"""Is zoom_read's answer turn learnable, and how fast? Probes of the second turn alone.

    .venv/bin/python benchmarks/zoom_probe.py [--steps 250] [--arms supervised grpo grpo_no_entropy]

RL on configs/zoom_read.yaml learns WHERE to zoom (on target ~97% by step 120) long before it
reads the colour of the zoomed cell. These probes take the zoom as given (the right cell) and
train only the answer token, so the question "can the tiny model read it through this context,
and how many steps does GRPO need" is answered in minutes instead of a training run:

  each sample's episode is built by the real multi_turn loop of the config (a scripted engine
  writes the right cell, then the answer), laid on the trainer's tokens by the processor
  (`expand_traced`: M-RoPE positions, both images' vision tensors), and the model is the one the
  config trains (`model.path`, loaded as the trainer loads it, fp32). Arms, from the same weights:

  supervised        cross-entropy on the answer word (batch 16 contexts)
  grpo              16 contexts x 16 answers sampled from the policy, the config's reward for the
                    answer turn (1 for the right colour, + word credit for any colour word, any
                    casing or leading space), group-normalised advantages, the config's entropy
                    coefficient, Adam at the config's lr: the RL signal of the real run, without
                    the first turn
  grpo_no_entropy   the same with entropy coefficient 0

Held-out accuracy is the greedy answer (argmax over the whole vocabulary) read as a colour word.
One CPU thread; writes --out (JSON) and prints the curves.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ARMS = ("supervised", "grpo", "grpo_no_entropy")


class Scripted:
    """An engine that writes given texts, one per turn (the tests' scripted client)."""

    def __init__(self, tokenizer: Any, texts: list[str]):
        self.tokenizer, self.texts = tokenizer, list(texts)

    async def generate(self, prompt: Any, sampling: Any) -> Any:
        from mmrl.rollout.types import Completion

        ids = self.tokenizer(self.texts.pop(0), add_special_tokens=False)["input_ids"][:sampling.max_tokens]
        return Completion(token_ids=ids, logprobs=[-1.0] * len(ids), text=self.tokenizer.decode(ids),
                          finish_reason="length")


def answer_context(processor: Any, sample: Any, loop_args: dict, words: list[str]) -> dict[str, Any]:
    """The trainer's inputs up to (not including) the answer token of the right-zoom episode."""
    from mmrl.rollout.agent_loops import AgentContext
    from mmrl.rollout.tool_loop import multi_turn
    from mmrl.rollout.types import RequestSampling

    prompt = processor(sample)
    ctx = AgentContext(client=Scripted(processor.tokenizer, [str(sample.metadata["cell"]), sample.answer]),
                       processor=processor, args=loop_args, sampling=RequestSampling(max_tokens=1))
    t = asyncio.run(multi_turn(ctx, sample, prompt))
    media = {k: list(v) if isinstance(v, (list, tuple)) else [v]
             for k, v in prompt.vllm_input["multi_modal_data"].items()}
    for k, items in t.new_media.items():
        media.setdefault(k, []).extend(items)
    full, _ = processor.expand_traced({"prompt_token_ids": list(prompt.vllm_input["prompt_token_ids"])
                                       + list(t.response_ids), "multi_modal_data": media})
    answer_id = processor.tokenizer.convert_tokens_to_ids(sample.answer)
    at = max(i for i, x in enumerate(full.prompt_ids) if x == answer_id)  # the answer turn's word
    return {"input_ids": torch.tensor(full.prompt_ids[:at])[None], "position_ids": full.position_ids_3P[:, None, :at],
            "mm": full.mm_inputs, "label": words.index(sample.answer)}


def word_tokens(tokenizer: Any, words: list[str]) -> dict[int, int]:
    """Single-token spellings of each answer word (as is, capitalised, after a space) -> word index:
    what `final_answer` accepts as that word."""
    out: dict[int, int] = {}
    for k, w in enumerate(words):
        for v in (w, w.capitalize(), " " + w, " " + w.capitalize()):
            ids = tokenizer(v, add_special_tokens=False)["input_ids"]
            if len(ids) == 1:
                out[ids[0]] = k
    return out


def run_arm(arm: str, model_dir: str, train: list, held: list, spellings: dict[int, int], cfg: dict,
            steps: int, eval_every: int, seed: int) -> list[list[float]]:
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=float(cfg["trainer"]["lr"]), betas=tuple(cfg["trainer"]["betas"]))
    entropy_coef = 0.0 if arm == "grpo_no_entropy" else float(cfg["algorithm"]["entropy_coef"])
    (answer_reward,) = [r for r in cfg["rewards"] if r["name"] == "final_answer"]
    word_credit = float(answer_reward.get("args", {}).get("word_credit", 0.0))
    label_token: dict[int, int] = {}
    for t, k in spellings.items():  # the supervised target: a word's first spelling (the word as is)
        label_token.setdefault(k, t)

    def last_logits(e: dict) -> torch.Tensor:
        out = model(input_ids=e["input_ids"], position_ids=e["position_ids"], use_cache=False, **e["mm"])
        return out.logits[0, -1]

    def accuracy() -> float:
        model.eval()
        with torch.no_grad():
            hits = [spellings.get(int(last_logits(e).argmax())) == e["label"] for e in held]
        model.train()
        return float(np.mean(hits))

    rng, curve, t0 = np.random.default_rng(seed), [], time.time()
    for step in range(steps + 1):
        if step % eval_every == 0 or step == steps:
            curve.append([step, accuracy(), time.time() - t0])
            print(f"  {arm:16s} step {step:4d}  held-out {curve[-1][1]:.3f}", flush=True)
        if step == steps:
            break
        loss = torch.zeros(())
        for i in rng.choice(len(train), 16, replace=False):
            e = train[i]
            logp = torch.log_softmax(last_logits(e), -1)
            if arm == "supervised":
                loss = loss - logp[label_token[e["label"]]] / 16
                continue
            answers = torch.multinomial(logp.exp().detach(), 16, replacement=True)
            rewards = torch.tensor([(1.0 if spellings.get(int(a)) == e["label"] else 0.0)
                                    + (word_credit if int(a) in spellings else 0.0) for a in answers])
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
            entropy = -(logp.exp() * logp).sum()
            loss = loss - (advantages * logp[answers]).mean() / 16 - entropy_coef * entropy / 16
        opt.zero_grad()
        loss.backward()
        opt.step()
    return curve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "zoom_read.yaml"))
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--train", type=int, default=512, help="training contexts (from the first train shard)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "zoom_probe.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)

    from mmrl.data.stream import load_all
    from mmrl.processors import build_processor

    cfg = yaml.safe_load(Path(args.config).read_text())
    model_dir = str(REPO / cfg["model"]["path"])
    shards = {k: str(REPO / cfg["data"][k]) for k in ("train_shards", "heldout_shards")}
    if not Path(model_dir, "config.json").exists() or not Path(shards["heldout_shards"]).exists():
        raise SystemExit(f"build the model and data first: the commands in the header of {args.config}")
    (answer_reward,) = [r for r in cfg["rewards"] if r["name"] == "final_answer"]
    words = list(answer_reward["args"]["words"])
    processor = build_processor("auto", model_dir, max_pixels=cfg["processor"]["max_pixels"])
    loop_args = cfg["rollout"]["agent_loop_args"]
    first_train = shards["train_shards"].replace("{000000..000003}", "000000")
    train = [answer_context(processor, s, loop_args, words) for s in load_all(first_train)[:args.train]]
    held = [answer_context(processor, s, loop_args, words) for s in load_all(shards["heldout_shards"])]
    spellings = word_tokens(processor.tokenizer, words)
    print(f"{len(train)} train / {len(held)} held-out contexts of {held[0]['input_ids'].shape[1]} tokens")
    results = {arm: run_arm(arm, model_dir, train, held, spellings, cfg, args.steps, args.eval_every, args.seed)
               for arm in args.arms}
    out = {"config": str(Path(args.config).relative_to(REPO)) if Path(args.config).is_relative_to(REPO)
           else args.config, "steps": args.steps, "seed": args.seed, "train_contexts": len(train),
           "heldout_contexts": len(held), "curves": results,
           "steps_to_0.9": {arm: next((s for s, a, _ in c if a >= 0.9), None) for arm, c in results.items()}}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out["steps_to_0.9"]))


if __name__ == "__main__":
    main()
