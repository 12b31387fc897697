"""Engine-vs-trainer mismatch on an MoE VLM without and with rollout routing replay (R3).

    .venv/bin/python benchmarks/moe_routing_replay.py [--dtype bfloat16] [--prompts 16] [--n 4] [--arch qwen3_vl]

Builds the tiny Qwen3-VL-MoE (`mmrl tiny-model --arch qwen3_vl_moe`: 4 experts, top-2, both
text layers sparse; `work/bench-qwen3-vl-moe-<dtype>`, once), starts the colours demo's runtime on
it (the vLLM CPU engine in Ray, 2 ZeRO-3 ranks), samples one rollout (its routing recorded by the
engine) and recomputes the sampled tokens' logprobs on the trainer twice: routing by the
trainer's own routers, and replaying the engine's experts. Prints and writes
benchmarks/results/moe_routing_replay_<dtype>.json: per-token |logprob diff| (mean, p50, p99,
max), the importance ratio pi/mu (p1, p99, min, max) in both modes, and the router agreement
(share of (sampled token, MoE layer) pairs whose trainer top-2 set equals the engine's).
`--arch qwen3_vl` measures the dense model of the same family and size the same way (no routing:
only the trainer's own forward), the baseline that shows how much of the MoE's mismatch is
routing; it writes moe_routing_replay_<dtype>_dense.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _stats(log_ratio):
    import numpy as np

    d = np.abs(log_ratio)
    r = np.exp(log_ratio)
    return {"tokens": int(d.size), "abs_diff_mean": float(d.mean()), "abs_diff_p50": float(np.quantile(d, 0.5)),
            "abs_diff_p99": float(np.quantile(d, 0.99)), "abs_diff_max": float(d.max()),
            "ratio_p1": float(np.quantile(r, 0.01)), "ratio_p99": float(np.quantile(r, 0.99)),
            "ratio_min": float(r.min()), "ratio_max": float(r.max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--arch", default="qwen3_vl_moe", choices=["qwen3_vl_moe", "qwen3_vl"])
    args = ap.parse_args()
    moe = args.arch == "qwen3_vl_moe"

    import numpy as np
    import ray

    from mmrl.config import load_config
    from mmrl.controller.loop import start_runtime
    from mmrl.controller.rollout import run_rollout
    from mmrl.data.stream import load_all
    from mmrl.plugins.data.recipes.colors import build as build_colors
    from mmrl.models.tiny_vlm import build_tiny_vlm
    from mmrl.rollout.types import SamplingConfig
    from mmrl.trainer.batch import TrainSequence
    from mmrl.trainer.plan import plan_forward_only

    work = REPO / "work"
    model = work / f"bench-{args.arch.replace('_', '-')}-{args.dtype}"
    if not (model / "config.json").exists():
        build_tiny_vlm(args.arch, model, dtype=args.dtype)
    shards = work / "bench-moe-r3-colors"
    if not (shards / "heldout-000000.tar").exists():
        build_colors(shards, train_size=512, heldout_size=64, shard_size=512, seed=0)
    cfg = load_config(str(REPO / "configs" / "colors_demo.yaml"), [
        f"model.path={model}", f"model.dtype={args.dtype}", f"data.train_shards={shards}/train-000000.tar",
        f"data.heldout_shards={shards}/heldout-000000.tar", f"run.output_dir={work / 'bench-moe-r3-run'}",
        f"algorithm.routing_replay={'rollout' if moe else 'off'}"])
    rt = start_runtime(cfg)
    try:
        samples = load_all(str(shards / "heldout-000000.tar"))[:args.prompts]
        sampling = SamplingConfig(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0,
                                  forbidden_token_ids=rt.sampling.forbidden_token_ids, seed=11)
        rollout = run_rollout(rt.workers, samples, sampling)
        trajectories = [(i, t) for i, g in enumerate(rollout.groups) for t in g]

        def log_ratios(replay: bool) -> np.ndarray:
            seqs = [TrainSequence.from_prompt(rollout.prompts[i], t.response_ids, t.behaviour_logprobs, t.loss_mask,
                                              routed_experts=t.routed_experts if replay else None)
                    for i, t in trajectories]
            chunks, order = plan_forward_only(seqs, world_size=len(rt.trainers), micro_batch_size=8)
            per_rank = ray.get([tr.compute_logprobs.remote(c) for tr, c in zip(rt.trainers, chunks)])
            lps = {i: lp for idx, rank in zip(order, per_rank) for i, lp in zip(idx, rank)}
            return np.concatenate([np.asarray(lps[i]) - np.asarray(s.behaviour_logprobs) for i, s in enumerate(seqs)])

        result = {"dtype": args.dtype, "arch": args.arch, "model": str(model), "without_r3": _stats(log_ratios(False))}
        if moe:
            result["with_r3"] = _stats(log_ratios(True))
            # the router agreement of this rollout: the ranks' counts from a forward that only compares
            from mmrl.controller.learn import make_sequences
            from mmrl.trainer.plan import plan_updates

            seqs = make_sequences(rollout.prompts, rollout.groups)
            ray.get([t.set_lr.remote(0.0) for t in rt.trainers])  # measure only: the weights stay
            stats = ray.get([t.train_step.remote(x) for t, x in
                             zip(rt.trainers, plan_updates(seqs, world_size=len(rt.trainers), micro_batch_size=8))])
            pairs = sum(s["router_pairs"] for s in stats)
            result["router_agreement"] = sum(s["router_agree"] for s in stats) / pairs if pairs else None
            result["router_pairs"] = pairs
    finally:
        rt.close()
        ray.shutdown()
    print(json.dumps(result, indent=2))
    out = REPO / "benchmarks" / "results" / f"moe_routing_replay_{args.dtype}{'' if moe else '_dense'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
