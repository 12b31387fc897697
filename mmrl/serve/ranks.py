"""`serve.trainer: deepspeed`: one Tinker training client's LoRA on `trainer.world_size` DeepSpeed
ZeRO-3 ranks (Ray actors), set up with the pieces `mmrl train`'s ranks use (mmrl/trainer/worker.py).

`DeepSpeedLoraTrainer` (driver side) has LoraTrainer's interface, so the service only picks the
class. It checks every input itself before any rank works (a bad datum leaves the gradients as
they were), splits the datums into contiguous shares, one per rank, and gives every rank the same
number of micro-batch forwards: ZeRO-3 all-gathers parameters in each forward, so a rank short of
micro-batches runs zero-weighted fillers. Each rank's loss is multiplied by the world size, which
undoes DeepSpeed's averaging of gradients over ranks: the gradient is the SUM over datums, as in
LoraTrainer. Weights and AdamW state are gathered from (and scattered back into) the partitions
by parameter name, so a state checkpoint is the same files for both trainer kinds.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch

from mmrl.serve.trainer import (AdamStep, UserInputError, add_lora, batch_loss, checked_batch, datum_output,
                                lora_targets, micro_batches, prompt_logprobs)
from mmrl.trainer.deepspeed_config import build_deepspeed_config
from mmrl.trainer.worker import (join_process_group, leave_process_group, load_pretrained, open_rendezvous_store,
                                 prepare_rank_process, rendezvous_address, setup_ranks, vision_aligned)

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class RankSpec:
    """What a serve rank builds (picklable, sent once)."""

    model_path: str
    dtype: str
    world_size: int
    device: str  # cpu | cuda
    targets: list[str]  # full names of the adapted linear layers (lora_targets, on the driver)
    lora_rank: int
    alpha: float
    seed: int  # the adapter's initialisation: the same on every rank
    train_projector: bool
    train_vision: bool
    deepspeed: dict[str, Any]  # trainer.deepspeed, merged over mmrl's ZeRO-3 defaults
    env: dict[str, str]
    processor: str = "auto"
    trust_remote_code: bool = False


@dataclass
class RankWork:
    """One forward(_backward) call's share for one rank. `micro_batches` index `prompts`; None is a
    filler (a zero-weighted forward of prompts[0]). `indices` are the datums' places in the call."""

    indices: list[int]
    prompts: list[Any]
    targets: list[torch.Tensor]
    inputs: list[dict[str, torch.Tensor]]
    micro_batches: list[list[int] | None]
    loss_fn: str
    config: dict[str, Any]
    backward: bool
    loss_scale: float


