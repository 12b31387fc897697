"""Samplers: the weights of one saved checkpoint at a time, answering Tinker `sample` requests.

A checkpoint for sampling is stored as the adapter's weight deltas (HF checkpoint name ->
(alpha/r)·B·A); a sampler serving it holds base + deltas, merged. Two backends:
- `VllmSampler` (`serve.sampler: vllm`, the default): mmrl's rollout engine
  (`mmrl.rollout.engine.RolloutEngine`, vLLM AsyncLLM) run in the server's event loop; a checkpoint
  switch is the RL weight sync (`stage_weights` + `apply_weights`: in-place reload, caches reset).
- `HfSampler` (`serve.sampler: trainer`): a transformers model in this process, sampled with the
  trainer's own sampling code (`mmrl.trainer.generate`): no vLLM, for tests and debugging.
Switching checkpoints serialises sampling (one set of weights is live at a time); requests for
the checkpoint already loaded do not pay for a switch. `serve.vllm_lora: true` serves checkpoints
as vLLM LoRA adapters instead, side by side (`mmrl.serve.lora_sampler.LoraVllmSampler`).
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mmrl.serve.inputs import Prompt, full_positions


@dataclass
class SampleParams:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_strs: list[str]
    stop_tokens: list[int]
    # vision pad tokens: a sampled one would stand for an image that is not there (the next
    # forward's image-token count breaks); biased by -100 like `mmrl train` does, and the reported
    # logprobs are the model's own (what compute_logprobs gives)
    forbidden: list[int] = field(default_factory=list)


def merged_state(base: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, delta in deltas.items():
        w = base[name]
        out[name] = (w.float() + delta.float()).to(w.dtype).contiguous()
    return out


class _Switching:
    """Serialises checkpoint switches against the requests that use the current weights."""

    def __init__(self) -> None:
        self.current: str | None = None
        self.lock = asyncio.Lock()
        self.base_names: set[str] = set()


class HfSampler:
    def __init__(self, model_path: str, dtype: str = "float32", trust_remote_code: bool = False):
        from transformers import AutoModelForImageTextToText, AutoTokenizer

        from mmrl.rollout.trainer_engine import eos_token_ids

        torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        self.model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch_dtype,
                                                                 trust_remote_code=trust_remote_code).eval()
        self.base = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.state = _Switching()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.eos = eos_token_ids(model_path, self.tokenizer, trust_remote_code)

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    def _load(self, deltas: dict[str, torch.Tensor]) -> None:
        missing = [k for k in deltas if k not in self.base]
        if missing:
            raise KeyError(f"checkpoint weights not in the base model: {missing[:3]}")
        state = {**self.base, **merged_state(self.base, deltas)}
        self.model.load_state_dict(state)

    async def run(self, key: str, deltas_fn: Callable[[], dict[str, torch.Tensor]], prompt: Prompt,
                  n: int, params: SampleParams, prompt_logprobs: bool) -> dict[str, Any]:
        async with self.state.lock:
            if self.state.current != key:
                await asyncio.to_thread(self._load, deltas_fn())
                self.state.current = key
            return await asyncio.to_thread(self._sample, prompt, n, params, prompt_logprobs)

    @torch.no_grad()
    def _sample(self, prompt: Prompt, n: int, p: SampleParams, want_prompt: bool) -> dict[str, Any]:
        from mmrl.rollout.types import RequestSampling
        from mmrl.trainer.generate import GenerationRequest, sample_responses

        seqs = []
        for i in range(n):
            s = RequestSampling(max_tokens=p.max_tokens, temperature=max(p.temperature, 1e-6), top_p=p.top_p,
                                seed=None if p.seed is None else p.seed + i, greedy=p.temperature == 0,
                                stop=tuple(p.stop_strs), forbidden_token_ids=list(p.forbidden))
            P = len(prompt.ids)
            positions = prompt.positions_AP if prompt.positions_AP is not None else torch.arange(P).view(1, -1)
            req = GenerationRequest(prompt_ids=list(prompt.ids), positions_AP=positions,
                                    next_position=prompt.next_position if prompt.images else P,
                                    mm_inputs=dict(prompt.mm_inputs), sampling=s)
            gen = sample_responses(self.model, [req], pad_id=0, eos_token_ids=self.eos + p.stop_tokens,
                                   all_done=lambda done: done, decode=self.tokenizer.decode)[0]
            tokens = gen.token_ids
            logp = self._logprobs(prompt, tokens, 1.0)  # the model's own, like vLLM's raw_logprobs
            seqs.append({"tokens": tokens, "logprobs": logp[len(prompt.ids):].tolist() if tokens else [],
                         "stop_reason": gen.finish_reason})
        out: dict[str, Any] = {"sequences": seqs}
        if want_prompt:
            lp = self._logprobs(prompt, [], 1.0).tolist()
            out["prompt_logprobs"] = [None] + lp[1:]
        return out

    def _logprobs(self, prompt: Prompt, tokens: list[int], temperature: float) -> torch.Tensor:
        """logprob of ids[t] given ids[:t] for every t >= 1 of ids = prompt + tokens (index 0: a placeholder 0)."""
        from mmrl.trainer.batch import model_positions

        ids = prompt.ids + list(tokens)
        kwargs: dict[str, Any] = dict(prompt.mm_inputs)
        positions = full_positions(prompt, len(tokens))
        if positions is not None:
            kwargs["position_ids"] = model_positions(positions[:, None, :])
        logits = self.model(input_ids=torch.tensor([ids]), **kwargs).logits[0, :-1].float() / temperature
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).view(-1, 1)).squeeze(-1)
        return torch.cat([torch.zeros(1), lp])


class VllmSampler:
    def __init__(self, llm_kwargs: dict[str, Any], env: dict[str, str], base_fn: Callable[[], dict[str, torch.Tensor]]):
        from mmrl.rollout.engine import RolloutEngine

        self.engine = RolloutEngine(llm_kwargs, env, partial="wait")
        self.base_fn = base_fn
        self._base: dict[str, torch.Tensor] | None = None
        self.state = _Switching()
        self.version = 0

    async def start(self) -> None:
        await self.engine.ready()

    async def shutdown(self) -> None:
        await self.engine.shutdown()

    async def _load(self, deltas: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save as save_safetensors

        if self._base is None:
            self._base = await asyncio.to_thread(self.base_fn)
        # a switch also restores the layers the previous checkpoint changed and this one does not
        names = set(deltas) | self.state.base_names
        full = {k: self._base[k].contiguous() for k in names if k not in deltas}
        full.update(merged_state(self._base, deltas))
        await self.engine.stage_weights(save_safetensors(full))
        self.version += 1
        await self.engine.apply_weights(self.version)
        self.state.base_names = set(deltas)

    async def run(self, key: str, deltas_fn: Callable[[], dict[str, torch.Tensor]], prompt: Prompt,
                  n: int, params: SampleParams, prompt_logprobs: bool) -> dict[str, Any]:
        async with self.state.lock:
            if self.state.current != key:
                await self._load(deltas_fn())
                self.state.current = key
            final = None
            sp = sampling_params(n, params, prompt_logprobs)
            async for out in self.engine.llm.generate(prompt.engine_prompt(), sp,
                                                      request_id=f"tinker-{uuid.uuid4().hex[:12]}"):
                final = out
        return sequences_of(final, prompt_logprobs)


def sampling_params(n: int, params: SampleParams, prompt_logprobs: bool) -> Any:
    """vLLM's SamplingParams of a Tinker sample request (final output only)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(n=n, max_tokens=params.max_tokens, temperature=params.temperature,
                          top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else -1,
                          seed=params.seed, stop=params.stop_strs or None,
                          stop_token_ids=params.stop_tokens or None, logprobs=0,
                          logit_bias={t: -100.0 for t in params.forbidden} or None,
                          prompt_logprobs=0 if prompt_logprobs else None,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def sequences_of(final: Any, prompt_logprobs: bool) -> dict[str, Any]:
    """A Tinker sample result from vLLM's final RequestOutput."""
    seqs = []
    for c in sorted(final.outputs, key=lambda c: c.index):
        toks = list(c.token_ids)
        lps = [float(step[t].logprob) for t, step in zip(toks, c.logprobs or [])]
        seqs.append({"tokens": toks, "logprobs": lps,
                     "stop_reason": "length" if c.finish_reason == "length" else "stop"})
    result: dict[str, Any] = {"sequences": seqs}
    if prompt_logprobs:
        plp = final.prompt_logprobs or []
        # over the expanded prompt (vision tokens included), as Tinker counts an image chunk
        result["prompt_logprobs"] = [None if d is None else float(d[t].logprob)
                                     for t, d in zip(final.prompt_token_ids, plp)]
    return result
