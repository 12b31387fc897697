"""TRL's GRPOTrainer on an mmrl task, for benchmarks/vs_trl.py (run with the TRL venv's Python).

The same model folder, shards, batch (prompts x group), max new tokens, reward (the config's
reward functions, called on the same decoded samples), lr, Adam betas, grad clip, clip range and
entropy bonus as the mmrl run it is compared with; plain HF `generate` (no vLLM), fp32, CPU,
one process. Held-out greedy accuracy is measured every --eval-every steps by a callback whose
time is left out of the training seconds (mmrl's eval is left out the same way). Writes one JSON
line per step to --out: step, wall (seconds since --t0, the launcher's clock), step_s (the step
itself: generation, rewards, loss, optimizer), train_s (the sum of step_s so far) and
heldout_accuracy where evaluated.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # mmrl from this checkout (readers, rewards)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--train-shards", required=True)
    ap.add_argument("--heldout-shards", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.99])
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--entropy-coef", type=float, default=0.1)
    ap.add_argument("--format-weight", type=float, default=0.1)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--t0", type=float, default=None, help="the launcher's start time (time.time())")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    t0 = args.t0 if args.t0 is not None else time.time()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mmrl.data.stream import load_all
    from mmrl.plugins.rewards.answer import first_word_in
    from mmrl.plugins.rewards.colour import palette, shape_colour

    words = list(palette())

    def reward(completions, images=None, **_) -> list[float]:
        """The demo's reward: shape_colour (weight 1) + first_word_in over the colours (weight 0.1)."""
        out = []
        for completion, imgs in zip(completions, images):
            text = completion[0]["content"] if isinstance(completion, list) else completion
            out.append(shape_colour(text, imgs)["score"] + args.format_weight * first_word_in(text, words=words))
        return out

    def rows(shards: str) -> list[dict]:
        # string content: TRL puts the image before the user's text, as the samples' own chat does
        return [{"prompt": [{"role": "user", "content": s.prompt_text}], "images": s.images} for s in load_all(shards)]

    train = Dataset.from_list(rows(args.train_shards))
    heldout = load_all(args.heldout_shards)
    processor = AutoProcessor.from_pretrained(args.model, padding_side="left")
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.float32)

    def accuracy() -> float:
        """Greedy held-out accuracy: the first word names the shape's colour (eval.threshold 1.0)."""
        model.eval()
        correct = 0
        with torch.no_grad():
            for i in range(0, len(heldout), 32):
                chunk = heldout[i:i + 32]
                texts = [processor.apply_chat_template(s.messages, add_generation_prompt=True, tokenize=False)
                         for s in chunk]
                enc = processor(text=texts, images=[s.images for s in chunk], return_tensors="pt", padding=True)
                out = model.generate(**enc, do_sample=False, max_new_tokens=args.max_new_tokens)
                for s, ids in zip(chunk, out[:, enc["input_ids"].shape[1]:]):
                    text = processor.tokenizer.decode(ids, skip_special_tokens=True)
                    correct += shape_colour(text, s.images)["score"] >= 1.0
        model.train()
        return correct / len(heldout)

    class Record(TrainerCallback):
        def __init__(self) -> None:
            self.train_s, self.step_start = 0.0, time.time()
            self.f = open(args.out, "w")

        def on_step_begin(self, targs, state, control, **kw):
            self.step_start = time.time()

        def on_step_end(self, targs, state, control, **kw):
            now = time.time()
            self.train_s += now - self.step_start  # generation, rewards, loss, optimizer: the step itself
            row = {"step": state.global_step, "wall": now - t0, "step_s": now - self.step_start,
                   "train_s": self.train_s}
            if state.global_step % args.eval_every == 0:
                row["heldout_accuracy"] = accuracy()
                if row["heldout_accuracy"] >= args.target:
                    control.should_training_stop = True
            self.f.write(json.dumps(row) + "\n")
            self.f.flush()

        def on_train_end(self, targs, state, control, **kw):
            self.f.close()

    record = Record()
    config = GRPOConfig(
        output_dir=str(Path(args.out).parent / "trl-output"), max_steps=args.steps, seed=args.seed,
        per_device_train_batch_size=args.prompts * args.group, gradient_accumulation_steps=1,
        num_generations=args.group, max_completion_length=args.max_new_tokens, temperature=1.0,
        learning_rate=args.lr, lr_scheduler_type="constant", adam_beta1=args.betas[0], adam_beta2=args.betas[1],
        weight_decay=0.0, max_grad_norm=args.grad_clip, beta=0.0, epsilon=args.clip,
        loss_type="dapo",  # token mean over the batch: mmrl's loss_agg token_mean
        scale_rewards="group",  # GRPO: (r - group mean) / group std
        entropy_coef=args.entropy_coef, gradient_checkpointing=False, bf16=False, use_cpu=True,
        logging_steps=1, save_strategy="no", report_to="none", dataloader_num_workers=0, disable_dropout=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=train,
                          processing_class=processor, callbacks=[record])
    record.f.write(json.dumps({"step": 0, "wall": time.time() - t0, "train_s": 0.0, "heldout_accuracy": accuracy()}) + "\n")
    trainer.train()


if __name__ == "__main__":
    main()
