"""vLLM's own LoRA path on the CPU backend (issue 23): one engine serves two peft adapters of the
tiny Qwen2.5-VL side by side, each request with its own `LoRARequest`, and each request's prompt
and sampled-token logprobs are transformers' logprobs of the model it asked for — text and image
prompts, both adapters and the base model in one batch. Also pins the failure mode a server must
plan for: an adapter on `lm_head` is refused by `add_lora` (vLLM's Qwen2.5-VL declares no LoRA
embedding modules) and the engine keeps serving. benchmarks/vllm_lora_probe.py measures the same
path (timings, vision adapters, throughput, the lm_head workaround)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
RANK = 8
# Measured with benchmarks/vllm_lora_probe.py (fp32): vLLM with an adapter vs transformers' peft
# model differ by at most 1e-6 per token (float32 rounding; the same as without LoRA, STACK.md),
# while each adapter moves the logprobs by ~0.3. 1e-4 leaves 100x headroom for other thread
# counts and reduction orders and is still 1000x below an adapter's effect.
TOL = 1e-4
MIN_EFFECT = 0.05  # an adapter that moves nothing would make the parity check vacuous

_ENGINE_SCRIPT = r"""
import json
import sys

from PIL import Image
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

from mmrl.rollout.engine import cpu_engine_defaults, engine_kwargs


def sequence(out):
    c = out.outputs[0]
    return {"prompt_ids": list(out.prompt_token_ids), "ids": list(c.token_ids),
            "logprobs": [float(d[t].logprob) for t, d in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
            + [float(step[t].logprob) for t, step in zip(c.token_ids, c.logprobs)]}


if __name__ == "__main__":  # vLLM may spawn processes
    spec = json.load(open(sys.argv[1]))
    lora = {"enable_lora": True, "max_loras": 3, "max_lora_rank": spec["rank"], "enable_prefix_caching": False}
    llm = LLM(**cpu_engine_defaults(engine_kwargs(spec["model"], "float32", 0, lora,
                                                  mm_limits={"image": 1, "video": 0})))
    prompts = {"text": {"prompt_token_ids": spec["text_ids"]},
               "image": {"prompt_token_ids": spec["image_ids"],
                         "multi_modal_data": {"image": Image.open(spec["image"]).convert("RGB")}}}
    reqs = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(spec["adapters"].items())}
    # one batch: both prompts under every adapter; prompt logprobs (prefill) and sampled tokens' (decode)
    batch = [(kind, name) for kind in prompts for name in reqs]
    sp = SamplingParams(max_tokens=4, temperature=1.0, seed=0, logprobs=0, prompt_logprobs=0)
    outs = llm.generate([prompts[k] for k, _ in batch], sp, lora_request=[reqs[n] for _, n in batch],
                        use_tqdm=False)
    result = {f"{k}/{n}": sequence(o) for (k, n), o in zip(batch, outs)}
    try:
        llm.llm_engine.add_lora(LoRARequest("U", len(reqs) + 1, spec["lm_head_adapter"]))
        result["lm_head_error"] = None
    except Exception as e:
        result["lm_head_error"] = str(e)
    result["after"] = sequence(llm.generate([prompts["text"]], sp, lora_request=reqs["Z"], use_tqdm=False)[0])
    print("RESULT " + json.dumps(result), flush=True)