class LoraRank:
    """One ZeRO-3 rank of one training client (a Ray actor). Every call is collective: the driver
    calls all ranks with the same method, in the same order."""

    def __init__(self, rank: int, spec: RankSpec):
        from mmrl.processors.base import processor_class

        self.rank, self.spec = rank, spec
        prepare_rank_process(rank, spec.world_size, spec.env, spec.device, spec.seed)
        self.adapter = processor_class(spec.processor, spec.model_path, spec.trust_remote_code)
        self.engine: Any = None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def open_rendezvous(self, *nodes: str) -> tuple[str, int]:  # as TrainerWorker's
        self._store = open_rendezvous_store(rendezvous_address(nodes), self.spec.world_size)
        return self._store.host, self._store.port

    def setup(self, rendezvous: tuple[str, int], *nodes: str) -> dict[str, Any]:
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        spec = self.spec
        join_process_group(self.rank, spec.world_size, rendezvous, spec.device, nodes, getattr(self, "_store", None))
        # clipping is per optim_step (the request's grad_clip_norm, set on the optimizer each step)
        ds_config = build_deepspeed_config(grad_clip=0.0, bf16=spec.dtype == "bfloat16", user=spec.deepspeed)
        self._hf_ds_config = HfDeepSpeedConfig(ds_config)  # alive while loading: zero.Init partitions
        model = add_lora(load_pretrained(spec.model_path, spec.dtype, spec.trust_remote_code), spec.targets,
                         rank=spec.lora_rank, alpha=spec.alpha, seed=spec.seed, train_projector=spec.train_projector,
                         train_vision=spec.train_vision)
        trainable = [p for p in model.parameters() if p.requires_grad]
        # hyperparameters are placeholders: every optim_step sets the request's
        optimizer = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        self.engine.train()
        return {"rank": self.rank, "trainable": sum(p.ds_numel for p in trainable)}

    # ---- forward / backward ------------------------------------------------------------------
    def forward_backward(self, work: RankWork) -> tuple[list[dict[str, np.ndarray]], float]:
        """(outputs of this rank's datums in order, their summed loss)."""
        outputs: list[dict[str, np.ndarray]] = [{} for _ in work.indices]
        total = 0.0
        for batch in work.micro_batches:
            run = batch if batch is not None else [0]
            prompts = [work.prompts[i] for i in run]
            mm_inputs = {k: v for p in prompts for k, v in p.mm_inputs.items()}  # only its keys matter
            with torch.set_grad_enabled(work.backward), vision_aligned(self.adapter, self.engine, mm_inputs):
                logps = prompt_logprobs(self.engine, prompts, [work.targets[i] for i in run])
            with torch.set_grad_enabled(work.backward):
                if batch is None:
                    loss = 0.0 * torch.stack([logp.sum() for logp in logps]).sum()
                else:
                    loss, losses = batch_loss(logps, [work.inputs[i] for i in run], [work.indices[i] for i in run],
                                              work.loss_fn, work.config)
                if work.backward:
                    self.engine.backward(loss * work.loss_scale, scale_wrt_gas=False)
            if batch is not None:
                total += float(loss.detach())
                for i, logp, loss_T in zip(batch, logps, losses):
                    outputs[i] = datum_output(logp, loss_T)
        return outputs, total

    def optim_step(self, step: AdamStep) -> float:
        """Apply the accumulated gradients with this call's hyperparameters; the gradient norm
        over all ranks before clipping (DeepSpeed's ZeRO-3 optimizer computes it and clips by
        `clip_grad`, read at each step)."""
        optimizer = self.engine.optimizer
        step.apply(optimizer.param_groups)
        optimizer.clip_grad = step.grad_clip_norm
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    # ---- weights and state (rank 0 returns what is gathered; the others None) -------------------
    def _lora_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.engine.module.named_parameters() if ".lora_" in n]

    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        import deepspeed

        named = self._lora_params()
        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            if self.rank == 0:
                return {n: p.detach().clone().contiguous() for n, p in named}
        return None

    def adapter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(p.ds_shape) for n, p in self._lora_params()}

    def merged_lora_deltas(self) -> dict[str, torch.Tensor] | None:
        import deepspeed

        from mmrl.serve.trainer import lora_deltas
        from mmrl.weight_sync.gather import weight_units

        units = [u for u in weight_units(self.engine.module) if u.lora_scaling is not None]
        with deepspeed.zero.GatheredParameters([p for u in units for p in u.params[1:3]], modifier_rank=None):
            if self.rank == 0:
                return lora_deltas(units)
        return None

    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None] | None:
        """AdamW's state as LoraTrainer.optimizer_state gives it: the moments gathered per
        parameter, the step (one per ZeRO sub-group, all equal) given to every parameter."""
        from deepspeed.utils import safe_get_full_optimizer_state

        inner = self.engine.optimizer.optimizer
        if not inner.state:
            return ({}, None) if self.rank == 0 else None
        step = next(iter(inner.state.values()))["step"]
        tensors: dict[str, torch.Tensor] = {}
        for name, p in self.engine.module.named_parameters():
            if not p.requires_grad:
                continue
            for key in ADAM_MOMENTS:
                full = safe_get_full_optimizer_state(p, key)  # collective
                tensors[f"{name}::{key}"] = full.detach().cpu().clone().contiguous()
            tensors[f"{name}::step"] = step.detach().cpu().clone()
        if self.rank != 0:
            return None
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in inner.param_groups[0].items()
                 if k != "params" and isinstance(v, (bool, int, float, str, tuple, type(None)))}
        return tensors, hyper

    def load_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set the LoRA weights in the model's partitions and in the optimizer's fp32 copy (which
        the next step writes back); drop the gradients accumulated so far."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param

        named = self._lora_params()
        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=0):
            if self.rank == 0:
                with torch.no_grad():
                    for n, p in named:
                        p.copy_(tensors[n].to(p.dtype))
        for n, p in named:
            if p.requires_grad:
                safe_set_full_fp32_param(p, tensors[n].float().to(p.device))
        # the next backward overwrites the partitioned gradients instead of adding to them
        self.engine.optimizer.zero_grad(set_to_none=True)

    def load_optimizer(self, tensors: dict[str, torch.Tensor] | None, hyper: dict[str, Any] | None) -> None:
        """AdamW's saved state, or with None none (the next step starts Adam anew, as a new optimizer)."""
        from deepspeed.utils import safe_set_full_optimizer_state

        zero = self.engine.optimizer
        zero.optimizer.state.clear()
        if tensors is None or hyper is None:
            return
        steps = [v for k, v in tensors.items() if k.endswith("::step")]
        step = steps[0].detach().float().cpu() if steps else torch.tensor(0.0)
        # the state AdamW creates at its first step, one per ZeRO sub-group, then filled in per parameter
        for flat in zero.fp32_partitioned_groups_flat:
            zero.optimizer.state[flat] = {"step": step.clone(), "exp_avg": torch.zeros_like(flat),
                                          "exp_avg_sq": torch.zeros_like(flat)}
        for name, p in self.engine.module.named_parameters():
            for key in ADAM_MOMENTS:
                if p.requires_grad and f"{name}::{key}" in tensors:
                    safe_set_full_optimizer_state(p, tensors[f"{name}::{key}"].float().to(p.device), key)
        AdamStep(float(hyper.get("lr", 1e-4)), tuple(hyper.get("betas", (0.9, 0.95))), float(hyper.get("eps", 1e-12)),
                 float(hyper.get("weight_decay", 0.0)), 0.0).apply(zero.param_groups)

    def shutdown(self) -> None:
        leave_process_group()


