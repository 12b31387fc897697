"""One DeepSpeed ZeRO-3 rank, living in a Ray actor.

All ranks receive the same calls in the same order (train_step, sync_weights, ...): each one
contains collectives (parameter all-gathers, gradient reduce-scatters) that every rank must
enter. The controller splits the batch so that all ranks run the same number of micro-batches.
"""
from __future__ import annotations

import os
import random
import time
import warnings
from contextlib import contextmanager, nullcontext
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import ray
import torch

from mmrl.trainer.batch import TrainSequence, collate, resolve_prompts
from mmrl.trainer.deepspeed_config import build_deepspeed_config
from mmrl.trainer.generate import GenerationRequest
from mmrl.trainer.model_setup import checkpointing_paused, enable_gradient_checkpointing, freeze_vision
from mmrl.trainer.plan import StepInputs, filler_for
from mmrl.trainer.routing_replay import RoutingReplay, replay_rows
from mmrl.trainer.update import SUM_KEYS, LossSettings, micro_batch_loss


@dataclass
class TrainerSpec:
    """Everything a rank needs to build itself (picklable, sent once)."""

    model_path: str
    dtype: str
    world_size: int
    device: str  # "cpu" | "cuda"
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    grad_clip: float
    deepspeed: dict[str, Any]
    temperature: float
    forbidden_token_ids: list[int]
    pad_token_id: int
    loss: LossSettings
    seed: int
    env: dict[str, str]
    trust_remote_code: bool = False
    reference_model: bool = False  # load a frozen reference policy (KL); with LoRA: adapters off
    lora: dict[str, Any] | None = None  # {rank, alpha, dropout, target_modules}; None = full fine-tuning
    padding_free: bool = False  # micro-batches as one packed row (trainer.padding_free)
    processor: str = "auto"  # the family adapter (processor.name): its class hooks run the vision tower
    # trainer.freeze_vision_tower / freeze_projector / gradient_checkpointing (trainer/model_setup.py)
    freeze_vision_tower: bool = False
    freeze_projector: bool = False
    gradient_checkpointing: bool = False
    # cluster.colocate: the rank's GPU is shared with an engine, which wakes up once the update is
    # over: the allocator's cached blocks (activations, logits) go back to the GPU after each update
    release_cache_after_update: bool = False
    # algorithm.routing_replay (MoE models): "rollout" replays the engine's routed experts
    routing_replay: str = "off"


