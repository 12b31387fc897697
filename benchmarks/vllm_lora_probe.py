"""Can one vLLM engine (CPU backend) serve several peft LoRA adapters of the tiny VLM at once?

    nice .venv/bin/python benchmarks/vllm_lora_probe.py [--model work/tiny-vlm] [--rank 8] \
        [--rounds 12] [--out benchmarks/results/vllm_lora_probe.json]

Issue 23: `mmrl serve` samples a training client's checkpoint by merging its LoRA deltas into the
weights of ONE vLLM engine in place (`mmrl.serve.sampler.VllmSampler`), so clients that sample
different checkpoints take turns. vLLM's own LoRA path (`enable_lora`, one `LoRARequest` per
request) would let them share the engine. This probe runs that path for real and measures it:

  adapters   peft LoRAs on the targets `mmrl serve` trains (`mmrl.serve.trainer.lora_targets`),
             lora_B random non-zero so each adapter changes the outputs, `save_pretrained`:
               A, B   the language model's q/k/v/o/gate/up/down projections (two seeds)
               U      A's targets + lm_head (serve's default: `train_unembed`)
               V      the vision projector (merger) + the vision tower's linears only (its effect
                      on the image prompt is the vision LoRA's alone; on the text prompt, none)
               Z      A's targets with lora_B = 0: the base model as an adapter
  engines    both alive at once, timings interleaved round by round (the machine is shared):
             - LoRA: enable_lora, max_loras=2, enable_tower_connector_lora, with mmrl's engine
               settings (`mmrl.rollout.engine.engine_kwargs`, `cpu_engine_defaults`);
             - plain: no LoRA, each adapter merged (`merge_and_unload`) and loaded in place the
               way VllmSampler switches checkpoints (stage + reload + cache resets).
  checks     prompt logprobs of a text and an image prompt (a fixed answer) for A, B, none on the
             LoRA engine, against transformers' peft model and the merged plain engine; V and U
             through `add_lora` (U's error text); sampled tokens (decode) of one batch mixing A,
             B, no adapter and Z, scored by transformers; an in-place load in the LoRA engine (U
             merged: lm_head deltas and the RL weight sync still possible there); U sent straight
             in a request (no add_lora): does the engine survive; U on a subclass that declares
             lm_head a LoRA embedding module (in a child process).
  timings    a request with and without an adapter, the first request with a new adapter,
             add_lora, an in-place checkpoint switch (+ its first request), and throughput
             (image prompts x n samples x max_tokens) without an adapter, with A, with A and B
             mixed, against the plain engine.

Prints a JSON summary and writes it to --out. Run it alone: 3-5 minutes on two cores.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Which of serve's target groups each probe adapter gets (see the module docstring).
_LM = {"attn": True, "mlp": True, "unembed": False, "projector": False, "vision": False}
ADAPTER_KINDS: dict[str, dict[str, bool]] = {
    "A": _LM,
    "B": _LM,
    "U": {**_LM, "unembed": True},
    "V": {**_LM, "attn": False, "mlp": False, "projector": True, "vision": True},
    "Z": _LM,
}
ADAPTER_SEEDS = {"A": 1, "B": 2, "U": 1, "V": 3, "Z": 4}
ZERO_ADAPTERS = {"Z"}  # lora_B left at zero: the base model, as an adapter
TEXT_QUESTION = "What colour is the square? Answer with one word."
ANSWER = "The square is red, and the circle next to it is blue."


@dataclass
class Adapter:
    name: str
    path: Path  # peft save_pretrained folder (what a LoRARequest points at)
    targets: list[str]
    merged: dict[str, torch.Tensor]  # HF name -> merged weight, only the layers the adapter changes
    hf_logprobs: dict[str, list[float]] = field(default_factory=dict)  # prompt kind -> transformers'
    model: Any = None  # transformers model with the adapter merged (scores sampled tokens later)


@dataclass
class Prompts:
    """The scored prompts: engine prompts (one image pad) and transformers inputs (expanded)."""

    engine: dict[str, dict[str, Any]]
    hf: dict[str, dict[str, torch.Tensor]]
    image: Any


def build_prompts(model_dir: Path) -> Prompts:
    from PIL import Image
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(model_dir)
    image = Image.fromarray(np.random.RandomState(0).randint(0, 255, (112, 112, 3), dtype=np.uint8))
    engine, hf = {}, {}
    for kind in ("text", "image"):
        content = ([{"type": "image"}] if kind == "image" else []) + [{"type": "text", "text": TEXT_QUESTION}]
        text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=False) + ANSWER
        ids = proc.tokenizer(text, add_special_tokens=False)["input_ids"]
        if kind == "image":
            # mm_token_type_ids: without it transformers gives the image 1-D positions (STACK.md)
            inputs = proc(text=[text], images=[image], return_tensors="pt", return_mm_token_type_ids=True)
            engine[kind] = {"prompt_token_ids": ids, "multi_modal_data": {"image": image}}
        else:
            inputs = {"input_ids": torch.tensor([ids])}
            engine[kind] = {"prompt_token_ids": ids}
        hf[kind] = dict(inputs)
    return Prompts(engine=engine, hf=hf, image=image)


@torch.no_grad()
def hf_logprobs(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> list[float]:
    """logprob of ids[t] given ids[:t], t >= 1 (what vLLM's prompt logprobs hold)."""
    ids = inputs["input_ids"][0]
    logits = model(**inputs).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[1:].view(-1, 1)).squeeze(-1).tolist()


