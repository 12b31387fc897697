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

Beside them, the machine's bound on one decode step of all `prompts x group` sequences (a
roofline, measured on the same cores in this process): each step must read every weight of the
language model's linear layers once (the time of `sum()` over those bytes in one buffer)
and do 2 x parameters x sequences FLOPs (at the FLOP rate of a large fp32 matmul, the fastest
this CPU runs); the step takes at least the larger of the two. Tokens/s = sequences / that time.
No engine decodes faster than that here, so it says how much of a ratio the machine allows. The
engine's processes are idle then; their CPU seconds during the HF rounds and the bound are
printed, so a busy-waiting engine would show.
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
    from mmrl.utils.cpu_clock import ProcessTreeClock

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

    lm_weights = [m.weight for name, m in hf.named_modules()  # what a decode step's matmuls read
                  if isinstance(m, torch.nn.Linear) and "visual" not in name]
    flat = torch.cat([w.detach().flatten() for w in lm_weights])  # one buffer: no per-call overhead

    def decode_bound() -> dict[str, float]:
        """The roofline of one decode step: weight bytes at the read rate, FLOPs at the matmul rate."""
        with torch.no_grad():
            flat.sum()  # warm-up
            reads, t0 = 0, time.perf_counter()
            while reads < 8 or time.perf_counter() - t0 < 1.0:
                flat.sum()
                reads += 1
            read_s = (time.perf_counter() - t0) / reads
            a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
            a @ b
            mms, t0 = 0, time.perf_counter()
            while mms < 4 or time.perf_counter() - t0 < 1.0:
                a @ b
                mms += 1
            flops_per_s = 2 * 2048 ** 3 * mms / (time.perf_counter() - t0)
        compute_s = 2 * flat.numel() * len(batch) / flops_per_s
        nbytes = flat.numel() * flat.element_size()
        return {"tokens_per_s": len(batch) / max(read_s, compute_s), "read_s": read_s, "compute_s": compute_s,
                "weight_mb": nbytes / 2 ** 20, "read_gb_per_s": nbytes / read_s / 1e9, "gflops": flops_per_s / 1e9}

    tree = ProcessTreeClock(refresh_s=0.0)

    def others_cpu_s() -> float:
        """CPU seconds so far of this process's children (the engine's processes)."""
        return sum(seconds for kind, seconds in tree.by_process().items() if kind != "driver")

    print(f"model {model_dir.relative_to(REPO)} ({params / 1e6:.1f} M parameters), {args.prompts} prompts x "
          f"{args.group} samples x {args.new_tokens} new tokens, torch threads {torch.get_num_threads()}", flush=True)
    vllm_round(), hf_round()  # warm-up: compile, allocate, caches
    rates: dict[str, list[float]] = {"vllm": [], "hf": [], "decode_bound": []}
    bounds, engine_cpu_while_idle_s = [], 0.0
    for i in range(args.repeats):
        for name, fn in (("vllm", vllm_round), ("hf", hf_round)):
            before = others_cpu_s()
            tokens, seconds = fn()
            if name == "hf":
                engine_cpu_while_idle_s += others_cpu_s() - before
            rates[name].append(tokens / seconds)
            print(f"  round {i + 1} {name:4s}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.0f} tokens/s",
                  flush=True)
        before = others_cpu_s()
        bounds.append(decode_bound())
        engine_cpu_while_idle_s += others_cpu_s() - before
        rates["decode_bound"].append(bounds[-1]["tokens_per_s"])
        print(f"  round {i + 1} bound: {bounds[-1]['tokens_per_s']:.0f} tokens/s (reading {bounds[-1]['weight_mb']:.0f} MB "
              f"of weights: {bounds[-1]['read_s'] * 1e3:.1f} ms at {bounds[-1]['read_gb_per_s']:.1f} GB/s; "
              f"the FLOPs: {bounds[-1]['compute_s'] * 1e3:.1f} ms at {bounds[-1]['gflops']:.0f} GFLOP/s)", flush=True)
    vllm_rate, hf_rate = statistics.median(rates["vllm"]), statistics.median(rates["hf"])
    bound = statistics.median(rates["decode_bound"])
    print(f"vLLM {vllm_rate:.0f} tokens/s, HF generate {hf_rate:.0f} tokens/s: {vllm_rate / hf_rate:.2f}x (goal >= 3x); "
          f"the decode bound {bound:.0f} tokens/s = {bound / hf_rate:.2f}x HF: vLLM at {vllm_rate / bound:.2f} of it, "
          f"HF at {hf_rate / bound:.2f}; the engine's processes used {engine_cpu_while_idle_s:.2f} CPU-s while "
          f"HF and the bound ran")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollout.json").write_text(json.dumps(
        {"model": str(model_dir.relative_to(REPO)), "parameters": params, "prompts": args.prompts,
         "group": args.group, "new_tokens": args.new_tokens, "tokens_per_s": rates,
         "vllm_tokens_per_s": vllm_rate, "hf_tokens_per_s": hf_rate, "ratio": vllm_rate / hf_rate,
         "decode_bound_tokens_per_s": bound, "decode_bound_rounds": bounds, "vllm_share_of_bound": vllm_rate / bound,
         "hf_share_of_bound": hf_rate / bound, "engine_cpu_while_idle_s": engine_cpu_while_idle_s,
         "command": "benchmarks/rollout.py " + " ".join(sys.argv[1:]),
         "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                  text=True).stdout.strip()}, indent=1))


if __name__ == "__main__":
    main()
