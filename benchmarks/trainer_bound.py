"""How close does mmrl's training step come to a plain PyTorch loop on the same tokens?

    .venv/bin/python benchmarks/trainer_bound.py [--hidden-size 1024] [--num-layers 4] \
        [--prompts 4] [--group 8] [--max-new 128] [--rounds 3]

One batch as a long-generation GRPO step has it: colours held-out prompts (an image each), `group`
responses per prompt of seeded random lengths 8..max_new, advantages +-1. Arms, in alternating
rounds in one run, each doing one full update on the batch:
  * bound_padded / bound_packed: this process, the HF model, torch AdamW, the same micro-batches
    (`plan_updates`) in the padded or the padding-free layout, `micro_batch_loss`, backward,
    optimizer step: the plain loop;
  * ws1_padded / ws1_padding_free: the real trainer rank (Ray actor, DeepSpeed ZeRO-3)
    `train_step`, sequences sent to it as a step sends them;
  * ws2_padded: two ranks, each half the batch and one thread (the ZeRO-3 cost on 2 cores).
Threads: the bound and a lone rank use all cores, as `TrainerWorker` does. tokens/s = the batch's
real tokens (prompt, vision placeholders and response) / the update's wall seconds; medians over
rounds after one warm-up each; ratios to the plain loop in the same layout and to the faster of
the two plain loops (the bound). Goal (issue 15): ws=1 >= 0.8 of the bound.
Writes benchmarks/results/trainer_bound.json.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))
from _plots import write_result  # noqa: E402
from weight_sync import ensure_data, ensure_model  # noqa: E402


def build_batch(model_dir: Path, data_dir: Path, prompts: int, group: int, max_new: int, seed: int) -> tuple[list, int]:
    """The training sequences and the tokenizer's pad id."""
    from mmrl.data.stream import load_all
    from mmrl.processors import build_processor
    from mmrl.trainer.batch import TrainSequence

    proc = build_processor("auto", str(model_dir))
    rng = random.Random(seed)
    vocab = proc.tokenizer.vocab_size
    seqs = []
    for sample in load_all(str(data_dir / "heldout-000000.tar"))[:prompts]:
        prompt = proc(sample)
        for j in range(group):
            n = rng.randint(8, max_new)
            response = [rng.randrange(10, vocab) for _ in range(n)]
            seqs.append(TrainSequence.from_prompt(prompt, response, [-2.0] * n, [1] * n,
                                                  advantage=1.0 if j % 2 else -1.0))
    for uid, s in enumerate(seqs):
        s.uid = uid
    return seqs, proc.pad_token_id