def build_adapters(model_dir: Path, out: Path, rank: int, b_std: float, prompts: Prompts,
                   names: tuple[str, ...] = tuple(ADAPTER_KINDS),
                   ) -> tuple[dict[str, Adapter], dict[str, list[float]], dict[str, torch.Tensor], Any]:
    """The probe adapters (saved), their merged weights and transformers' logprobs; the base
    model's logprobs, weights and the model itself."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from mmrl.serve.trainer import lora_targets

    def load() -> torch.nn.Module:
        return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()

    base = load()
    base_lp = {k: hf_logprobs(base, v) for k, v in prompts.hf.items()}
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    adapters = {}
    for name in names:
        kind = ADAPTER_KINDS[name]
        model = load()
        targets = lora_targets(model, **kind)
        torch.manual_seed(ADAPTER_SEEDS[name])
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=rank, target_modules=targets,
                                                      lora_dropout=0.0, bias="none"))
        # peft starts lora_B at zero (an identity adapter): make it move the outputs
        gen = torch.Generator().manual_seed(100 + ADAPTER_SEEDS[name])
        for pname, p in peft_model.named_parameters():
            if "lora_B" in pname:
                p.data.copy_(torch.randn(p.shape, generator=gen) * (0.0 if name in ZERO_ADAPTERS else b_std))
        path = out / f"adapter_{name}"
        peft_model.save_pretrained(path)
        lp = {k: hf_logprobs(peft_model, v) for k, v in prompts.hf.items()}
        merged_model = peft_model.merge_and_unload()
        merged = {k: v.detach().clone().contiguous() for k, v in merged_model.state_dict().items()
                  if not torch.equal(v, base_state[k])}
        adapters[name] = Adapter(name=name, path=path, targets=targets, merged=merged, hf_logprobs=lp,
                                 model=merged_model)
    return adapters, base_lp, base_state, base


def max_abs_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        raise ValueError(f"logprob lists differ in length: {len(a)} vs {len(b)}")
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def engine_args(model_dir: Path, lora: dict[str, Any] | None) -> dict[str, Any]:
    """mmrl's engine arguments for the model (what the server starts), plus vLLM's LoRA ones."""
    from mmrl.rollout.engine import cpu_engine_defaults, engine_kwargs

    extra: dict[str, Any] = {"enable_prefix_caching": False}  # every scoring pass computes its prompt
    if lora:
        extra.update(lora)
    return cpu_engine_defaults(engine_kwargs(str(model_dir), "float32", 0, extra, mm_limits={"image": 1, "video": 0}))


def score(llm: Any, prompt: dict[str, Any], lora_request: Any = None) -> list[float]:
    """vLLM's logprob of every prompt token after the first (prompt_logprobs=0: the actual token)."""
    from vllm import SamplingParams

    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0),
                       lora_request=lora_request, use_tqdm=False)[0]
    return [float(d[t].logprob) for t, d in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]