class TrainerWorker:
    def __init__(self, rank: int, spec: TrainerSpec):
        self.rank, self.spec = rank, spec
        prepare_rank_process(rank, spec.world_size, spec.env, spec.device, spec.seed + rank)
        self.engine: Any = None
        from mmrl.processors.base import processor_class

        self.adapter = processor_class(spec.processor, spec.model_path, spec.trust_remote_code)
        # sequence uid -> {"old_logprobs": [...], "ref_logprobs": [...]}: computed by keep_logprobs
        # for this rank's share of the next update, consumed by train_step
        self._kept: dict[int, dict[str, list[float]]] = {}

    def node_id(self) -> str:
        """The Ray node this rank runs on (rank 0 picks the rendezvous address from them all)."""
        return ray.get_runtime_context().get_node_id()

    def open_rendezvous(self, *nodes: str) -> tuple[str, int]:
        """Rank 0: listen for the other ranks on a port the kernel picks in this process, and
        return (address, port). A port picked elsewhere and bound here later can be taken in
        between (Ray starts workers and servers meanwhile): the run then died with EADDRINUSE.
        `nodes`: every rank's node id (`node_id`), for the address (`rendezvous_address`)."""
        assert self.rank == 0, "the rendezvous is rank 0's"
        self._store = open_rendezvous_store(rendezvous_address(nodes), self.spec.world_size)
        return self._store.host, self._store.port

    def setup(self, rendezvous: tuple[str, int], *nodes: str) -> dict[str, Any]:
        """Join the process group at rank 0's rendezvous (`open_rendezvous`; `nodes` as there),
        then build the ZeRO-3 engine(s)."""
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        from mmrl import registry

        t0 = time.time()
        spec = self.spec
        join_process_group(self.rank, spec.world_size, rendezvous, spec.device, nodes, getattr(self, "_store", None))
        ds_config = build_deepspeed_config(grad_clip=spec.grad_clip, bf16=spec.dtype == "bfloat16", user=spec.deepspeed)
        # Kept alive while the models are built: from_pretrained then partitions the weights
        # across ranks as they load (zero.Init) instead of materialising the full model per rank.
        self._hf_ds_config = HfDeepSpeedConfig(ds_config)

        def load() -> Any:
            return load_pretrained(spec.model_path, spec.dtype, spec.trust_remote_code)

        model = load()
        if spec.gradient_checkpointing:  # on the HF model: peft wraps it next
            enable_gradient_checkpointing(model, skip_vision_tower=spec.freeze_vision_tower)
        if spec.lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(
                r=spec.lora["rank"], lora_alpha=spec.lora["alpha"], lora_dropout=spec.lora["dropout"],
                target_modules=list(spec.lora["target_modules"]), bias="none"))
        # After peft, so that adapters it put inside the tower (LLaVA's CLIP has q/k/v_proj) freeze
        # too; before the optimizer, so that frozen parameters get no optimizer state.
        frozen = freeze_vision(model, tower=spec.freeze_vision_tower, projector=spec.freeze_projector)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=spec.lr, betas=tuple(spec.betas), weight_decay=spec.weight_decay)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        self.engine.train()
        # MoE routers: replay (or compare with) the engine's routing; no hooks on a dense model
        self.routing = RoutingReplay(self.engine.module, spec.routing_replay)
        if spec.routing_replay == "rollout" and not self.routing.routers:
            raise ValueError("algorithm.routing_replay=rollout: the model has no MoE routers to replay")
        self.ref_engine = None
        if spec.reference_model and not spec.lora:
            # A frozen copy, sharded like the policy (ZeRO-3 inference: no optimizer state).
            ref_config = {k: v for k, v in ds_config.items() if k not in ("optimizer", "scheduler", "gradient_clipping")}
            self.ref_engine, *_ = deepspeed.initialize(model=load(), config=ref_config)
            self.ref_engine.eval()
        self.policy_loss = registry.resolve("policy_loss", spec.loss.policy_loss)
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        n_trainable = sum(getattr(p, "ds_numel", p.numel()) for p in trainable)
        self._setup_info = {"rank": self.rank, "setup_s": time.time() - t0, "params": n_params,
                            "trainable": n_trainable, "frozen_vision_tensors": len(frozen), "pid": os.getpid(),
                            "node": ray.util.get_node_ip_address(), "local_rank": int(os.environ["LOCAL_RANK"]),
                            "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"])}
        return self._setup_info

    def setup_info(self) -> dict[str, Any]:
        return self._setup_info

    # ---- forward helpers -------------------------------------------------------------------------
    def _forward(self, seqs: Sequence[TrainSequence], engine: Any = None,
                 measure: bool = False) -> tuple[Any, torch.Tensor, torch.Tensor]:
        engine = engine or self.engine
        mb = collate(seqs, self.spec.pad_token_id, self.spec.padding_free)
        # the policy (not the reference model) routes as the engine did; the rows stay set until
        # the next forward, for a gradient-checkpointing recompute in the backward
        replay = self.routing.routers and engine is self.engine
        if replay:
            self.routing.use(replay_rows(seqs, mb), measure=measure)
        with self.vision_aligned(engine, mb.mm_inputs):
            out = engine(**mb.model_inputs())
        if replay:
            self.routing.measuring = False
        logprobs_BT, entropy_BT = mb.response_logprobs(out.logits, self.spec.temperature, self.spec.forbidden_token_ids)
        return mb, logprobs_BT, entropy_BT

    @contextmanager
    def vision_aligned(self, engine: Any, mm_inputs: dict[str, torch.Tensor]) -> Iterator[None]:
        """A forward without images or videos skips the vision tower; under ZeRO-3 its parameters
        would then be all-gathered on the other ranks but not here, and the collectives hang or
        mismatch. For such a forward, run the tower on a dummy patch grid, with zero weight, at
        the point where the image path runs it (right after the token embedding), so every rank
        performs the same gathers in the same order."""
        with vision_aligned(self.adapter, engine, mm_inputs):
            yield

    def _reference(self) -> tuple[Any, Any]:
        """(engine, context) computing the reference policy's logprobs."""
        if self.ref_engine is not None:
            return self.ref_engine, nullcontext()
        if self.spec.lora:
            return self.engine, self.engine.module.disable_adapter()  # the base model is the reference
        raise RuntimeError("no reference model: set algorithm.kl.coef > 0 to load one")

    @torch.no_grad()
    def compute_logprobs(self, micro_batches: list[list[TrainSequence]], policy: str = "current") -> list[list[float]]:
        """Trainer-side logprobs of the response tokens, micro-batch by micro-batch (empty lists
        are fillers). policy="current" (π_old recompute, parity checks) or "reference" (KL).
        Collective: every rank calls it with the same number of micro-batches."""
        engine, context = (self.engine, nullcontext()) if policy == "current" else self._reference()
        resolve_prompts([s for chunk in micro_batches for s in chunk])
        fallback = next(s for chunk in micro_batches for s in chunk)
        result: list[list[float]] = []
        with context:
            for chunk in micro_batches:
                run, is_filler = filler_for(chunk, fallback)
                _, logprobs_BT, _ = self._forward(run, engine)
                if not is_filler:
                    result += [logprobs_BT[i, :len(s.response_ids)].tolist() for i, s in enumerate(run)]
        return result

    def keep_logprobs(self, inputs: StepInputs, policies: list[str], kl_estimator: str | None = None) -> dict[int, float]:
        """π_old ("current") and/or reference logprobs of the sequences this rank trains on next
        (its share of the update's own plan, `inputs`), kept here for `train_step`: they never
        leave the trainer. With `kl_estimator` (KL in the reward) returns Σ_t KL(π_old‖π_ref)
        per sequence uid, π_old being the behaviour logprobs when it is not recomputed. Collective:
        every rank's plan has the same number of micro-batches."""
        from mmrl.algorithms.kl import sequence_kl

        chunks = [chunk for mini in inputs.mini_batches for chunk in mini.micro_batches]
        seqs = [s for chunk in chunks for s in chunk]
        for policy in policies:
            attr = "old_logprobs" if policy == "current" else "ref_logprobs"
            for seq, values in zip(seqs, self.compute_logprobs(chunks, policy)):
                self._kept.setdefault(seq.uid, {})[attr] = values
        if kl_estimator is None:
            return {}
        kl = {}
        for s in seqs:
            kept = self._kept[s.uid]
            old = kept.get("old_logprobs", s.old_logprobs or s.behaviour_logprobs)
            kl[s.uid] = sequence_kl(old, kept["ref_logprobs"], s.loss_mask, kl_estimator)
        return kl

    # ---- sampling (rollout.backend: trainer) ------------------------------------------------------
    @torch.no_grad()
    def generate(self, requests: list[GenerationRequest], eos_token_ids: list[int]) -> list[dict[str, Any]]:
        """Sample `requests` with the policy being trained (trainer/generate.py), then score the
        sampled tokens with the very forward and logprob function the update uses: the behaviour
        logprobs are the trainer's own, so the rollout/trainer mismatch is zero by construction
        (up to floating-point reduction order between batch shapes). Collective: every rank gets
        a call (at least one request each; fillers where it has none)."""
        import torch.distributed as dist

        from mmrl.trainer.generate import sample_responses

        def all_done(local: bool) -> bool:
            flag = torch.tensor([0 if local else 1], device=self._device())  # nccl reduces GPU tensors only
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return int(flag) == 0

        decode = None
        if any(r.sampling.stop for r in requests):
            decode = self._tokenizer().decode
        with checkpointing_paused(self.engine.module):  # sampling needs the KV cache checkpointing drops
            generated = sample_responses(
                self.engine, requests,
                pad_id=self.spec.pad_token_id, eos_token_ids=eos_token_ids, all_done=all_done, decode=decode,
                prefill_context=lambda mm: self.vision_aligned(self.engine, mm))
        seqs = [TrainSequence(prompt_ids=r.prompt_ids, positions_AP=r.positions_AP, next_position=r.next_position,
                              mm_inputs=r.mm_inputs, response_ids=g.token_ids, behaviour_logprobs=[0.0] * len(g.token_ids),
                              loss_mask=[1] * len(g.token_ids)) for r, g in zip(requests, generated)]
        _, logprobs_BT, _ = self._forward(seqs)
        return [{"token_ids": g.token_ids, "logprobs": logprobs_BT[i, :len(g.token_ids)].tolist(),
                 "finish_reason": g.finish_reason} for i, (r, g) in enumerate(zip(requests, generated)) if not r.filler]

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.spec.device == "cuda" else torch.device("cpu")

    def _tokenizer(self) -> Any:
        if getattr(self, "_tok", None) is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.spec.model_path, trust_remote_code=self.spec.trust_remote_code)
        return self._tok

    # ---- training ---------------------------------------------------------------------------------
    def train_step(self, inputs: StepInputs) -> dict[str, Any]:
        """`epochs` passes over the mini-batches, one optimizer step each. A step whose gradient
        norm is not finite (nan/inf in the loss or the gradients) is skipped by DeepSpeed and
        counted here; the weights stay as they were."""
        spec = self.spec
        loss_settings = spec.loss if inputs.entropy_coef is None else \
            dataclasses.replace(spec.loss, entropy_coef=inputs.entropy_coef)
        t0 = time.time()
        sums = dict.fromkeys(SUM_KEYS, 0.0)
        max_diff, max_ratio, min_ratio = 0.0, 1.0, 1.0
        grad_norms: list[float] = []
        skipped = 0
        seqs = [s for mini in inputs.mini_batches for chunk in mini.micro_batches for s in chunk]
        resolve_prompts(seqs)
        for s in seqs:  # the logprobs keep_logprobs computed for this update
            kept = self._kept.get(s.uid, {})
            s.old_logprobs = kept.get("old_logprobs", s.old_logprobs)
            s.ref_logprobs = kept.get("ref_logprobs", s.ref_logprobs)
        self._kept.clear()
        fallback = next(s for mini in inputs.mini_batches for chunk in mini.micro_batches for s in chunk)
        self.routing.take_counts()
        for epoch in range(inputs.epochs):
            for mini in inputs.mini_batches:
                scale = spec.world_size / mini.loss_denominator  # DeepSpeed averages gradients over ranks
                for chunk in mini.micro_batches:
                    run, is_filler = filler_for(chunk, fallback)
                    # router agreement: each real token once (the first epoch's forward)
                    mb, logprobs_BT, entropy_BT = self._forward(run, measure=epoch == 0 and not is_filler)
                    loss, stats = micro_batch_loss(
                        self.policy_loss, loss_settings, logprobs_BT, entropy_BT, mb.mask_BT, mb.advantages_B,
                        mb.behaviour_logprobs_BT, mb.old_logprobs_BT, mb.ref_logprobs_BT, scale)
                    self.engine.backward(loss, scale_wrt_gas=False)
                    for key in SUM_KEYS:
                        sums[key] += stats.get(key, 0.0)
                    max_diff = max(max_diff, stats["max_abs_logprob_diff"])
                    max_ratio = max(max_ratio, stats["max_mismatch_ratio"])
                    min_ratio = min(min_ratio, stats["min_mismatch_ratio"])
                self.engine.step()
                norm = self.engine.get_global_grad_norm()
                norm = float(norm) if norm is not None else float("nan")
                grad_norms.append(norm)
                skipped += 0 if np.isfinite(norm) else 1
        if spec.release_cache_after_update and torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.routing.use(None, measure=False)
        return {**sums, **self.routing.take_counts(), "max_abs_logprob_diff": max_diff, "max_mismatch_ratio": max_ratio,
                "min_mismatch_ratio": min_ratio, "grad_norms": grad_norms, "skipped_updates": skipped,
                "updates": inputs.num_updates, "train_s": time.time() - t0}

    # ---- learning rate ----------------------------------------------------------------------------
    def set_lr(self, lr: float) -> float:
        """Set the learning rate of every parameter group (the stability guard's remedy)."""
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def get_lr(self) -> float:
        return float(self.engine.optimizer.param_groups[0]["lr"])

    # ---- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        """DeepSpeed's sharded model + optimizer state (every rank writes its shard) and this
        rank's RNG states. Collective."""
        self.engine.save_checkpoint(path, tag="deepspeed")
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
                   Path(path) / f"rng_rank{self.rank}.pt")

    def load_checkpoint(self, path: str) -> None:
        """Restore model, optimizer (learning rate included) and RNG states. Collective."""
        load_path, _ = self.engine.load_checkpoint(path, tag="deepspeed", load_optimizer_states=True,
                                                   load_lr_scheduler_states=True)
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {path}/deepspeed")
        rng = torch.load(Path(path) / f"rng_rank{self.rank}.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])

    # ---- weight sync ------------------------------------------------------------------------------
    def sync_weights(self, engines: Sequence[Any], version: int, bucket_mb: float, transport: str = "object_store",
                     timeout_s: float = 600.0) -> dict[str, float]:
        """Gather ZeRO-3 shards bucket by bucket (never the whole model at once) and push each
        bucket to every rollout engine through `transport` (weight_sync.transport:
        mmrl/weight_sync/transport.py); rank 0 sends, all ranks take part in the gathers."""
        import deepspeed

        from mmrl.weight_sync.gather import buckets, weight_units

        t0 = time.time()
        sender = self._weight_sender(engines, transport, timeout_s) if self.rank == 0 else None
        sent_bytes, n_buckets = 0, 0
        # where the seconds go (weight_sync/*_s): the ZeRO-3 gathers and re-partitions, the copy
        # into full tensors under the engine's names, the transport's send
        spent = {"gather_s": 0.0, "copy_s": 0.0, "send_s": 0.0}
        try:
            for bucket in buckets(weight_units(self.engine.module), bucket_mb):
                n_buckets += 1
                t_bucket = time.perf_counter()
                with deepspeed.zero.GatheredParameters([p for u in bucket for p in u.params], modifier_rank=None):
                    t_gathered = time.perf_counter()
                    if sender is not None:
                        tensors = {self.adapter.engine_weight_name(n): self.adapter.engine_weight_tensor(n, t)
                                   for u in bucket for n, t in u.tensors(sender.device).items()}
                        t_copied = time.perf_counter()
                        sent_bytes += sender.send(tensors)
                        spent["copy_s"] += t_copied - t_gathered
                        spent["send_s"] += time.perf_counter() - t_copied
                    t_used = time.perf_counter()
                spent["gather_s"] += (t_gathered - t_bucket) + (time.perf_counter() - t_used)
        except BaseException:
            if sender is not None:
                self._drop_weight_link()  # a broadcast may have broken off half way: form a new group next time
                try:
                    sender.abort()  # the engines resume generation
                except Exception as e:  # the original error is the one to see
                    print(f"[mmrl] weight sync: engines did not resume cleanly after the failure: {e!r}")
            raise
        result = {"buckets": float(n_buckets), "mb": sent_bytes / 2**20, **spent}
        if sender is not None:
            t_finish = time.perf_counter()
            result.update(sender.finish(version))
            result["finish_s"] = time.perf_counter() - t_finish
        result["sync_s"] = time.time() - t0
        return result

    def _weight_sender(self, engines: Sequence[Any], transport: str, timeout_s: float) -> Any:
        """Rank 0's sender for this sync. The collective transport's group with the engines is
        formed on first use and kept while the engines stay the same actors."""
        from mmrl.weight_sync import transport as transports

        workers: list[list[dict[str, Any]]] | None = None  # each engine's vLLM workers: rank, GPU
        engine_gpus: list[list[str | None]] = []
        sender_gpu = None
        if self.spec.device == "cuda" and transport != transports.OBJECT_STORE:
            from mmrl.weight_sync.cuda_ipc import gpu_uuid

            sender_gpu = gpu_uuid()
            workers = ray.get([e.weight_workers.remote() for e in engines])
            engine_gpus = [[w["gpu"] for w in ws] for ws in workers]
        kind, backend = transports.resolve(transport, self.spec.device, engine_gpus, sender_gpu)
        if kind == transports.OBJECT_STORE:
            from mmrl.weight_sync.object_store import ObjectStoreSender

            return ObjectStoreSender(engines)
        if kind == transports.CUDA_IPC:
            from mmrl.weight_sync.cuda_ipc import CudaIpcSender

            return CudaIpcSender(engines, timeout_s)
        from mmrl.weight_sync.collective import CollectiveLink, CollectiveSender, engine_ids

        link = getattr(self, "_weight_link", None)
        if link is None or link.engines != engine_ids(engines) or link.backend != backend:
            self._drop_weight_link()
            counts = [len(ws) for ws in workers or ray.get([e.weight_workers.remote() for e in engines])]
            # the node's address, not the ranks' rendezvous address: engines may run on other nodes
            link = self._weight_link = CollectiveLink.connect(engines, counts, backend,
                                                              ray.util.get_node_ip_address(), timeout_s)
        return CollectiveSender(link, engines, timeout_s)

    def _drop_weight_link(self) -> None:
        link, self._weight_link = getattr(self, "_weight_link", None), None
        if link is not None:
            link.close()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The gathered weights on rank 0 under HF checkpoint names (LoRA merged); collective."""
        import deepspeed

        from mmrl.weight_sync.gather import weight_units

        units = weight_units(self.engine.module)
        with deepspeed.zero.GatheredParameters([p for u in units for p in u.params], modifier_rank=None):
            if self.rank == 0:
                return {n: t.clone() for u in units for n, t in u.tensors().items()}
        return None

    def shutdown(self) -> None:
        leave_process_group()


# ---- a ZeRO-3 rank's set-up, shared with the serve's ranks (mmrl/serve/ranks.py) -------------------
def prepare_rank_process(rank: int, world_size: int, env: dict[str, str], device: str, seed: int) -> None:
    """The process environment of rank `rank` (before anything imports DeepSpeed); where the
    group meets is set when it joins (`join_process_group`)."""
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size)})
    if device == "cpu":
        # ranks share the machine's cores; one thread each avoids oversubscription
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    torch.manual_seed(seed)
    # DeepSpeed's ZeRO-3 collectives call torch.distributed names that torch has deprecated;
    # nothing a user can act on, and Ray repeats the warning on the console every step.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


# Where the ranks meet when they all run on rank 0's node: loopback needs no routable address.
LOOPBACK = "127.0.0.1"


def rendezvous_address(nodes: Sequence[str], node_ip: str | None = None) -> str:
    """The address rank 0 listens on: loopback when every rank runs on rank 0's node (`nodes[0]`;
    also when nothing is known, as for a rank built in-process), else rank 0's node address, which
    ranks on other nodes can reach (ZeRO-3 across nodes; `node_ip` defaults to Ray's)."""
    if not nodes or all(n == nodes[0] for n in nodes):
        return LOOPBACK
    return node_ip or ray.util.get_node_ip_address()


def local_rank(rank: int, nodes: Sequence[str], device: str) -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) of `rank`: its place among the ranks on its node. On CUDA
    each rank's actor sees only its own GPU (Ray sets CUDA_VISIBLE_DEVICES), so its device, which
    DeepSpeed selects by LOCAL_RANK, is 0 whatever its place: rank r on device r would not exist."""
    if not nodes:
        return (0 if device == "cuda" else rank), 1
    mine = [r for r, n in enumerate(nodes) if n == nodes[rank]]
    return (0 if device == "cuda" else mine.index(rank)), len(mine)


def open_rendezvous_store(master_addr: str, world_size: int) -> Any:
    """Rank 0's TCPStore on a port the kernel picks in this process (`.port`); see
    TrainerWorker.open_rendezvous for why here."""
    from torch.distributed.constants import default_pg_timeout

    return torch.distributed.TCPStore(master_addr, 0, world_size, is_master=True, wait_for_workers=False,
                                      timeout=default_pg_timeout)


def join_process_group(rank: int, world_size: int, rendezvous: tuple[str, int], device: str,
                       nodes: Sequence[str] = (), store: Any = None) -> None:
    """Join the ranks' process group at rank 0's rendezvous (address, port; rank 0 passes its
    `store`) and hand it to DeepSpeed. `nodes`: every rank's node id, for LOCAL_RANK."""
    import deepspeed
    from torch.distributed.constants import default_pg_timeout

    backend = "nccl" if device == "cuda" else "gloo"
    master_addr, master_port = rendezvous
    local, local_world = local_rank(rank, nodes, device)
    # MASTER_ADDR/PORT also name DeepSpeed's CPU all-reduce buffers (utils/env.py: cleanup_shm)
    os.environ.update({"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "LOCAL_RANK": str(local),
                       "LOCAL_WORLD_SIZE": str(local_world)})
    if device == "cpu" and nodes:  # the cores are shared by the ranks on this node only
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // local_world))
    if rank != 0:
        store = torch.distributed.TCPStore(master_addr, master_port, world_size, is_master=False,
                                           timeout=default_pg_timeout)
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                         timeout=default_pg_timeout)
    deepspeed.init_distributed(dist_backend=backend)  # adopts the group above
    if device == "cuda":
        torch.cuda.set_device(0)  # each Ray actor sees exactly its own GPU