def bound_update(model, optimizer, plan, pad_id: int, padding_free: bool) -> None:
    """The plain loop: same micro-batches, same layout, same loss, torch AdamW."""
    from mmrl import registry
    from mmrl.trainer.batch import collate
    from mmrl.trainer.update import LossSettings, micro_batch_loss

    policy_loss, settings = registry.resolve("policy_loss", "ppo_clip"), LossSettings()
    for mini in plan.mini_batches:
        for chunk in mini.micro_batches:
            mb = collate(chunk, pad_id, padding_free=padding_free)
            logprobs_BT, entropy_BT = mb.response_logprobs(model(**mb.model_inputs()).logits, 1.0, [])
            loss, _ = micro_batch_loss(policy_loss, settings, logprobs_BT, entropy_BT, mb.mask_BT, mb.advantages_B,
                                       mb.behaviour_logprobs_BT, None, None, 1.0 / mini.loss_denominator)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def start_ranks(model_dir: Path, world_size: int, padding_free: bool, pad_id: int) -> list:
    import ray

    from mmrl.trainer.update import LossSettings
    from mmrl.trainer.worker import TrainerSpec, make_trainer_actors, setup_ranks
    from mmrl.utils.env import engine_env

    spec = TrainerSpec(model_path=str(model_dir), dtype="float32", world_size=world_size,
                       device="cpu", lr=1e-5, betas=(0.9, 0.999),
                       weight_decay=0.0, grad_clip=1.0, deepspeed={}, temperature=1.0, forbidden_token_ids=[],
                       pad_token_id=pad_id, loss=LossSettings(), seed=0,
                       env=engine_env(REPO / "runs" / "trainer_bound", "cpu"),
                       padding_free=padding_free)
    ranks = make_trainer_actors(spec, {"num_cpus": 0})
    ray.get(setup_ranks(ranks)[0])
    return ranks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden-size", type=int, default=1024)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", nargs="+", default=["bound_padded", "bound_packed", "ws1_padded", "ws1_padding_free",
                                                  "ws2_padded"])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import ray
    import torch
    from transformers import AutoModelForImageTextToText

    from mmrl.trainer.plan import padded_tokens, plan_updates
    from mmrl.utils.env import init_local_ray

    model_dir, params = ensure_model(args.hidden_size, args.num_layers)
    seqs, pad_id = build_batch(model_dir, ensure_data(), args.prompts, args.group, args.max_new, seed=0)
    real_tokens = sum(s.num_tokens for s in seqs)
    cores = os.cpu_count() or 2
    print(f"model {model_dir.name}: {params / 1e6:.1f} M parameters; batch {len(seqs)} sequences, "
          f"{real_tokens} tokens ({sum(len(s.response_ids) for s in seqs)} response)", flush=True)

    def plans(world_size: int, padding_free: bool) -> list:
        return plan_updates(seqs, world_size=world_size, micro_batch_size=args.micro_batch_size,
                            padding_free=padding_free)

    runners = {}
    torch.set_num_threads(cores)
    for arm in [a for a in args.arms if a.startswith("bound")]:
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        packed = arm == "bound_packed"
        runners[arm] = (lambda model=model, optimizer=optimizer, plan=plans(1, packed)[0], packed=packed:
                        bound_update(model, optimizer, plan, pad_id, packed))
    init_local_ray(num_cpus=cores, include_dashboard=False)
    for arm in [a for a in args.arms if not a.startswith("bound")]:
        world_size, padding_free = int(arm[2]), arm.endswith("padding_free")
        ranks = start_ranks(model_dir, world_size, padding_free, pad_id)
        arm_plans = plans(world_size, padding_free)
        runners[arm] = (lambda ranks=ranks, arm_plans=arm_plans:
                        ray.get([r.train_step.remote(p) for r, p in zip(ranks, arm_plans)]))
    padded_plan = plans(1, False)[0]
    padded_cost = sum(padded_tokens(c) for m in padded_plan.mini_batches for c in m.micro_batches)

    seconds: dict[str, list[float]] = {arm: [] for arm in runners}
    for arm, run in runners.items():  # warm-up: first forward's allocations, DeepSpeed's first step
        run()
    for r in range(args.rounds):
        for arm, run in runners.items():
            t0 = time.perf_counter()
            run()
            seconds[arm].append(time.perf_counter() - t0)
        print(f"round {r + 1}: " + ", ".join(f"{a} {s[-1]:.2f} s" for a, s in seconds.items()), flush=True)
    ray.shutdown()

    median = {arm: statistics.median(s) for arm, s in seconds.items()}
    result = {
        "command": "benchmarks/trainer_bound.py " + " ".join(sys.argv[1:]),
        "model": model_dir.name, "params": params, "sequences": len(seqs), "real_tokens": real_tokens,
        "padded_tokens": padded_cost, "micro_batch_size": args.micro_batch_size, "cores": cores,
        "seconds": seconds, "median_s": median,
        "tokens_per_s": {arm: real_tokens / s for arm, s in median.items()},
    }
    bounds = {arm: s for arm, s in median.items() if arm.startswith("bound")}
    if bounds:
        best = min(bounds.values())
        result["bound_s"] = best
        result["ratio_to_bound"] = {arm: best / s for arm, s in median.items() if arm not in bounds}
        same = {arm: "bound_packed" if arm.endswith("padding_free") else "bound_padded" for arm in median}
        result["ratio_to_same_layout_loop"] = {arm: median[same[arm]] / s for arm, s in median.items()
                                               if arm not in bounds and same[arm] in median}
    print(f"padding: the padded layout computes {padded_cost} tokens for {real_tokens} real ones "
          f"({padded_cost / real_tokens:.2f}x)")
    for arm, s in median.items():
        ratio = result.get("ratio_to_bound", {}).get(arm)
        print(f"{arm:18s} {s:7.2f} s/update  {real_tokens / s:8.0f} tokens/s"
              + (f"  {ratio:.2f}x the bound" if ratio is not None else ""))
    write_result(args.out, "trainer_bound.json", result)


if __name__ == "__main__":
    main()
