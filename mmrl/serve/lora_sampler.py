"""`serve.vllm_lora: true`: one vLLM engine serves the sampling checkpoints side by side as vLLM
LoRA adapters (a `LoRARequest` per request) instead of merging one checkpoint into its weights at a
time (`VllmSampler`). Clients sampling different checkpoints share the engine's batches; no weight
switch, and no request waits for one.

vLLM 0.32, as measured by benchmarks/vllm_lora_probe.py and this module's test, and how it is handled:
- on CPU a request without an adapter batched with adapter requests gets the last adapter slot's
  weights (its slot index -1 reads the last slot): base-model requests carry an all-zero adapter;
- an adapter vLLM cannot load kills the engine when a request brings it: every adapter is loaded
  with `add_lora` first (at save, or at its first use after a restart), where a refusal is only an
  error for the client;
- `lm_head` adapters (the SDK's default `train_unembed=True`) are refused by vLLM's Qwen-VL classes,
  and declaring `lm_head` a LoRA module (a model subclass) breaks prompt logprobs: vLLM computes the
  prompt tokens' logits with one adapter index per request, not per token (batches of two or more
  requests fail). Such a checkpoint is saved as merged deltas like `VllmSampler`'s and sampled by
  loading them in place: its requests run alone on the engine, the others wait (`_WeightGate`).
"""
from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import torch

from mmrl.serve.inputs import Prompt
from mmrl.serve.sampler import SampleParams, VllmSampler, sampling_params, sequences_of
from mmrl.serve.trainer import UserInputError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's allowed max_lora_rank values
MAX_LORAS = 4  # adapters in one batch (vLLM's GPU/CPU slots); more wait for a slot
MAX_CPU_LORAS = 32  # adapters kept loaded; an evicted one is read again from its folder


def lora_engine_args(kwargs: dict[str, Any], max_rank: int, tower_connector: bool) -> dict[str, Any]:
    """vLLM's LoRA settings on top of the engine arguments (`rollout.engine_args` may override each)."""
    fits = [r for r in VLLM_LORA_RANKS if r >= max_rank]
    if not fits:
        raise ValueError(f"serve.max_lora_rank={max_rank} is above vLLM's largest LoRA rank "
                         f"({VLLM_LORA_RANKS[-1]}); lower it or set serve.vllm_lora=false")
    kwargs["enable_lora"] = True
    kwargs.setdefault("max_lora_rank", fits[0])
    kwargs.setdefault("max_loras", MAX_LORAS)
    kwargs.setdefault("max_cpu_loras", max(MAX_CPU_LORAS, kwargs["max_loras"]))
    if tower_connector:  # adapters on the vision tower / projector (serve.lora_vision / lora_projector)
        kwargs.setdefault("enable_tower_connector_lora", True)
    return kwargs


def write_peft_adapter(folder: Path, tensors: dict[str, torch.Tensor], rank: int, alpha: float,
                       model_path: str) -> None:
    """A peft adapter folder from a trainer's `adapter_state()` (peft parameter names:
    `<module>.lora_A.default.weight`; saved peft files drop the adapter name)."""
    from safetensors.torch import save_file

    weights = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."):
               v.detach().float().contiguous() for k, v in tensors.items()}
    modules = sorted({k.split(".lora_")[0].removeprefix("base_model.model.") for k in weights})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": modules,
              "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False,
              "modules_to_save": None, "fan_in_fan_out": False, "base_model_name_or_path": model_path}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / ADAPTER_WEIGHTS))
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1))


def write_zero_adapter(folder: Path, model_path: str, trust_remote_code: bool) -> None:
    """A rank-1 adapter with all-zero weights on one attention projection: the base model as an
    adapter (see the module docstring). Shapes from the model's layout, built on the meta device."""
    from mmrl.serve.trainer import lora_targets
    from mmrl.trainer.model_setup import model_skeleton

    skeleton = model_skeleton(model_path, trust_remote_code)
    name = lora_targets(skeleton, attn=True, mlp=False, unembed=False)[0]
    out_f, in_f = skeleton.get_submodule(name).weight.shape
    prefix = f"base_model.model.{name}"
    write_peft_adapter(folder, {f"{prefix}.lora_A.default.weight": torch.zeros(1, in_f),
                                f"{prefix}.lora_B.default.weight": torch.zeros(out_f, 1)}, 1, 1.0, model_path)


BASE = "base"  # the gate's name for the base weights (LoRA requests run on them)


