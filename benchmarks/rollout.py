"""How much faster is mmrl's rollout engine (vLLM) than HF `generate` on the same model and prompts?

    .venv/bin/python benchmarks/rollout.py [--hidden-size 1024] [--num-layers 6] [--prompts 8] \
        [--group 4] [--new-tokens 128] [--repeats 2]

The model is the ~50 M-parameter random Qwen2.5-VL of benchmarks/weight_sync.py (built once with
the tiny-model kit); the prompts are held-out samples of the colours recipe (an image and a
question each) through mmrl's processor. Both sides sample `group` responses per prompt at
temperature 1 and generate exactly `--new-tokens` tokens each (end-of-sequence ignored), so they
do the same work:
- vLLM: `vllm.LLM` with mmrl's engine arguments (`engine_kwargs`, as `mmrl train` starts it),
  all requests at once, `n=group`;
- HF: `model.generate` on the same prompt ids and vision tensors, one batch of prompts x group.
The two alternate, `--repeats` times each after a warm-up, in one run; prints generated tokens/s
per side and the ratio, writes benchmarks/results/rollout.json. Goal (issue 15): >= 3x at >= 128
new tokens.

Beside them, the bound: the language model's weight matmuls alone for one decode step of all
`prompts x group` sequences (`x_BD @ W.T` for every linear layer and the LM head, nothing else:
no attention, sampling or scheduling), timed on the same cores; tokens/s = sequences / step time.
No engine can decode faster than that here, so it says how much of a ratio the machine allows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from weight_sync import ensure_data, ensure_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden-size", type=int, default=1024)
    ap.add_argument("--num-layers", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args()
    model_dir, params = ensure_model(args.hidden_size, args.num_layers)
    data = ensure_data()

    from mmrl.utils.env import engine_env

    run_dir = Path(tempfile.mkdtemp(prefix="mmrl-rollout-bench-"))
    os.environ.update(engine_env(run_dir, "cpu", {"VLLM_LOGGING_LEVEL": "WARNING"}))

    import torch
    from transformers import AutoModelForImageTextToText
    from vllm import LLM, SamplingParams

    from mmrl.data.stream import load_all
    from mmrl.processors import build_processor
    from mmrl.rollout.engine import cpu_engine_defaults, engine_kwargs

    processor = build_processor("auto", str(model_dir))
    samples = load_all(str(data / "heldout-000000.tar"))[:args.prompts]
    prompts = [processor(s) for s in samples]
    if len({p.num_tokens for p in prompts}) != 1:
        raise SystemExit("the benchmark batches HF generate without padding: the prompts must have one length")
    max_len = prompts[0].num_tokens + args.new_tokens + 16

    llm = LLM(**cpu_engine_defaults(engine_kwargs(str(model_dir), "float32", 0, {
        "max_model_len": max(512, max_len), "max_num_seqs": 256, "limit_mm_per_prompt": {"image": 1, "video": 0}})))
    sampling = SamplingParams(n=args.group, temperature=1.0, max_tokens=args.new_tokens,
                              min_tokens=args.new_tokens, ignore_eos=True)

    def vllm_round() -> tuple[int, float]:
        t0 = time.perf_counter()
        outs = llm.generate([p.vllm_input for p in prompts], sampling, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs), time.perf_counter() - t0

    hf = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    batch = [p for p in prompts for _ in range(args.group)]
    inputs = {"input_ids": torch.tensor([p.prompt_ids for p in batch])}
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    for key in prompts[0].mm_inputs:
        inputs[key] = torch.cat([p.mm_inputs[key] for p in batch])

    def hf_round() -> tuple[int, float]:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(**inputs, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
        return (out.shape[1] - inputs["input_ids"].shape[1]) * out.shape[0], time.perf_counter() - t0

    def matmul_bound() -> float:
        """Decode tokens/s if a step cost only the language model's weight matmuls."""
        linears = [m.weight for name, m in hf.named_modules()
                   if isinstance(m, torch.nn.Linear) and "visual" not in name]
        xs = [torch.randn(len(batch), w.shape[1]) for w in linears]
        with torch.no_grad():
            for x, w in zip(xs, linears):  # warm-up
                x @ w.T
            steps, t0 = 0, time.perf_counter()
            while steps < 16 or time.perf_counter() - t0 < 2.0:
                for x, w in zip(xs, linears):
                    x @ w.T
                steps += 1
        return len(batch) * steps / (time.perf_counter() - t0)

    print(f"model {model_dir.relative_to(REPO)} ({params / 1e6:.1f} M parameters), {args.prompts} prompts x "
          f"{args.group} samples x {args.new_tokens} new tokens, torch threads {torch.get_num_threads()}", flush=True)
    vllm_round(), hf_round()  # warm-up: compile, allocate, caches
    rates: dict[str, list[float]] = {"vllm": [], "hf": [], "matmul_bound": []}
    for i in range(args.repeats):
        for name, fn in (("vllm", vllm_round), ("hf", hf_round)):
            tokens, seconds = fn()
            rates[name].append(tokens / seconds)
            print(f"  round {i + 1} {name:4s}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.0f} tokens/s",
                  flush=True)
        rates["matmul_bound"].append(matmul_bound())
        print(f"  round {i + 1} bound: {rates['matmul_bound'][-1]:.0f} tokens/s (weight matmuls only)", flush=True)
    vllm_rate, hf_rate = statistics.median(rates["vllm"]), statistics.median(rates["hf"])
    bound = statistics.median(rates["matmul_bound"])
    print(f"vLLM {vllm_rate:.0f} tokens/s, HF generate {hf_rate:.0f} tokens/s: {vllm_rate / hf_rate:.2f}x (goal >= 3x); "
          f"the matmul bound {bound:.0f} tokens/s = {bound / hf_rate:.2f}x HF: vLLM at {vllm_rate / bound:.2f} of it, "
          f"HF at {hf_rate / bound:.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollout.json").write_text(json.dumps(
        {"model": str(model_dir.relative_to(REPO)), "parameters": params, "prompts": args.prompts,
         "group": args.group, "new_tokens": args.new_tokens, "tokens_per_s": rates,
         "vllm_tokens_per_s": vllm_rate, "hf_tokens_per_s": hf_rate, "ratio": vllm_rate / hf_rate,
         "matmul_bound_tokens_per_s": bound, "vllm_share_of_bound": vllm_rate / bound,
         "hf_share_of_bound": hf_rate / bound,
         "command": "benchmarks/rollout.py " + " ".join(sys.argv[1:]),
         "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                  text=True).stdout.strip()}, indent=1))


if __name__ == "__main__":
    main()