class DeepSpeedLoraTrainer:
    """LoraTrainer's interface (mmrl/serve/trainer.py) over `world_size` LoraRank actors."""

    def __init__(self, model_path: str, *, rank: int, alpha: float | None, seed: int | None,
                 train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True,
                 train_projector: bool = False, train_vision: bool = False, dtype: str = "float32",
                 trust_remote_code: bool = False, world_size: int = 2, device: str = "cpu",
                 deepspeed: dict[str, Any] | None = None, env: dict[str, str] | None = None, processor: str = "auto",
                 actor_options: dict[str, Any] | None = None):
        targets, self.vocab_size = _layout(model_path, trust_remote_code, attn=train_attn, mlp=train_mlp,
                                           unembed=train_unembed, projector=train_projector, vision=train_vision)
        if not targets:
            raise UserInputError("lora_config: train_attn, train_mlp and train_unembed leave no layer to adapt",
                                 "lora_config")
        self.rank, self.alpha = rank, float(alpha if alpha is not None else rank)
        self.world_size, self.device, self.steps = world_size, device, 0
        self._has_gradients = False  # a backward ran since the last step or load
        self.rendezvous: tuple[str, int] | None = None
        spec = RankSpec(model_path=model_path, dtype=dtype, world_size=world_size, device=device, targets=targets, lora_rank=rank, alpha=self.alpha,
                        seed=seed if seed is not None else random.getrandbits(31), train_projector=train_projector,
                        train_vision=train_vision, deepspeed=dict(deepspeed or {}), env=dict(env or {}),
                        processor=processor, trust_remote_code=trust_remote_code)
        options = actor_options if actor_options is not None else _default_actor_options(device)
        actor = ray.remote(LoraRank)
        self.ranks = [actor.options(**options).remote(r, spec) for r in range(world_size)]
        try:
            setups, rendezvous = setup_ranks(self.ranks)
            self.rendezvous = tuple(ray.get(rendezvous))
            ray.get(setups)
        except BaseException:
            self.close()
            raise

    def _all(self, method: str, *args: Any) -> list[Any]:
        return ray.get([getattr(r, method).remote(*args) for r in self.ranks])

    # ---- forward / backward ------------------------------------------------------------------
    def forward_backward(self, prompts: list[Any], data: list[dict[str, np.ndarray]], loss_fn: str,
                         config: dict[str, Any], backward: bool) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        targets, inputs = checked_batch(prompts, data, loss_fn, config, self.vocab_size)
        shares = [list(s) for s in np.array_split(np.arange(len(data)), self.world_size)]
        plans = [micro_batches([prompts[i] for i in share]) if share else [] for share in shares]
        n_forwards = max(len(plan) for plan in plans)
        works = []
        for share, plan in zip(shares, plans):
            datums = share or [0]  # a rank with no datum runs fillers of the first one
            works.append(RankWork(
                indices=[int(i) for i in share],
                prompts=[dataclasses.replace(prompts[i], images=[], engine_ids=[]) for i in datums],  # no PIL pickling
                targets=[targets[i] for i in datums], inputs=[inputs[i] for i in datums],
                micro_batches=list(plan) + [None] * (n_forwards - len(plan)), loss_fn=loss_fn, config=config,
                backward=backward, loss_scale=float(self.world_size)))
        results = ray.get([r.forward_backward.remote(w) for r, w in zip(self.ranks, works)])
        outputs: list[dict[str, np.ndarray]] = [{} for _ in data]
        total = 0.0
        for share, (rank_outputs, loss) in zip(shares, results):
            for i, out in zip(share, rank_outputs):
                outputs[i] = out
            total += loss
        self._has_gradients = self._has_gradients or backward
        return outputs, {"loss:sum": total}

    def optim_step(self, adam: dict[str, Any]) -> dict[str, float]:
        step = AdamStep.from_params(adam)
        # no gradient: LoraTrainer's AdamW skips every parameter; ZeRO-3 would step on stale buffers
        norm = self._all("optim_step", step)[0] if self._has_gradients else 0.0
        self._has_gradients = False
        self.steps += 1
        return {"grad_norm": norm, "learning_rate": step.lr}

    # ---- weights and training state -----------------------------------------------------------
    def adapter_state(self) -> dict[str, torch.Tensor]:
        return self._all("adapter_state")[0]

    def merged_lora_deltas(self) -> dict[str, torch.Tensor]:
        return self._all("merged_lora_deltas")[0]

    def adapter_shapes(self) -> dict[str, tuple[int, ...]]:
        return ray.get(self.ranks[0].adapter_shapes.remote())

    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        return self._all("optimizer_state")[0]

    def load_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        ref = ray.put(tensors)
        self._all("load_adapter", ref)
        self._has_gradients = False

    def load_optimizer(self, tensors: dict[str, torch.Tensor] | None, hyper: dict[str, Any] | None) -> None:
        self._all("load_optimizer", None if tensors is None else ray.put(tensors), hyper)

    def close(self) -> None:
        """Kill the ranks (their processes, memory and process group go with them) and remove
        their shared-memory all-reduce buffers."""
        from mmrl.utils.env import cleanup_shm

        for r in self.ranks:
            ray.kill(r, no_restart=True)
        self.ranks = []
        if self.device == "cpu" and self.rendezvous is not None:
            cleanup_shm(*self.rendezvous, orphans=False)


def _layout(model_path: str, trust_remote_code: bool, **parts: bool) -> tuple[list[str], int]:
    """(the layers that get an adapter, the vocabulary size), read from the model's structure on
    the meta device: no weights are loaded in the driver."""
    from mmrl.trainer.model_setup import model_skeleton

    skeleton = model_skeleton(model_path, trust_remote_code)
    return lora_targets(skeleton, **parts), int(skeleton.get_output_embeddings().weight.shape[0])


def _default_actor_options(device: str) -> dict[str, Any]:
    # No CPU reservation: each client's ranks are a group of their own, and reserving cores would
    # leave a later client's ranks pending forever once the cores are spoken for.
    return {"num_cpus": 0, "num_gpus": 1} if device == "cuda" else {"num_cpus": 0}