class _WeightGate:
    """Who runs on the engine's weights: requests for the weights loaded now run together; a
    request for other weights waits until they drain, and holds back newcomers meanwhile (no
    starvation), then loads its own."""

    def __init__(self) -> None:
        self.cond = asyncio.Condition()
        self.current = BASE
        self.active = 0
        self.waiting: dict[str, int] = {}

    def _may_enter(self, want: str) -> bool:
        others_wait = any(n for k, n in self.waiting.items() if k != want)
        return self.active == 0 or (self.current == want and not others_wait)

    @asynccontextmanager
    async def use(self, want: str, load: Callable[[], Awaitable[None]]) -> AsyncIterator[None]:
        async with self.cond:
            self.waiting[want] = self.waiting.get(want, 0) + 1
            try:
                await self.cond.wait_for(lambda: self._may_enter(want))
                if self.current != want:
                    self.current = ""  # a load that fails midway leaves weights no request may trust
                    await load()  # nothing runs meanwhile: active == 0 and the lock is held
                    self.current = want
            finally:
                self.waiting[want] -= 1
                self.cond.notify_all()  # a failed load: the others may go on
            self.active += 1
        try:
            yield
        finally:
            async with self.cond:
                self.active -= 1
                self.cond.notify_all()


class LoraVllmSampler(VllmSampler):
    """mmrl's rollout engine with vLLM LoRA on. A checkpoint is a peft adapter folder (served as a
    LoRARequest on the base weights) or, with an lm_head adapter, a merged-deltas file (loaded in
    place, alone on the engine: see the module docstring)."""

    def __init__(self, llm_kwargs: dict[str, Any], env: dict[str, str], base_fn: Callable[[], dict[str, torch.Tensor]],
                 work_dir: Path, model_path: str, trust_remote_code: bool = False):
        super().__init__(llm_kwargs, env, base_fn)
        self.model_path, self.trust_remote_code = model_path, trust_remote_code
        self.adapters: dict[str, Any] = {}  # adapter folder -> its LoRARequest (loaded with add_lora)
        self.next_id = 1
        self.base: Any = None
        self.zero_folder = work_dir / f"base-zero-{uuid.uuid4().hex[:8]}"
        self.gate = _WeightGate()

    async def start(self) -> None:
        await self.engine.ready()
        await asyncio.to_thread(write_zero_adapter, self.zero_folder, self.model_path, self.trust_remote_code)
        self.base = await self.add(str(self.zero_folder), "the base model")

    async def shutdown(self) -> None:
        await self.engine.shutdown()
        shutil.rmtree(self.zero_folder, ignore_errors=True)

    async def add(self, folder: str, what: str) -> Any:
        """Load the adapter in `folder` into the engine (validated there: a refusal is a
        UserInputError naming `what`, and the engine keeps serving); its LoRARequest."""
        from vllm.lora.request import LoRARequest
        from vllm.v1.engine.exceptions import EngineDeadError

        if folder in self.adapters:
            return self.adapters[folder]
        if not (Path(folder) / ADAPTER_CONFIG).is_file():
            raise UserInputError(f"{what}: its adapter folder is missing ({folder})", "model_path")
        req = LoRARequest(f"mmrl-{self.next_id}", self.next_id, folder)
        self.next_id += 1
        try:
            await self.engine.llm.add_lora(req)
        except EngineDeadError:  # the server's failure, not the checkpoint's
            raise
        except Exception as e:  # noqa: BLE001 -- vLLM's refusal (rank, modules): the client's to see
            raise UserInputError(f"{what}: vLLM cannot load it as a LoRA adapter ({e})", "model_path") from None
        self.adapters[folder] = req
        return req

    async def run_checkpoint(self, key: str, file: str | None, what: str, prompt: Prompt, n: int,
                             params: SampleParams, prompt_logprobs: bool) -> dict[str, Any]:
        """Sample the base model (file None), an adapter folder, or a merged-deltas file."""
        from safetensors.torch import load_file

        if file is not None and not Path(file).is_dir():  # merged deltas: this checkpoint alone
            async def load() -> None:
                await self._load(await asyncio.to_thread(load_file, file))

            async with self.gate.use(key, load):
                return await self._generate(prompt, n, params, prompt_logprobs, None)
        req = self.base if file is None else await self.add(file, what)
        async with self.gate.use(BASE, lambda: self._load({})):
            return await self._generate(prompt, n, params, prompt_logprobs, req)

    async def _generate(self, prompt: Prompt, n: int, params: SampleParams, prompt_logprobs: bool,
                        req: Any) -> dict[str, Any]:
        final = None
        async for out in self.engine.llm.generate(prompt.engine_prompt(), sampling_params(n, params, prompt_logprobs),
                                                  request_id=f"tinker-{uuid.uuid4().hex[:12]}", lora_request=req):
            final = out
        return sequences_of(final, prompt_logprobs)
