"""One DeepSpeed ZeRO-3 rank, living in a Ray actor.

All ranks receive the same calls in the same order (train_step, sync_weights, ...): each one
contains collectives (parameter all-gathers, gradient reduce-scatters) that every rank must
enter. The controller splits the batch so that all ranks run the same number of micro-batches.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import ray
import torch

from mmrl.trainer.batch import TrainSequence, collate, micro_batches, sampling_logprobs
from mmrl.trainer.deepspeed_config import build_deepspeed_config


@dataclass
class TrainerSpec:
    """Everything a rank needs to build itself (picklable, sent once)."""

    model_path: str
    dtype: str
    world_size: int
    master_addr: str
    master_port: int
    device: str  # "cpu" | "cuda"
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    grad_clip: float
    deepspeed: dict[str, Any]
    temperature: float
    forbidden_token_ids: list[int]
    pad_token_id: int
    policy_loss: str
    policy_loss_args: dict[str, Any]
    loss_agg: str
    entropy_coef: float
    seed: int
    env: dict[str, str]
    trust_remote_code: bool = False


@dataclass
class StepInputs:
    """One rank's share of a training step, plus the global loss denominator (shared by all
    micro-batches and ranks so that token-mean means the mean over the whole batch)."""

    sequences: list[TrainSequence]
    num_micro_batches: int
    loss_denominator: float


class TrainerWorker:
    def __init__(self, rank: int, spec: TrainerSpec):
        self.rank, self.spec = rank, spec
        os.environ.update(spec.env)
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(spec.world_size),
                           "LOCAL_WORLD_SIZE": str(spec.world_size), "MASTER_ADDR": spec.master_addr,
                           "MASTER_PORT": str(spec.master_port)})
        if spec.device == "cpu":
            # ranks share the machine's cores; one thread each avoids oversubscription
            torch.set_num_threads(max(1, (os.cpu_count() or 2) // spec.world_size))
        torch.manual_seed(spec.seed + rank)
        self.engine: Any = None

    def setup(self) -> dict[str, Any]:
        import deepspeed
        from transformers import AutoModelForImageTextToText
        from transformers.integrations import HfDeepSpeedConfig

        from mmrl import registry

        t0 = time.time()
        deepspeed.init_distributed(dist_backend="nccl" if self.spec.device == "cuda" else "gloo")
        if self.spec.device == "cuda":
            torch.cuda.set_device(0)  # each Ray actor sees exactly its own GPU
        ds_config = build_deepspeed_config(grad_clip=self.spec.grad_clip, bf16=self.spec.dtype == "bfloat16",
                                           user=self.spec.deepspeed)
        dtype = torch.bfloat16 if self.spec.dtype == "bfloat16" else torch.float32
        # Kept alive while the model is built: from_pretrained then partitions the weights
        # across ranks as they load (zero.Init) instead of materialising the full model per rank.
        self._hf_ds_config = HfDeepSpeedConfig(ds_config)
        model = AutoModelForImageTextToText.from_pretrained(
            self.spec.model_path, dtype=dtype, trust_remote_code=self.spec.trust_remote_code)
        model.config.use_cache = False
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.spec.lr, betas=tuple(self.spec.betas),
                                      weight_decay=self.spec.weight_decay)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        self.engine.train()
        self.policy_loss = registry.resolve("policy_loss", self.spec.policy_loss)
        from mmrl.algorithms.losses import aggregate_sum

        self._aggregate_sum = aggregate_sum
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        return {"rank": self.rank, "setup_s": time.time() - t0, "params": n_params, "pid": os.getpid()}

    # ---- forward helpers -------------------------------------------------------------------------
    def _forward(self, seqs: Sequence[TrainSequence]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        mb = collate(seqs, self.spec.pad_token_id)
        hook = None
        if "pixel_values" not in mb.mm_inputs and "pixel_values_videos" not in mb.mm_inputs:
            # A text-only micro-batch skips the vision tower; under ZeRO-3 its parameters would
            # then be all-gathered on the other ranks but not here, and the collectives hang or
            # mismatch. Run the tower on a dummy patch grid, with zero weight, at the point where
            # the image path runs it (right after the token embedding), so every rank performs
            # the same gathers in the same order.
            embed = self.engine.module.get_input_embeddings()
            hook = embed.register_forward_hook(lambda _m, _i, out: out + 0.0 * self._dummy_vision_output())
        try:
            out = self.engine(**mb.model_inputs())
        finally:
            if hook is not None:
                hook.remove()
        logprobs_BT, entropy_BT = sampling_logprobs(out.logits, mb.response_ids_BT, self.spec.temperature,
                                                    self.spec.forbidden_token_ids)
        return mb, logprobs_BT, entropy_BT

    def _dummy_vision_output(self) -> torch.Tensor:
        model = self.engine.module
        vision = model.config.vision_config
        merge = vision.spatial_merge_size
        grid_thw = torch.tensor([[1, merge, merge]])  # the smallest grid: one merged token
        n_patches = int(grid_thw.prod())
        patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        pixels = torch.zeros(n_patches, patch_dim, dtype=next(model.parameters()).dtype)
        out = model.model.get_image_features(pixel_values=pixels, image_grid_thw=grid_thw)
        return sum(t.float().sum() for t in _tensors(out))

    @torch.no_grad()
    def compute_logprobs(self, seqs: list[TrainSequence], num_micro_batches: int) -> list[list[float]]:
        """Trainer-side logprobs of the response tokens (for parity checks and old-logprob
        recompute). Collective: every rank calls it with the same num_micro_batches."""
        result: list[list[float]] = []
        for chunk, is_filler in micro_batches(seqs, num_micro_batches):
            _, logprobs_BT, _ = self._forward(chunk)
            if not is_filler:
                result += [logprobs_BT[i, :len(s.response_ids)].tolist() for i, s in enumerate(chunk)]
        return result

    # ---- training ---------------------------------------------------------------------------------
    def train_step(self, inputs: StepInputs) -> dict[str, float]:
        spec = self.spec
        t0 = time.time()
        sums = {"pg_loss": 0.0, "entropy": 0.0, "clipped": 0.0, "tokens": 0.0, "abs_logprob_diff": 0.0}
        max_diff = 0.0
        scale = spec.world_size / inputs.loss_denominator  # DeepSpeed averages gradients over ranks
        for chunk, _ in micro_batches(inputs.sequences, inputs.num_micro_batches):
            mb, logprobs_BT, entropy_BT = self._forward(chunk)
            mask = mb.mask_BT
            # A single update per rollout batch: pi_old is the current policy (detached).
            loss_BT, stats = self.policy_loss(logprobs_BT, logprobs_BT.detach(), mb.advantages_B, mask,
                                              **spec.policy_loss_args)
            pg_sum = self._aggregate_sum(loss_BT, mask, spec.loss_agg)
            ent_sum = self._aggregate_sum(entropy_BT, mask, spec.loss_agg)
            loss = (pg_sum - spec.entropy_coef * ent_sum) * scale
            self.engine.backward(loss, scale_wrt_gas=False)
            with torch.no_grad():
                diff_BT = (logprobs_BT.detach() - mb.behaviour_logprobs_BT).abs() * mask
                sums["pg_loss"] += float(pg_sum)
                sums["entropy"] += float((entropy_BT.detach() * mask).sum())
                sums["clipped"] += float((stats["clipped_BT"].float() * mask).sum())
                sums["tokens"] += float(mask.sum())
                sums["abs_logprob_diff"] += float(diff_BT.sum())
                max_diff = max(max_diff, float(diff_BT.max()) if diff_BT.numel() else 0.0)
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        sums["max_abs_logprob_diff"] = max_diff
        sums["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        sums["train_s"] = time.time() - t0
        return sums

    # ---- weight sync ------------------------------------------------------------------------------
    def sync_weights(self, engines: Sequence[Any], version: int, bucket_mb: float) -> dict[str, float]:
        """Gather ZeRO-3 shards bucket by bucket (never the whole model at once) and push each
        bucket to every rollout engine; rank 0 sends, all ranks take part in the gathers."""
        import deepspeed
        from safetensors.torch import save as save_safetensors

        t0 = time.time()
        named = list(self.engine.module.named_parameters())
        limit = bucket_mb * 2**20
        buckets: list[list[tuple[str, torch.nn.Parameter]]] = [[]]
        size = 0.0
        for name, p in named:
            nbytes = getattr(p, "ds_numel", p.numel()) * p.element_size()  # numel() is 0 when partitioned
            if buckets[-1] and size + nbytes > limit:
                buckets.append([])
                size = 0.0
            buckets[-1].append((name, p))
            size += nbytes
        pending = []
        sent_bytes = 0
        for bucket in buckets:
            with deepspeed.zero.GatheredParameters([p for _, p in bucket], modifier_rank=None):
                if self.rank == 0:
                    payload = save_safetensors({n: p.data.detach().to("cpu").contiguous() for n, p in bucket})
                    sent_bytes += len(payload)
                    ref = ray.put(payload)
                    pending += [e.stage_weights.remote(ref) for e in engines]
        result = {"buckets": float(len(buckets)), "mb": sent_bytes / 2**20}
        if self.rank == 0:
            ray.get(pending)
            applied = ray.get([e.apply_weights.remote(version) for e in engines])
            result["apply_s"] = max(a["apply_seconds"] for a in applied)
        result["sync_s"] = time.time() - t0
        return result

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The gathered weights on rank 0 (tests, export); collective."""
        import deepspeed

        params = list(self.engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            if self.rank == 0:
                return {n: p.data.detach().to("cpu").clone() for n, p in params}
        return None

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every floating tensor in a (nested) model output: the vision outputs differ by family."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return []


def make_trainer_actors(spec: TrainerSpec, options: dict[str, Any]) -> list[Any]:
    actor_cls = ray.remote(TrainerWorker)
    return [actor_cls.options(**options).remote(rank, spec) for rank in range(spec.world_size)]
