"""The engines behind the API: training clients (one trainer each: `LoraTrainer` in this process, or
with `serve.trainer: deepspeed` a `DeepSpeedLoraTrainer` on ZeRO-3 ranks), the sampler, and the
checkpoints that connect them (files under `serve.store_dir`, rows in the store)."""
from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import torch

from mmrl.config.schema import Config
from mmrl.serve import state
from mmrl.serve.futures import FutureQueue, JobError
from mmrl.serve.inputs import Prompt
from mmrl.serve.sampler import HfSampler, SampleParams, VllmSampler
from mmrl.serve.store import ServerHeartbeat, Store
from mmrl.serve.trainer import LoraTrainer, UserInputError
from mmrl.utils.signals import reclaim_sigterm

if TYPE_CHECKING:
    from mmrl.serve.ranks import DeepSpeedLoraTrainer

# the two trainer kinds (serve.trainer) have the same methods
Trainer = Union[LoraTrainer, "DeepSpeedLoraTrainer"]
TINKER = state.TINKER
log = logging.getLogger("mmrl.serve")


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
        self.heartbeat = ServerHeartbeat(self.store)  # this process's id and row in `servers`
        self.server_id = self.heartbeat.server_id
        self.recovered_failed = 0
        self.queue: FutureQueue | None = None
        self.trainers: dict[str, Trainer] = {}
        self.started_ray = False  # this server started Ray for its trainer ranks (and stops it)
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
        try:
            self._join_servers()
            self.queue = FutureQueue(self.store, self.server_id)
            if self.cfg.serve.trainer.value == "deepspeed":
                await self.queue.in_thread(self._start_ray)
                reclaim_sigterm()  # the server's (uvicorn's) handler again, on the event loop's thread
            if self.cfg.serve.sampler.value == "trainer":
                self.sampler = await self.queue.in_thread(
                    lambda: HfSampler(self.model_path, self.cfg.model.dtype.value, self.cfg.model.trust_remote_code))
            elif self.cfg.serve.vllm_lora:
                from mmrl.serve.lora_sampler import LoraVllmSampler, lora_engine_args

                serve = self.cfg.serve
                kwargs = lora_engine_args(self._engine_kwargs(), serve.max_lora_rank,
                                          serve.lora_projector or serve.lora_vision)
                self.sampler = LoraVllmSampler(kwargs, self._engine_env(), self._base_state, self._lora_dir(),
                                               self.model_path, self.cfg.model.trust_remote_code)
            else:
                self.sampler = VllmSampler(self._engine_kwargs(), self._engine_env(), self._base_state)
            await self.sampler.start()
        except BaseException:  # no stop() follows a failed start: stop beating, or this server looks live
            self.heartbeat.stop()
            raise

    def _join_servers(self) -> None:
        """Register this server (heartbeat thread started), then clean up after servers that died:
        their pending futures failed, their partial saves swept. Live servers sharing the database
        and store_dir keep theirs."""
        self.heartbeat.start()
        self.recovered_failed = self.store.fail_abandoned()
        swept = state.sweep_partial(self.store_dir / "checkpoints", self.store.live_servers())
        log.info("server %s: %d requests of stopped servers failed, %d partial saves swept", self.server_id,
                 self.recovered_failed, swept)

    def _start_ray(self) -> None:
        """Ray for the trainer ranks (serve.trainer: deepspeed), as `mmrl train` starts it; started
        on a worker thread, so Ray does not take over the server's signal handlers."""
        import ray

        from mmrl.utils.env import init_local_ray

        if ray.is_initialized():  # a caller's (a test's, an embedding program's) Ray
            return
        cfg = self.cfg
        if cfg.cluster.ray_address:
            ray.init(address=cfg.cluster.ray_address, runtime_env={"env_vars": self._rank_env()})
        else:
            init_local_ray(num_cpus=cfg.cluster.num_cpus or os.cpu_count(), include_dashboard=False,
                           runtime_env={"env_vars": self._rank_env()}, log_to_driver=True)
        self.started_ray = True

    def _rank_env(self) -> dict[str, str]:
        from mmrl.utils.env import engine_env, resolve_device

        return engine_env(self.store_dir, resolve_device(self.cfg.cluster.device.value))

    async def stop(self) -> None:
        if self.sampler is not None:
            await self.sampler.shutdown()
        if self.queue is not None:
            await self.queue.close()
        for model_id in list(self.trainers):  # the ranks of every training client
            self.trainers.pop(model_id).close()
        if self.started_ray:
            import ray

            from mmrl.utils.env import cleanup_shm

            ray.shutdown()
            cleanup_shm()  # buffers no process holds any more (ranks that died on their own)
        self.heartbeat.stop()  # after the queue: the requests it did not finish are failed

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

    def _lora_dir(self) -> Path:
        """Where the sampler writes its scratch adapter (the base model's zero adapter; a name of
        its own per server, removed at shutdown)."""
        folder = self.store_dir / "lora"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

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

    def trainer(self, owner: str, model_id: str) -> Trainer:
        row = self.store.model(owner, model_id)
        if row is None or row["status"] == "unloaded":
            raise NotFound(f"model_id {model_id!r} not found", "model_id")
        return self.trainers[model_id] if model_id in self.trainers else self._missing(model_id, row)

    def _missing(self, model_id: str, row: dict[str, Any]) -> Trainer:
        if row["status"] == "creating":
            raise UserInputError(f"model_id {model_id!r} is still being created", "model_id")
        raise NotFound(f"model_id {model_id!r} is not loaded in this server (created before a restart); resume it "
                       f"from a saved state: ServiceClient.create_training_client_from_state_with_optimizer("
                       f"'tinker://{model_id}/weights/<name>')", "model_id")

    # ---- jobs -----------------------------------------------------------------------------------
    def _build_trainer(self, lora: dict[str, Any], alpha: float | None) -> Trainer:
        cfg = self.cfg
        kwargs: dict[str, Any] = dict(
            rank=int(lora["rank"]), alpha=alpha, seed=lora.get("seed"),
            train_attn=lora.get("train_attn", True), train_mlp=lora.get("train_mlp", True),
            train_unembed=lora.get("train_unembed", True), train_projector=cfg.serve.lora_projector,
            train_vision=cfg.serve.lora_vision, dtype=cfg.model.dtype.value,
            trust_remote_code=cfg.model.trust_remote_code)
        if cfg.serve.trainer.value == "local":
            return LoraTrainer(self.model_path, **kwargs)
        from mmrl.serve.ranks import DeepSpeedLoraTrainer
        from mmrl.utils.env import resolve_device

        return DeepSpeedLoraTrainer(self.model_path, world_size=cfg.trainer.world_size,
                                    device=resolve_device(cfg.cluster.device.value),
                                    deepspeed=dict(cfg.trainer.deepspeed), env=self._rank_env(),
                                    processor=cfg.processor.name, **kwargs)

    def unload(self, model_id: str) -> None:
        """Drop the model's trainer (with serve.trainer=deepspeed its ranks are killed); its row says
        unloaded (its checkpoints stay)."""
        trainer = self.trainers.pop(model_id, None)
        if trainer is not None:
            trainer.close()
        self.store.set_model_status(model_id, "unloaded")

    async def create_model(self, model_id: str, lora: dict[str, Any]) -> dict[str, Any]:
        trainer = await self.queue.in_thread(self._build_trainer, lora, self.cfg.serve.lora_alpha)
        self.trainers[model_id] = trainer
        self.store.set_model_status(model_id, "ready")
        return {"type": "create_model", "model_id": model_id}

    # ---- training state (save_state / load_state; files: mmrl/serve/state.py) ---------------------
    def state_checkpoint(self, owner: str, path: Any) -> dict[str, Any]:
        """The owner's state checkpoint row at `path`: 400 for a malformed or sampler path, 404 for
        one this key does not have."""
        parsed = state.parse_path(path)
        row = self.store.checkpoint(owner, parsed.path)
        if row is None:
            raise NotFound(f"checkpoint {path!r} not found", "path")
        if row["kind"] != "state":
            raise UserInputError(f"path {path!r} holds sampler weights; loading a training state takes a "
                                 f"tinker://<training_run_id>/weights/<name> path from save_state", "path")
        return row

    async def save_state(self, owner: str, model_id: str, name: str, overwrite: bool,
                         user_metadata: dict[str, Any] | None) -> dict[str, Any]:
        path = f"{TINKER}{model_id}/weights/{name}"
        if not overwrite and self.store.checkpoint(owner, path) is not None:  # another save queued first
            raise JobError(f"checkpoint {path!r} already exists (save_state(..., overwrite=True) replaces it)")
        try:
            trainer = self.trainer(owner, model_id)
        except NotFound as e:  # unloaded while this call waited in the queue
            raise JobError(str(e)) from None
        lora = json.loads(self.store.model(owner, model_id)["config_json"]).get("lora", {})
        meta = {"base_model": self.model_name, "lora": lora, "alpha": trainer.alpha}
        root = self.store_dir / "checkpoints" / model_id / "weights"
        folder, size = await self.queue.in_thread(state.write_state, trainer, root, name, meta, self.server_id)
        old = self.store.add_checkpoint(owner, path, model_id, "state", name, str(folder), size,
                                        json.dumps(user_metadata) if user_metadata else None)
        if old is not None and old["file"] != str(folder):
            state.remove_files(old["file"])
        return {"type": "save_weights", "path": path}

    async def load_state(self, owner: str, model_id: str, path: str, with_optimizer: bool) -> dict[str, Any]:
        try:  # checked when the call came; checked again here: a delete may have been queued since
            trainer, row = self.trainer(owner, model_id), self.state_checkpoint(owner, path)
            await self.queue.in_thread(state.load_state, trainer, row["file"], path, with_optimizer)
        except (UserInputError, NotFound) as e:
            raise JobError(str(e)) from None
        return {"type": "load_weights", "path": path, "model_id": model_id}

    def state_lora(self, row: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
        """(LoRA config, alpha) a state checkpoint was trained with; 400 if its base model is not
        the one served here."""
        try:
            meta = state.read_meta(row["file"])
        except FileNotFoundError:
            raise NotFound(f"checkpoint {row['path']!r}: its files are missing from the store ({row['file']})",
                           "path") from None
        if meta.get("base_model") not in (self.model_name, self.model_path, self.cfg.model.path):
            raise UserInputError(f"path {row['path']!r} was trained on {meta.get('base_model')!r}; this server "
                                 f"serves {self.model_name!r}", "path")
        return meta["lora"], meta.get("alpha")

    async def create_from_state(self, owner: str, model_id: str, path: str, with_optimizer: bool) -> dict[str, Any]:
        try:
            row = self.state_checkpoint(owner, path)
            lora, alpha = self.state_lora(row)
            trainer = await self.queue.in_thread(self._build_trainer, lora, alpha)
        except (UserInputError, NotFound) as e:
            self.store.set_model_status(model_id, "failed")
            raise JobError(str(e)) from None
        try:
            await self.queue.in_thread(state.load_state, trainer, row["file"], path, with_optimizer)
        except BaseException as e:
            trainer.close()  # its ranks, if any, go with it
            if isinstance(e, (UserInputError, NotFound)):
                self.store.set_model_status(model_id, "failed")
                raise JobError(str(e)) from None
            raise
        self.trainers[model_id] = trainer
        self.store.set_model_status(model_id, "ready")
        return {"type": "load_weights", "path": path, "model_id": model_id}

    def delete_checkpoint(self, owner: str, model_id: str, checkpoint_id: str) -> None:
        path = f"{TINKER}{model_id}/{checkpoint_id}"
        state.parse_path(path, "checkpoint_id")
        row = self.store.delete_checkpoint(owner, path)
        if row is None:
            raise NotFound(f"checkpoint {path!r} not found", "checkpoint_id")
        state.remove_files(row["file"])  # after the row is gone: a kill here leaves only unlisted files

    async def save_for_sampler(self, owner: str, model_id: str, name: str | None) -> dict[str, Any]:
        trainer = self.trainer(owner, model_id)
        ephemeral = name is None
        if ephemeral:
            # unique, not a count: after a delete a count would name (and overwrite) a live checkpoint
            name = f"ephemeral-{uuid.uuid4().hex[:12]}"
        try:
            state.check_name(name)
        except UserInputError as e:  # in a job: the future fails with the message
            raise JobError(str(e)) from None
        folder = self.store_dir / "checkpoints" / model_id / "sampler_weights"
        folder.mkdir(parents=True, exist_ok=True)
        path = f"{TINKER}{model_id}/sampler_weights/{name}"
        lm_head = self.cfg.serve.vllm_lora and any(
            ".lm_head." in k for k in await self.queue.in_thread(trainer.adapter_shapes))
        if self.cfg.serve.vllm_lora and not lm_head:
            file, size = await self._save_adapter(trainer, folder, name, path)
        else:  # merged deltas (with serve.vllm_lora: an lm_head adapter, which vLLM cannot serve)
            deltas = await self.queue.in_thread(trainer.merged_lora_deltas)
            file = folder / f"{name}.safetensors"
            from safetensors.torch import save_file

            tmp = file.with_suffix(".tmp")
            save_file(deltas, str(tmp))
            os.replace(tmp, file)
            size = file.stat().st_size
        old = self.store.add_checkpoint(owner, path, model_id, "sampler", name, str(file), size)
        if old is not None and old["file"] != str(file):
            state.remove_files(old["file"])
        out: dict[str, Any] = {"type": "save_weights_for_sampler", "path": path}
        if ephemeral:
            out["sampling_session_id"] = self.store.add_sampling_session(owner, path, self.model_name)
        return out

    async def _save_adapter(self, trainer: Trainer, root: Path, name: str, path: str) -> tuple[Path, int]:
        """serve.vllm_lora: the checkpoint as a peft adapter folder, loaded into the engine now so a
        bad one fails this save (a failed future naming the checkpoint), never a later sample.
        A new folder per save: an adapter vLLM evicted is read again from its folder, which a
        later save under the same name must not have changed."""
        from mmrl.serve.lora_sampler import write_peft_adapter

        folder = root / f"{name}.lora-{uuid.uuid4().hex[:8]}"
        tensors = await self.queue.in_thread(trainer.adapter_state)
        await self.queue.in_thread(write_peft_adapter, folder, tensors, trainer.rank, trainer.alpha, self.model_path)
        try:
            await self.sampler.add(str(folder), f"checkpoint {path!r}")
        except UserInputError as e:
            state.remove_files(str(folder))
            raise JobError(str(e)) from None
        return folder, sum(f.stat().st_size for f in folder.iterdir())

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
            if ck["kind"] != "sampler":
                raise UserInputError(f"model_path {model_path!r} is a training state (save_state); sample from "
                                     f"a save_weights_for_sampler path (.../sampler_weights/<name>)", "model_path")
            # keyed by save time too: a name saved again holds new weights
            return f"{model_path}@{ck['created']}", ck["file"]
        if base_model is None:
            raise UserInputError("one of sampling_session_id, model_path or base_model is required", "base_model")
        self.check_base_model(base_model)
        return "base", None

    async def sample(self, key: str, file: str | None, prompt: Prompt, n: int, params: SampleParams,
                     prompt_logprobs: bool) -> dict[str, Any]:
        if self.cfg.serve.vllm_lora:  # an adapter rides on its requests; merged deltas load in place
            try:
                return await self.sampler.run_checkpoint(key, file, f"checkpoint {key.rsplit('@', 1)[0]!r}",
                                                         prompt, n, params, prompt_logprobs)
            except UserInputError as e:
                raise JobError(str(e)) from None

        def deltas() -> dict[str, torch.Tensor]:
            if file is None:
                return {}
            from safetensors.torch import load_file

            return load_file(file)

        return await self.sampler.run(key, deltas, prompt, n, params, prompt_logprobs)

    def model_config_json(self, lora: dict[str, Any], user_metadata: dict[str, Any] | None = None) -> str:
        return json.dumps({"lora": lora, "user_metadata": user_metadata})