def throughput_batch(llm: Any, prompts: Prompts, lora_requests: list[Any] | None, batch: int, n: int,
                     max_tokens: int) -> tuple[int, float]:
    """(generated tokens, seconds) of one batch: `batch` image prompts x n samples x max_tokens;
    lora_requests: one per prompt, or None for the engine's own weights."""
    from vllm import SamplingParams

    sp = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, ignore_eos=True, logprobs=0, seed=0)
    t0 = time.perf_counter()
    outs = llm.generate([prompts.engine["image"]] * batch, sp, lora_request=lora_requests, use_tqdm=False)
    return sum(len(c.token_ids) for o in outs for c in o.outputs), time.perf_counter() - t0


def request_seconds(llm: Any, prompt: dict[str, Any], lora_request: Any = None) -> float:
    """Wall time of one short request (scoring the prompt, one new token)."""
    t0 = time.perf_counter()
    score(llm, prompt, lora_request)
    return time.perf_counter() - t0


def shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()


def load_in_place(llm: Any, tensors: dict[str, torch.Tensor]) -> float:
    """What VllmSampler does on a checkpoint switch (stage, reload, cache resets); seconds."""
    from safetensors.torch import save as save_safetensors

    t0 = time.perf_counter()
    llm.collective_rpc("mmrl_stage_bucket", args=(save_safetensors(tensors),))
    llm.collective_rpc("mmrl_apply_staged")
    llm.llm_engine.reset_encoder_cache()
    llm.reset_mm_cache()
    llm.reset_prefix_cache()
    return time.perf_counter() - t0


