"""The engines behind the API: training clients (one `LoraTrainer` each), the sampler, and the
checkpoints that connect them (files under `serve.store_dir`, rows in the store)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from mmrl.config.schema import Config
from mmrl.serve.futures import FutureQueue, JobError
from mmrl.serve.inputs import Prompt
from mmrl.serve.sampler import HfSampler, SampleParams, VllmSampler
from mmrl.serve.store import Store
from mmrl.serve.trainer import LoraTrainer, UserInputError

TINKER = "tinker://"


class NotFound(Exception):
    """An id or path the caller does not own or that does not exist (answered 404 naming `field`)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class Service:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.model_path = str(Path(cfg.model.path).resolve())
        self.model_name = cfg.serve.model_name or cfg.model.path
        self.store_dir = Path(cfg.serve.store_dir).resolve()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(cfg.serve.db_url or f"sqlite:///{self.store_dir / 'serve.db'}")
        failed = self.store.fail_pending("the server stopped before this request finished")
        self.recovered_failed = failed
        self.queue: FutureQueue | None = None
        self.trainers: dict[str, LoraTrainer] = {}
        self.sampler: Any = None
        self.processor = self._processor()
        pads = [getattr(self.processor, k, None) for k in ("image_token_id", "video_token_id")]
        self.forbidden_tokens = [int(t) for t in pads if t is not None]

    def _processor(self) -> Any:
        """The model family's processor adapter (image chunks); None for a model without one."""
        from mmrl.processors import build_processor

        cfg = self.cfg
        try:
            return build_processor(cfg.processor.name, self.model_path, min_pixels=cfg.processor.min_pixels,
                                   max_pixels=cfg.processor.max_pixels, max_prompt_tokens=cfg.processor.max_prompt_tokens,
                                   trust_remote_code=cfg.model.trust_remote_code)
        except Exception:  # a text-only model: image chunks are refused with a 400
            return None

    async def start(self) -> None:
        self.queue = FutureQueue(self.store)
        if self.cfg.serve.sampler.value == "trainer":
            self.sampler = await self.queue.in_thread(
                lambda: HfSampler(self.model_path, self.cfg.model.dtype.value, self.cfg.model.trust_remote_code))
        else:
            self.sampler = VllmSampler(self._engine_kwargs(), self._engine_env(), self._base_state)
        await self.sampler.start()

    async def stop(self) -> None:
        if self.sampler is not None:
            await self.sampler.shutdown()
        if self.queue is not None:
            await self.queue.close()

    # ---- vLLM engine settings (as `mmrl train` builds them) ---------------------------------------
    def _engine_env(self) -> dict[str, str]:
        from mmrl.utils.env import apply_env, engine_env, resolve_device

        env = engine_env(self.store_dir, resolve_device(self.cfg.cluster.device.value),
                         {"VLLM_LOGGING_LEVEL": "WARNING", **self.cfg.rollout.engine_env})
        apply_env(env)
        return env

    def _engine_kwargs(self) -> dict[str, Any]:
        from mmrl.rollout.engine import cpu_engine_defaults, engine_kwargs
        from mmrl.utils.env import resolve_device

        cfg = self.cfg
        kwargs = engine_kwargs(self.model_path, cfg.model.dtype.value, cfg.run.seed, cfg.rollout.engine_args,
                               min_pixels=cfg.processor.min_pixels, max_pixels=cfg.processor.max_pixels)
        kwargs.setdefault("trust_remote_code", cfg.model.trust_remote_code)
        # Tinker's compute_logprobs scores the model itself, not a temperature-scaled distribution
        kwargs["logprobs_mode"] = cfg.rollout.engine_args.get("logprobs_mode", "raw_logprobs")
        if resolve_device(cfg.cluster.device.value) == "cpu":
            cpu_engine_defaults(kwargs)
            kwargs.setdefault("enable_chunked_prefill", False)  # per-request seeds (see RolloutEngine)
        return kwargs

    def _base_state(self) -> dict[str, torch.Tensor]:
        from transformers import AutoModelForImageTextToText

        m = AutoModelForImageTextToText.from_pretrained(self.model_path, dtype=torch.float32,
                                                        trust_remote_code=self.cfg.model.trust_remote_code)
        return {k: v.detach() for k, v in m.state_dict().items()}

    # ---- names ----------------------------------------------------------------------------------
    def check_base_model(self, name: str, field: str = "base_model") -> None:
        if name not in (self.model_name, self.model_path, self.cfg.model.path):
            raise UserInputError(f"{field} {name!r} is not served here; this server serves {self.model_name!r}",
                                 field)

    def info(self, owner: str, model_id: str) -> dict[str, Any]:
        row = self.store.model(owner, model_id)
        if row is None:
            raise NotFound(f"model_id {model_id!r} not found", "model_id")
        return {"type": "get_info", "model_id": model_id,
                "model_data": {"arch": "lora", "model_name": self.model_name, "tokenizer_id": self.model_path},
                "is_lora": True, "lora_rank": row["lora_rank"]}

    def trainer(self, owner: str, model_id: str) -> LoraTrainer:
        row = self.store.model(owner, model_id)
        if row is None or row["status"] == "unloaded":
            raise NotFound(f"model_id {model_id!r} not found", "model_id")
        return self.trainers[model_id] if model_id in self.trainers else self._missing(model_id, row)

    def _missing(self, model_id: str, row: dict[str, Any]) -> LoraTrainer:
        if row["status"] == "creating":
            raise UserInputError(f"model_id {model_id!r} is still being created", "model_id")
        raise NotFound(f"model_id {model_id!r} is not loaded in this server (created before a restart; "
                       f"load_state is not implemented yet)", "model_id")

    # ---- jobs -----------------------------------------------------------------------------------
    async def create_model(self, model_id: str, lora: dict[str, Any]) -> dict[str, Any]:
        cfg = self.cfg
        trainer = await self.queue.in_thread(lambda: LoraTrainer(
            self.model_path, rank=int(lora["rank"]), alpha=cfg.serve.lora_alpha, seed=lora.get("seed"),
            train_attn=lora.get("train_attn", True), train_mlp=lora.get("train_mlp", True),
            train_unembed=lora.get("train_unembed", True), dtype=cfg.model.dtype.value,
            trust_remote_code=cfg.model.trust_remote_code))
        self.trainers[model_id] = trainer
        self.store.set_model_status(model_id, "ready")
        return {"type": "create_model", "model_id": model_id}

    async def save_for_sampler(self, owner: str, model_id: str, name: str | None) -> dict[str, Any]:
        trainer = self.trainer(owner, model_id)
        ephemeral = name is None
        if ephemeral:
            name = f"ephemeral-{len(self.store.list_checkpoints(owner, model_id)):06d}"
        if "/" in name or name.startswith("."):
            raise JobError(f"path {name!r}: a checkpoint name may not contain '/' or start with '.'")
        deltas = await self.queue.in_thread(trainer.merged_lora_deltas)
        folder = self.store_dir / "checkpoints" / model_id / "sampler_weights"
        folder.mkdir(parents=True, exist_ok=True)
        file = folder / f"{name}.safetensors"
        from safetensors.torch import save_file

        tmp = file.with_suffix(".tmp")
        save_file(deltas, str(tmp))
        os.replace(tmp, file)
        path = f"{TINKER}{model_id}/sampler_weights/{name}"
        self.store.add_checkpoint(owner, path, model_id, "sampler", name, str(file))
        out: dict[str, Any] = {"type": "save_weights_for_sampler", "path": path}
        if ephemeral:
            out["sampling_session_id"] = self.store.add_sampling_session(owner, path, self.model_name)
        return out

    def sampling_target(self, owner: str, sampling_session_id: str | None, model_path: str | None,
                        base_model: str | None) -> tuple[str, str | None]:
        """(sampler key, checkpoint file or None for the base model) of a sample request."""
        if sampling_session_id:
            row = self.store.sampling_session(owner, sampling_session_id)
            if row is None:
                raise NotFound(f"sampling_session_id {sampling_session_id!r} not found", "sampling_session_id")
            if row["checkpoint"] is None:
                return "base", None
            model_path = row["checkpoint"]
        if model_path:
            ck = self.store.checkpoint(owner, model_path)
            if ck is None:
                raise NotFound(f"model_path {model_path!r} not found", "model_path")
            # keyed by save time too: a name saved again holds new weights
            return f"{model_path}@{ck['created']}", ck["file"]
        if base_model is None:
            raise UserInputError("one of sampling_session_id, model_path or base_model is required", "base_model")
        self.check_base_model(base_model)
        return "base", None

    async def sample(self, key: str, file: str | None, prompt: Prompt, n: int, params: SampleParams,
                     prompt_logprobs: bool) -> dict[str, Any]:
        def deltas() -> dict[str, torch.Tensor]:
            if file is None:
                return {}
            from safetensors.torch import load_file

            return load_file(file)

        return await self.sampler.run(key, deltas, prompt, n, params, prompt_logprobs)

    def model_config_json(self, lora: dict[str, Any]) -> str:
        return json.dumps({"lora": lora})
