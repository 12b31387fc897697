"""RL on the colours task through the Tinker API: the official `tinker` SDK, pointed at `mmrl serve`.

Nothing here imports mmrl: the same loop runs against any Tinker backend that serves the model.
  mmrl serve configs/colors_demo.yaml serve.lora_projector=true --port 8000 &   # MMRL_API_KEYS=tml-... set
  TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... \\
      python examples/tinker_colors_rl.py --model work/tiny-vlm --data work/data/colors
Each step samples a group of answers per image, scores them (the shape's colour, plus 0.1 for any
colour word), normalises the rewards per group (GRPO) and trains the LoRA with `importance_sampling`.
"""
from __future__ import annotations

import argparse
import io
import json
import random
import time
from pathlib import Path

import numpy as np
import tinker
import webdataset as wds
from PIL import Image
from tinker import types
from transformers import AutoProcessor

COLOURS = ("red", "green", "blue", "yellow", "purple", "orange")


def load_samples(shards: list[Path]) -> list[dict]:
    """Each sample: its PNG bytes and its json's prompt and answer (the colours recipe's fields)."""
    return [{"image": s["png"], **json.loads(s["json"])} for s in wds.WebDataset([str(p) for p in shards],
                                                                                 shardshuffle=False)]


class Renderer:
    """Qwen-VL chat prompts as Tinker chunks: text up to <|vision_start|>, the image, the rest."""

    def __init__(self, model: str):
        self.processor = AutoProcessor.from_pretrained(model)
        self.tokenizer = self.processor.tokenizer
        self.pad = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def prompt(self, sample: dict) -> tuple[types.ModelInput, list[int]]:
        """The prompt's ModelInput and its token ids as the model sees them (image pads expanded)."""
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": sample["prompt"]}]}]
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        before, after = text.split("<|image_pad|>")
        pre, post = (self.tokenizer.encode(t, add_special_tokens=False) for t in (before, after))
        width, height = Image.open(io.BytesIO(sample["image"])).size
        ip = self.processor.image_processor
        n = ip.get_number_of_image_patches(height, width, {}) // ip.merge_size ** 2
        image = types.ImageChunk(data=sample["image"], format="png", expected_tokens=n)
        chunks = [types.EncodedTextChunk(tokens=pre), image, types.EncodedTextChunk(tokens=post)]
        return types.ModelInput(chunks=chunks), pre + [self.pad] * n + post

    def answer(self, tokens: list[int]) -> str:
        words = self.tokenizer.decode(tokens, skip_special_tokens=True).strip().lower().split()
        return words[0].strip(".,!") if words else ""


def reward(word: str, truth: str) -> float:
    return float(word == truth) + 0.1 * float(word in COLOURS)


def datum(prompt: types.ModelInput, prompt_ids: list[int], seq, advantage: float) -> types.Datum:
    """Inputs and targets shifted by one; the loss sees only the sampled tokens."""
    ids = prompt_ids + list(seq.tokens)
    n_prompt = len(prompt_ids) - 1
    chunks = list(prompt.chunks) + [types.EncodedTextChunk(tokens=list(seq.tokens[:-1]))]
    zeros = [0.0] * n_prompt
    return types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs={
        "target_tokens": np.array(ids[1:], dtype=np.int64),
        "logprobs": np.array(zeros + list(seq.logprobs), dtype=np.float32),
        "advantages": np.array(zeros + [advantage] * len(seq.tokens), dtype=np.float32)})


def accuracy(sampler, renderer: Renderer, samples: list[dict], max_tokens: int) -> float:
    greedy = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    futures = [sampler.sample(renderer.prompt(s)[0], 1, greedy) for s in samples]
    return float(np.mean([renderer.answer(f.result().sequences[0].tokens) == s["answer"]
                          for f, s in zip(futures, samples)]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the served base model (a local folder: the tokenizer loads from it)")
    ap.add_argument("--data", required=True, help="folder with train-*.tar and heldout-000000.tar")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--entropy-bonus", type=float, default=0.05, help="weight of each sample's surprisal in its reward")
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--stop-at", type=float, default=0.95, help="stop once held-out accuracy reaches this")
    ap.add_argument("--log", type=Path, help="write one JSON line per step here")
    args = ap.parse_args()

    rng = random.Random(0)
    train = load_samples(sorted(Path(args.data).glob("train-*.tar")))
    heldout = load_samples([Path(args.data) / "heldout-000000.tar"])[:args.eval_prompts]
    renderer = Renderer(args.model)
    training = tinker.ServiceClient().create_lora_training_client(base_model=args.model, rank=args.rank, seed=0).result()
    log = args.log.open("w", buffering=1) if args.log else None  # line-buffered: one row per step, at once
    sampler = training.save_weights_and_get_sampling_client().result()
    for step in range(1, args.steps + 1):
        batch = rng.sample(train, args.prompts)
        prompts = [renderer.prompt(s) for s in batch]
        params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
        t0 = time.perf_counter()
        futures = [sampler.sample(p, args.group, params) for p, _ in prompts]
        data, rewards, seconds = [], [], {}
        for (prompt, ids), sample, fut in zip(prompts, batch, futures):
            seqs = fut.result().sequences
            scores = np.array([reward(renderer.answer(s.tokens), sample["answer"]) for s in seqs])
            rewards += list(scores)
            # surprisal (-log q) as an entropy bonus: without it the policy locks onto one colour early
            surprisal = np.array([-sum(s.logprobs) for s in seqs])
            advantages = ((scores - scores.mean()) / (scores.std() + 1e-4)  # GRPO's group normalisation
                          + args.entropy_bonus * (surprisal - surprisal.mean()))
            data += [datum(prompt, ids, s, float(a)) for s, a in zip(seqs, advantages) if a != 0]
        seconds["sample"] = time.perf_counter() - t0  # all groups, submitted at once
        row = {"step": step, "reward_mean": float(np.mean(rewards))}
        if data:  # every group scored alike: nothing to learn from this batch
            t0 = time.perf_counter()
            fb = training.forward_backward(data, "importance_sampling")
            lr = args.lr * (1 - (step - 1) / args.steps)  # decays linearly: a constant rate undid the gains
            optim = training.optim_step(types.AdamParams(learning_rate=lr))  # queued behind forward_backward
            row["loss_sum"] = fb.result().metrics["loss:sum"]
            seconds["forward_backward"] = time.perf_counter() - t0
            optim.result()
            seconds["optim_step"] = time.perf_counter() - t0 - seconds["forward_backward"]
        t0 = time.perf_counter()
        sampler = training.save_weights_and_get_sampling_client().result()
        seconds["save_weights_for_sampler"] = time.perf_counter() - t0
        row["seconds"] = seconds  # per call: the benchmark's latency table
        if step % args.eval_every == 0 or step == args.steps:
            row["heldout_accuracy"] = accuracy(sampler, renderer, heldout, args.max_tokens)
        print(json.dumps(row), flush=True)
        if log:
            log.write(json.dumps(row) + "\n")
        if row.get("heldout_accuracy", 0.0) >= args.stop_at:
            break


if __name__ == "__main__":
    main()