"""


@torch.no_grad()
def _logprobs(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> list[float]:
    ids = inputs["input_ids"][0]
    logits = model(**inputs).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[1:].view(-1, 1)).squeeze(-1).tolist()


def _adapter(model_dir: Path, out: Path, seed: int, *, unembed: bool = False, b_std: float = 0.05) -> tuple[Path, Any]:
    """A peft LoRA on the targets `mmrl serve` trains (attention + MLP, with `unembed` lm_head too),
    lora_B random so the adapter changes the outputs (peft starts it at zero; b_std=0 keeps that:
    the base model as an adapter); saved to `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from mmrl.serve.trainer import lora_targets

    base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    targets = lora_targets(base, attn=True, mlp=True, unembed=unembed)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=RANK, target_modules=targets, lora_dropout=0.0,
                                            bias="none"))
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=gen) * b_std)
    model.save_pretrained(out)
    return out, model


def _with_response(inputs: dict[str, torch.Tensor], ids: list[int]) -> dict[str, torch.Tensor]:
    """transformers inputs for prompt + sampled ids (text tokens: type 0, attended)."""
    extra = torch.tensor([ids])
    out = dict(inputs, input_ids=torch.cat([inputs["input_ids"], extra], 1))
    for key in ("attention_mask", "mm_token_type_ids"):
        if key in inputs:
            fill = torch.ones_like(extra) if key == "attention_mask" else torch.zeros_like(extra)
            out[key] = torch.cat([inputs[key], fill.to(inputs[key].dtype)], 1)
    return out


def test_adapters_in_one_vllm_engine_match_transformers(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two adapters and the base model (as a zero adapter: see below) in ONE batch, for a text and
    an image prompt: each request's prompt and sampled-token logprobs are transformers' logprobs
    of the model it asked for.

    Why the base model is a zero adapter here: vLLM 0.32's CPU LoRA ops gather the adapter weights
    with the row's slot index, and a row without an adapter has index -1, which Python indexing
    turns into the LAST slot: in a batch that mixes no-adapter and adapter requests, the
    no-adapter rows get that slot's adapter (measured: benchmarks/vllm_lora_probe.py; vLLM PRs
    48421/49656 fix it). A batch of only no-adapter requests is right; every request carrying an
    adapter is right."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_model_dir)
    image_path = tmp_path / "image.png"  # PNG: the engine reads back the same pixels
    Image.fromarray(np.random.RandomState(0).randint(0, 255, (56, 56, 3), dtype=np.uint8)).save(image_path)
    image = Image.open(image_path).convert("RGB")
    texts, hf_inputs = {}, {}
    for kind in ("text", "image"):
        content = ([{"type": "image"}] if kind == "image" else []) + [{"type": "text", "text": "What colour?"}]
        texts[kind] = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                               tokenize=False) + "red and blue"
    ids = {k: proc.tokenizer(t, add_special_tokens=False)["input_ids"] for k, t in texts.items()}
    hf_inputs["text"] = {"input_ids": torch.tensor([ids["text"]])}
    # mm_token_type_ids: transformers' M-RoPE positions for the image (1-D positions without it)
    hf_inputs["image"] = dict(proc(text=[texts["image"]], images=[image], return_tensors="pt",
                                   return_mm_token_type_ids=True))

    models = {"Z": AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()}
    paths = {}
    for name, seed in (("A", 1), ("B", 2)):
        paths[name], models[name] = _adapter(tiny_model_dir, tmp_path / name, seed)
    paths["Z"], _ = _adapter(tiny_model_dir, tmp_path / "Z", 3, b_std=0.0)
    lm_head_adapter, _ = _adapter(tiny_model_dir, tmp_path / "U", 4, unembed=True)

    spec = {"model": str(tiny_model_dir), "rank": RANK, "text_ids": ids["text"], "image_ids": ids["image"],
            "image": str(image_path), "adapters": {n: str(p) for n, p in paths.items()},
            "lm_head_adapter": str(lm_head_adapter)}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "rpc").mkdir()
    # VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core in the script's own process (same worker and
    # LoRA code; starts in ~3 s instead of ~20 s: no second interpreter importing vLLM)
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CACHE_ROOT=str(tmp_path / "vllm_cache"), VLLM_RPC_BASE_PATH=str(tmp_path / "rpc"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    # vLLM freezes its environment at import: a fresh interpreter, not pytest
    run = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT, str(tmp_path / "spec.json")], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    got = json.loads(lines[-1][len("RESULT "):])

    expected = {}
    for kind in ("text", "image"):
        for name, model in models.items():
            seq = got[f"{kind}/{name}"]
            assert seq["prompt_ids"] == hf_inputs[kind]["input_ids"][0].tolist()  # same expanded prompt
            assert len(seq["ids"]) == 4
            expected[f"{kind}/{name}"] = _logprobs(model, _with_response(hf_inputs[kind], seq["ids"]))
            diff = np.abs(np.array(seq["logprobs"]) - np.array(expected[f"{kind}/{name}"])).max()
            assert diff < TOL, f"{kind}/{name}: vLLM LoRA vs transformers differ by {diff:.2e}"
        # the adapters really act, and differently: otherwise the parity above proves nothing
        base_prompt = _logprobs(models["Z"], hf_inputs[kind])
        n = len(base_prompt)
        for name in ("A", "B"):
            effect = np.abs(np.array(expected[f"{kind}/{name}"][:n]) - np.array(base_prompt)).max()
            assert effect > MIN_EFFECT, f"adapter {name} barely changes the {kind} logprobs ({effect:.2e})"
        a_vs_b = np.abs(np.array(got[f"{kind}/A"]["logprobs"][:n]) - np.array(got[f"{kind}/B"]["logprobs"][:n])).max()
        assert a_vs_b > MIN_EFFECT, f"adapters A and B give the same {kind} logprobs in one engine"

    # lm_head is not a LoRA module for vLLM's Qwen2.5-VL: refused at add_lora, and the engine keeps
    # serving (the same adapter sent straight in a request kills the engine instead: see the probe)
    assert got["lm_head_error"] is not None and "lm_head" in got["lm_head_error"], got["lm_head_error"]
    np.testing.assert_allclose(got["after"]["logprobs"], expected["text/Z"], atol=TOL)