def load_pretrained(model_path: str, dtype: str, trust_remote_code: bool) -> Any:
    """The HF model, partitioned across the ranks as it loads while an HfDeepSpeedConfig is alive."""
    from transformers import AutoModelForImageTextToText

    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    m = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    m.config.use_cache = False
    return m


@contextmanager
def vision_aligned(adapter: Any, engine: Any, mm_inputs: dict[str, torch.Tensor]) -> Iterator[None]:
    """See TrainerWorker.vision_aligned (`adapter`: the family's processor adapter class)."""
    if adapter.runs_vision(mm_inputs):
        yield
        return
    embed = engine.module.get_input_embeddings()
    hook = embed.register_forward_hook(lambda _m, _i, out: out + 0.0 * adapter.dummy_vision_output(engine.module))
    try:
        yield
    finally:
        hook.remove()


def leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        import deepspeed.comm

        dist.barrier()
        # through DeepSpeed, which also drops the groups it cached (its world-group clone):
        # a later rank in the same process would otherwise get the destroyed ones
        if deepspeed.comm.is_initialized():
            deepspeed.comm.destroy_process_group()
        else:  # setup failed before DeepSpeed adopted the group
            dist.destroy_process_group()


def make_trainer_actors(spec: TrainerSpec, options: dict[str, Any] | Sequence[dict[str, Any]]) -> list[Any]:
    """The rank actors; `options`: one Ray option set for every rank, or one per rank (each rank
    its own placement-group bundle)."""
    actor_cls = ray.remote(TrainerWorker)
    per_rank = [options] * spec.world_size if isinstance(options, dict) else list(options)
    return [actor_cls.options(**per_rank[rank]).remote(rank, spec) for rank in range(spec.world_size)]


def setup_ranks(ranks: Sequence[Any]) -> tuple[list[Any], Any]:
    """Start every rank's setup without waiting: the ranks' node ids reach rank 0, which opens
    the rendezvous, and its (address, port) reaches the others, all as object refs, so the driver
    goes on while the ranks start. Returns the setups' refs and the rendezvous' ref (it also
    names the ranks' shm buffers)."""
    nodes = [r.node_id.remote() for r in ranks]
    rendezvous = ranks[0].open_rendezvous.remote(*nodes)
    return [r.setup.remote(rendezvous, *nodes) for r in ranks], rendezvous
