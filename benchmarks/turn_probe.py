"""Is the last turn of a tool task learnable, and how fast? Probes of that turn alone.

    .venv/bin/python benchmarks/turn_probe.py --task zoom_read|gui_click [--steps 250] [--arms ...]

RL on a two-turn tool task learns the first action (where to zoom, which menu to open) long
before the second (the colour in the zoomed cell, the item in the open menu): the second turn
only exists, or only pays, once the first is right. These probes take the first turn as given
(the expert's action) and train only the last model token, so "can the tiny model do the second
step through this context, and how many GRPO steps does it need" is answered in minutes instead
of a training run:

  each sample's episode is built by the real multi_turn loop of the task's config (a scripted
  engine writes the expert's actions), laid on the trainer's tokens by the processor
  (`expand_traced`: M-RoPE positions, every image's vision tensors), and the model is the one the
  config trains (`model.path`, loaded as the trainer loads it, fp32). Arms, from the same weights:

  supervised        cross-entropy on the expert's token (batch 16 contexts)
  grpo              16 contexts x 16 tokens sampled from the policy, each scored by the config's
                    rewards on the episode the real loop makes of it (the expert's first turn,
                    then that token: the tool runs, the transcript and tool state are recorded;
                    cached per context and token), group-normalised advantages, the config's
                    entropy coefficient, Adam at the config's lr and betas
  grpo_no_entropy   the same with entropy coefficient 0

Held-out accuracy: the greedy token's episode (argmax over the whole vocabulary) reaches the
config's `eval.threshold`, as the training run's held-out evaluation counts it. gui_click's fixed layout has 9 tasks: its contexts are the 9, trained and scored alike.
One CPU thread; writes benchmarks/results/turn_probe_<task>.json and prints the curves.
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
TASKS = ("zoom_read", "gui_click")


def expert_texts(task: str, sample: Any) -> list[str]:
    """What the scripted engine writes per turn: the expert's actions (after the forced name)."""
    if task == "zoom_read":
        return [str(sample.metadata["cell"]), sample.answer]
    from mmrl.tools.gui import expert_actions, spec_from_sample

    return [str(a["mark"]) for _, a in expert_actions(spec_from_sample(sample), marks=True)]


class Episodes:
    """A task's contexts and the real episodes their last token makes: the config's loop with a
    scripted engine (`ScriptedClient`), scored by the config's rewards."""

    def __init__(self, task: str, cfg: dict, processor: Any):
        from mmrl.rewards.base import RewardSet

        self.task, self.processor, self.loop_args = task, processor, cfg["rollout"]["agent_loop_args"]
        self.rewards, self.threshold = RewardSet(cfg["rewards"]), float(cfg["eval"]["threshold"])
        self.cache: dict[tuple[int, int], tuple[float, bool]] = {}

    def run(self, sample: Any, prompt: Any, turns: list[Any]) -> Any:
        from mmrl.rollout.agent_loops import AgentContext, ScriptedClient
        from mmrl.rollout.tool_loop import multi_turn
        from mmrl.rollout.types import RequestSampling

        ctx = AgentContext(client=ScriptedClient(self.processor.tokenizer, turns), processor=self.processor,
                           args=self.loop_args, sampling=RequestSampling(max_tokens=1))
        return asyncio.run(multi_turn(ctx, sample, prompt))

    def context(self, index: int, sample: Any) -> dict[str, Any]:
        """The trainer's inputs up to (not including) the last model token of the expert's
        episode, and that token (the supervised target)."""
        prompt = self.processor(sample)
        texts = expert_texts(self.task, sample)
        t = self.run(sample, prompt, texts)
        media = {k: list(v) if isinstance(v, (list, tuple)) else [v]
                 for k, v in prompt.vllm_input["multi_modal_data"].items()}
        for k, items in t.new_media.items():
            media.setdefault(k, []).extend(items)
        full, _ = self.processor.expand_traced({"prompt_token_ids": list(prompt.vllm_input["prompt_token_ids"])
                                                + list(t.response_ids), "multi_modal_data": media})
        target = self.processor.tokenizer.convert_tokens_to_ids(texts[-1])
        at = max(i for i, x in enumerate(full.prompt_ids) if x == target)  # the last turn's token
        return {"index": index, "sample": sample, "prompt": prompt, "first_turns": texts[:-1], "target": target,
                "input_ids": torch.tensor(full.prompt_ids[:at])[None], "position_ids": full.positions_AP[:, None, :at],
                "mm": full.mm_inputs, "key": sample.prompt_text}

    def score(self, e: dict, token: int) -> tuple[float, bool]:
        """(the config's reward, success) of the episode whose last model token is `token`."""
        key = (e["index"], token)
        if key not in self.cache:
            t = self.run(e["sample"], e["prompt"], [*e["first_turns"], [token]])
            reward = self.rewards.score(e["sample"], t.text, t.response_ids,
                                        episode={"transcript": t.transcript, "tool_state": t.tool_state})["score"]
            self.cache[key] = (reward, reward >= self.threshold)
        return self.cache[key]