def switch_tensors(adapter: Adapter, previous: set[str],
                   base_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """As VllmSampler._load: this checkpoint's layers merged, the previous one's restored."""
    full = {k: base_state[k].contiguous() for k in previous - set(adapter.merged)}
    full.update(adapter.merged)
    return full


def _sampled(out: Any) -> dict[str, list]:
    """A request's prompt + sampled ids and vLLM's logprob of each token after the first."""
    c = out.outputs[0]
    return {"ids": list(out.prompt_token_ids) + list(c.token_ids), "n_prompt": len(out.prompt_token_ids),
            "logprobs": [float(d[t].logprob) for t, d in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
            + [float(step[t].logprob) for t, step in zip(c.token_ids, c.logprobs)]}


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "n": len(xs)}


def run_engines(model_dir: Path, adapters: dict[str, Adapter], base_state: dict[str, torch.Tensor],
                prompts: Prompts, rank: int, bench: dict[str, int], rounds: int) -> dict[str, Any]:
    """Both engines alive at once, so that their timings interleave round by round: the machine is
    shared, and a load spike then hits both sides instead of one."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    lora_args = {"enable_lora": True, "max_loras": 2, "max_cpu_loras": 4, "max_lora_rank": rank,
                 "enable_tower_connector_lora": True}
    res: dict[str, Any] = {"engine_args": lora_args}
    t0 = time.perf_counter()
    plain = LLM(**engine_args(model_dir, None))
    res["plain_start_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        lora = LLM(**engine_args(model_dir, lora_args))
    except Exception:
        shutdown(plain)
        raise
    res["lora_start_s"] = time.perf_counter() - t0
    next_id = iter(range(1, 1_000_000))

    def request(name: str) -> Any:
        # a new id (and name: vLLM compares requests by name) is a new adapter to the engine
        i = next(next_id)
        return LoRARequest(f"adapter_{name}_{i}", i, str(adapters[name].path))

    req = {name: request(name) for name in adapters}
    text = prompts.engine["text"]
    try:
        # ---- parity: every adapter on each engine ------------------------------------------
        res["lora_logprobs"] = {name or "none": {k: score(lora, p, req[name] if name else None)
                                                 for k, p in prompts.engine.items()}
                                for name in ("A", "B", None)}
        res["load"] = {}
        for name in ("V", "U"):  # adapters beyond the language model's projections
            try:
                t0 = time.perf_counter()
                ok = lora.llm_engine.add_lora(req[name])
                res["load"][name] = {"ok": bool(ok), "add_lora_s": time.perf_counter() - t0,
                                     "logprobs": {k: score(lora, p, req[name]) for k, p in prompts.engine.items()}}
            except Exception as e:  # the point of the probe: vLLM's own error text
                res["load"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        res["plain_logprobs"], previous = {}, set()
        for name, adapter in adapters.items():
            load_in_place(plain, switch_tensors(adapter, previous, base_state))
            previous = set(adapter.merged)
            res["plain_logprobs"][name] = {k: score(plain, p) for k, p in prompts.engine.items()}

        # ---- sampled tokens (decode) and batches mixing adapters with no adapter ------------
        # scored against transformers afterwards; "none" and "Z" (zero adapter) both mean the base
        sp = SamplingParams(max_tokens=8, temperature=1.0, seed=0, logprobs=0, prompt_logprobs=0)
        mixed = ["A", "B", "none", "Z"]
        outs = lora.generate([text] * len(mixed), sp, lora_request=[None if n == "none" else req[n] for n in mixed],
                             use_tqdm=False)
        res["sampled"] = {f"mixed/{n}": _sampled(o) for n, o in zip(mixed, outs)}
        for n in ("none", "A"):  # alone in the batch, after adapters have filled the slots
            alone = lora.generate([text], sp, lora_request=None if n == "none" else req[n], use_tqdm=False)
            res["sampled"][f"alone/{n}"] = _sampled(alone[0])

        # ---- timing, interleaved round by round --------------------------------------------
        t: dict[str, list[float]] = {k: [] for k in (
            "lora_request_no_adapter", "lora_request_adapter", "lora_first_request_new_adapter",
            "lora_add_lora", "plain_request", "plain_switch", "plain_first_request_after_switch")}
        tp: dict[str, list[tuple[int, float]]] = {k: [] for k in ("lora_no_adapter", "lora_adapter_A",
                                                                  "lora_mixed_A_B", "plain_base")}
        batch = bench["batch"]
        gen = {"batch": batch, "n": bench["n"], "max_tokens": bench["max_tokens"]}
        for r in range(rounds):
            t["lora_request_no_adapter"].append(request_seconds(lora, text))
            t["lora_request_adapter"].append(request_seconds(lora, text, req["A"]))
            # a new adapter id: read from disk and put in a slot by its first request
            t["lora_first_request_new_adapter"].append(request_seconds(lora, text, request("B")))
            fresh = request("A")
            t0 = time.perf_counter()
            lora.llm_engine.add_lora(fresh)
            t["lora_add_lora"].append(time.perf_counter() - t0)
            t["plain_request"].append(request_seconds(plain, text))
            name = "A" if r % 2 == 0 else "B"
            t["plain_switch"].append(load_in_place(plain, switch_tensors(adapters[name], previous, base_state)))
            previous = set(adapters[name].merged)
            t["plain_first_request_after_switch"].append(request_seconds(plain, text))
            tp["lora_no_adapter"].append(throughput_batch(lora, prompts, None, **gen))
            tp["lora_adapter_A"].append(throughput_batch(lora, prompts, [req["A"]] * batch, **gen))
            tp["lora_mixed_A_B"].append(throughput_batch(lora, prompts, [req["A" if i % 2 == 0 else "B"]
                                                                         for i in range(batch)], **gen))
            tp["plain_base"].append(throughput_batch(plain, prompts, None, **gen))
        # round 0 pays one-off costs (first batch of each shape): left out when there are more
        keep = slice(1, None) if rounds > 1 else slice(None)
        res["timing"] = {k: _stats(v[keep]) for k, v in t.items()}
        res["throughput"] = {k: {"tokens_per_batch": v[0][0],
                                 "tokens_per_s_median": statistics.median(n / s for n, s in v[keep]),
                                 "tokens_per_s_max": max(n / s for n, s in v[keep])} for k, v in tp.items()}

        # ---- can a LoRA engine still take in-place loads (lm_head deltas, the RL sync)? ------
        try:
            res["in_place_U_s"] = load_in_place(lora, adapters["U"].merged)
            res["in_place_U_logprobs"] = {k: score(lora, p) for k, p in prompts.engine.items()}
            res["in_place_U_plus_A_logprobs"] = {k: score(lora, p, req["A"]) for k, p in prompts.engine.items()}
        except Exception as e:
            res["in_place_U_error"] = f"{type(e).__name__}: {e}"[:2000]
        # last, as it may kill the engine: the unsupported adapter from a request, no add_lora
        try:
            score(lora, text, request("U"))
            res["lazy_U"] = {"error": None}
        except Exception as e:
            res["lazy_U"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        try:
            res["lazy_U"]["engine_alive_after"] = bool(score(lora, text))
        except Exception as e:
            res["lazy_U"]["engine_alive_after"] = False
            res["lazy_U"]["error_after"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        for llm in (lora, plain):
            try:
                shutdown(llm)
            except Exception:  # a dead engine: its process is gone already
                pass
    return res


def _parity(lora_lp: dict[str, list[float]], adapter: Adapter, merged_lp: dict[str, list[float]],
            base_lp: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {k: {"vs_transformers": max_abs_diff(lora_lp[k], adapter.hf_logprobs[k]),
                "vs_merged_vllm": max_abs_diff(lora_lp[k], merged_lp[k]),
                "adapter_effect": max_abs_diff(adapter.hf_logprobs[k], base_lp[k])}
            for k in lora_lp}


def _short_targets(targets: list[str]) -> list[str]:
    """Module kinds: the language model's projection names, other modules by full name."""
    return sorted({t.rsplit(".", 1)[-1] if "language_model" in t else t for t in targets})


def sampled_parity(sampled: dict[str, dict[str, list]], adapters: dict[str, Adapter], base: Any) -> dict[str, Any]:
    """Per sampled request: max |Δ logprob| against transformers with the adapter it asked for,
    over the prompt (prefill) and over the sampled tokens (decode); and, to name what a wrong
    one got instead, against every other candidate."""
    models = {"none": base, **{n: a.model for n, a in adapters.items() if n in ("A", "B", "Z")}}
    out: dict[str, Any] = {}
    for key, row in sampled.items():
        asked = key.split("/")[1]
        ids, P = row["ids"], row["n_prompt"]
        got = np.asarray(row["logprobs"])
        diffs = {}
        for name, model in models.items():
            ref = np.asarray(hf_logprobs(model, {"input_ids": torch.tensor([ids])}))
            diffs[name] = {"prefill": float(np.abs(got[:P - 1] - ref[:P - 1]).max()),
                           "decode": float(np.abs(got[P - 1:] - ref[P - 1:]).max())}
        out[key] = {"asked": asked, "vs_asked": diffs[asked],
                    "closest": min(diffs, key=lambda n: diffs[n]["prefill"] + diffs[n]["decode"]), "all": diffs}
    return out


def summarise(adapters: dict[str, Adapter], base_lp: dict[str, list[float]], res: dict[str, Any],
              rank: int, b_std: float) -> dict[str, Any]:
    kinds = list(base_lp)
    lora_lp, plain_lp = res["lora_logprobs"], res["plain_logprobs"]
    parity: dict[str, Any] = {n: _parity(lora_lp[n], adapters[n], plain_lp[n], base_lp) for n in ("A", "B")}
    parity["none"] = {k: {"vs_transformers_base": max_abs_diff(lora_lp["none"][k], base_lp[k])} for k in kinds}
    modules: dict[str, Any] = {}
    for name, row in res["load"].items():
        entry: dict[str, Any] = {"targets": _short_targets(adapters[name].targets), "loaded": row["ok"]}
        if "error" in row:
            entry["error"] = row["error"]
        if "logprobs" in row:
            entry["add_lora_s"] = row["add_lora_s"]
            entry["parity"] = _parity(row["logprobs"], adapters[name], plain_lp[name], base_lp)
        modules[name] = entry
    in_place: dict[str, Any] = {}
    if "in_place_U_logprobs" in res:
        u = adapters["U"]
        in_place = {"seconds": res["in_place_U_s"],
                    "no_adapter_vs_transformers_U": {k: max_abs_diff(res["in_place_U_logprobs"][k], u.hf_logprobs[k])
                                                     for k in kinds},
                    # the base changed under adapter A, so A's outputs must move too (there is no
                    # reference for merged-U + A: only that they differ from A on the original base)
                    "adapter_A_moved_by_reload": {k: max_abs_diff(res["in_place_U_plus_A_logprobs"][k], lora_lp["A"][k])
                                                  for k in kinds}}
    elif "in_place_U_error" in res:
        in_place = {"error": res["in_place_U_error"]}
    tp = res["throughput"]
    plain, plain_best = tp["plain_base"]["tokens_per_s_median"], tp["plain_base"]["tokens_per_s_max"]
    worst = max(v["vs_transformers"] for n in ("A", "B") for v in parity[n].values())
    return {
        "vllm_lora_works": worst < 1e-4,
        "worst_parity_A_B": worst,
        "rank": rank, "lora_b_std": b_std,
        "adapters": {n: _short_targets(a.targets) for n, a in adapters.items()},
        "parity_max_abs_logprob_diff": parity,
        "adapter_A_vs_B_max_abs_logprob_diff": {k: max_abs_diff(lora_lp["A"][k], lora_lp["B"][k]) for k in kinds},
        "merged_vllm_vs_transformers": {n: {k: max_abs_diff(plain_lp[n][k], a.hf_logprobs[k]) for k in kinds}
                                        for n, a in adapters.items()},
        "extra_modules": modules,
        "in_place_load_in_lora_engine": in_place,
        "lazy_load_of_unsupported_adapter": res.get("lazy_U"),
        # started one after the other, plain first: it pays the process's one-off imports, so
        # these two are not a LoRA-vs-plain comparison
        "engine_start_s": {"lora": res["lora_start_s"], "plain": res["plain_start_s"]},
        "timing_s": res["timing"],
        "throughput": {**tp,
                       "lora_no_adapter_over_plain": tp["lora_no_adapter"]["tokens_per_s_median"] / plain,
                       "lora_adapter_A_over_plain": tp["lora_adapter_A"]["tokens_per_s_median"] / plain,
                       "lora_mixed_A_B_over_plain": tp["lora_mixed_A_B"]["tokens_per_s_median"] / plain,
                       # best rounds: the least disturbed by other load on a shared machine
                       "best_lora_no_adapter_over_plain": tp["lora_no_adapter"]["tokens_per_s_max"] / plain_best,
                       "best_lora_adapter_A_over_plain": tp["lora_adapter_A"]["tokens_per_s_max"] / plain_best,
                       "best_lora_mixed_A_B_over_plain": tp["lora_mixed_A_B"]["tokens_per_s_max"] / plain_best},
        "lora_engine_args": res["engine_args"],
    }


def lm_head_subclass_check(model_dir: Path, run: Path, rank: int, b_std: float) -> dict[str, Any]:
    """Adapter U (with lm_head) on vLLM's Qwen2.5-VL subclassed to declare lm_head a LoRA
    embedding module (what Llama declares; Qwen2/Qwen2.5-VL declare none). Runs in a process whose
    engine core is in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): a registration made here does not
    reach a spawned engine core (a server would register it with a vLLM general plugin)."""
    from vllm import LLM, ModelRegistry
    from vllm.lora.request import LoRARequest
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

    class Qwen25VLWithLmHeadLoRA(Qwen2_5_VLForConditionalGeneration):
        embedding_modules = {"lm_head": "output_embeddings"}

    ModelRegistry.register_model("Qwen2_5_VLForConditionalGeneration", Qwen25VLWithLmHeadLoRA)
    prompts = build_prompts(model_dir)
    adapters, base_lp, _, _ = build_adapters(model_dir, run, rank, b_std, prompts, names=("U",))
    llm = LLM(**engine_args(model_dir, {"enable_lora": True, "max_loras": 2, "max_lora_rank": rank}))
    try:
        req = LoRARequest("adapter_U", 1, str(adapters["U"].path))
        llm.llm_engine.add_lora(req)
        lp = {k: score(llm, p, req) for k, p in prompts.engine.items()}
    finally:
        shutdown(llm)
    return {k: {"vs_transformers": max_abs_diff(lp[k], adapters["U"].hf_logprobs[k]),
                "adapter_effect": max_abs_diff(adapters["U"].hf_logprobs[k], base_lp[k])} for k in lp}


def run_lm_head_subclass_check(model_dir: Path, rank: int, b_std: float) -> dict[str, Any]:
    """lm_head_subclass_check in a fresh interpreter with the in-process engine core."""
    import subprocess

    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for key in ("VLLM_RPC_BASE_PATH", "VLLM_CACHE_ROOT"):
        env.pop(key, None)  # the child makes its own folder
    proc = subprocess.run([sys.executable, __file__, "--lm-head-subclass", "--model", str(model_dir),
                           "--rank", str(rank), "--b-std", str(b_std)], env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("LMHEAD ")]
    if proc.returncode != 0 or not lines:
        return {"error": proc.stderr[-2000:]}
    return json.loads(lines[-1][len("LMHEAD "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "work" / "tiny-vlm"))
    ap.add_argument("--rank", type=int, default=8,
                    help="LoRA rank (vLLM's max_lora_rank is one of 1, 8, 16, 32, 64, ...)")
    ap.add_argument("--b-std", type=float, default=0.05, help="std of the random lora_B entries")
    ap.add_argument("--batch", type=int, default=8, help="image prompts per throughput batch")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=12, help="timing rounds (the first is left out)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "vllm_lora_probe.json"))
    ap.add_argument("--lm-head-subclass", action="store_true", help=argparse.SUPPRESS)  # the child of the check above
    args = ap.parse_args()
    model_dir = Path(args.model).resolve()
    # Before vLLM is imported (it reads these once): offline, a small KV cache, and the engine's
    # sockets and caches in a private folder so other engines on the machine are not touched.
    # Here, not at import: spawned engine processes import this module again.
    run = Path(tempfile.mkdtemp(prefix="mmrl-lora-probe-"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_RPC_BASE_PATH", str(run / "rpc"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(run / "vllm-cache"))
    Path(os.environ["VLLM_RPC_BASE_PATH"]).mkdir(parents=True, exist_ok=True)
    if args.lm_head_subclass:
        try:
            print("LMHEAD " + json.dumps(lm_head_subclass_check(model_dir, run, args.rank, args.b_std)), flush=True)
        finally:
            shutil.rmtree(run, ignore_errors=True)
        return
    bench = {"batch": args.batch, "n": args.n, "max_tokens": args.max_tokens}
    try:
        prompts = build_prompts(model_dir)
        adapters, base_lp, base_state, base = build_adapters(model_dir, run, args.rank, args.b_std, prompts)
        res = run_engines(model_dir, adapters, base_state, prompts, args.rank, bench, args.rounds)
        summary = summarise(adapters, base_lp, res, args.rank, args.b_std)
        summary["sampled_parity"] = sampled_parity(res["sampled"], adapters, base)
        mixed_none = summary["sampled_parity"]["mixed/none"]
        summary["no_adapter_rows_in_mixed_batch_correct"] = max(mixed_none["vs_asked"].values()) < 1e-4
        summary["zero_adapter_rows_in_mixed_batch_correct"] = max(
            summary["sampled_parity"]["mixed/Z"]["all"]["none"].values()) < 1e-4
        summary["lm_head_with_subclass"] = run_lm_head_subclass_check(model_dir, args.rank, args.b_std)
        summary["bench"] = {**bench, "rounds": args.rounds, "load_average_after": os.getloadavg()}
        text = json.dumps(summary, indent=2)
        print(text)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    finally:
        shutil.rmtree(run, ignore_errors=True)


if __name__ == "__main__":
    main()