def run_arm(arm: str, model_dir: str, train: list, held: list, episodes: Episodes, cfg: dict,
            steps: int, eval_every: int, seed: int) -> list[list[float]]:
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=float(cfg["trainer"]["lr"]), betas=tuple(cfg["trainer"]["betas"]))
    entropy_coef = 0.0 if arm == "grpo_no_entropy" else float(cfg["algorithm"]["entropy_coef"])

    def last_logits(e: dict) -> torch.Tensor:
        out = model(input_ids=e["input_ids"], position_ids=e["position_ids"], use_cache=False, **e["mm"])
        return out.logits[0, -1]

    def accuracy() -> float:
        model.eval()
        with torch.no_grad():
            hits = [episodes.score(e, int(last_logits(e).argmax()))[1] for e in held]
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
        for i in rng.choice(len(train), 16, replace=len(train) < 16):
            e = train[i]
            logp = torch.log_softmax(last_logits(e), -1)
            if arm == "supervised":
                loss = loss - logp[e["target"]] / 16
                continue
            tokens = torch.multinomial(logp.exp().detach(), 16, replacement=True)
            rewards = torch.tensor([episodes.score(e, int(t))[0] for t in tokens])
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
            entropy = -(logp.exp() * logp).sum()
            loss = loss - (advantages * logp[tokens]).mean() / 16 - entropy_coef * entropy / 16
        opt.zero_grad()
        loss.backward()
        opt.step()
    return curve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=TASKS, default="zoom_read", help="configs/<task>.yaml is the config")
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--train", type=int, default=512, help="training samples (from the first train shard)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=None, help="a build of the recipe to use instead of the config's shards")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/turn_probe_<task>.json")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from mmrl.data.stream import load_all
    from mmrl.processors import build_processor

    config = REPO / "configs" / f"{args.task}.yaml"
    cfg = yaml.safe_load(config.read_text())
    model_dir = str(REPO / cfg["model"]["path"])
    shards = {k: str(REPO / cfg["data"][k]) for k in ("train_shards", "heldout_shards")}
    if args.data:  # same file names, another folder
        shards = {k: str(Path(args.data) / Path(v).name) for k, v in shards.items()}
    if not Path(model_dir, "config.json").exists() or not Path(shards["heldout_shards"]).exists():
        raise SystemExit(f"build the model and data first: the commands in the header of {config}")
    processor = build_processor("auto", model_dir, max_pixels=cfg["processor"]["max_pixels"])
    episodes = Episodes(args.task, cfg, processor)
    first_train = shards["train_shards"].replace("{000000..000003}", "000000")
    train_samples, held_samples = load_all(first_train)[:args.train], load_all(shards["heldout_shards"])
    train = [episodes.context(i, s) for i, s in enumerate(train_samples)]
    held = [episodes.context(len(train) + i, s) for i, s in enumerate(held_samples)]
    if args.task == "gui_click":  # one desktop: the 9 tasks are the contexts (train and held-out alike)
        train = list({e["key"]: e for e in train}.values())
        held = list({e["key"]: e for e in held}.values())
    print(f"{len(train)} train / {len(held)} held-out contexts of {held[0]['input_ids'].shape[1]} tokens")
    results = {arm: run_arm(arm, model_dir, train, held, episodes, cfg, args.steps, args.eval_every, args.seed)
               for arm in args.arms}
    out = {"task": args.task, "config": str(config.relative_to(REPO)), "steps": args.steps, "seed": args.seed,
           "train_contexts": len(train), "heldout_contexts": len(held), "curves": results,
           "steps_to_0.9": {arm: next((s for s, a, _ in c if a >= 0.9), None) for arm, c in results.items()}}
    path = Path(args.out or REPO / "benchmarks" / "results" / f"turn_probe_{args.task}.json")
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["steps_to_0.9"]))


if __name__ == "__main__":
    main()
