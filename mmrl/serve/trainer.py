"""One Tinker training client's model: a peft LoRA on the VLM, trained in this process.

First cut: one in-process rank per training client (no DeepSpeed, no Ray), built like a trainer
rank builds its model (`AutoModelForImageTextToText.from_pretrained`, peft `get_peft_model`,
`mmrl.trainer.model_setup.freeze_vision`), so each client has its own adapter and optimizer. The
Tinker API is per call (forward_backward accumulates gradients, optim_step applies them), which
the ZeRO-3 ranks' fused update plan does not expose yet; moving this class behind
`mmrl.trainer.worker` is the next step for models that do not fit one process.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from mmrl.serve.losses import LOSSES, LossInputError, check_loss_name

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# Padded tokens per training forward: datums are batched up to this, so a group's samples share a
# pass instead of one pass each. The bound is the logits: tokens x vocabulary x 4 bytes (2048 tokens
# of a 152k-token vocabulary: 1.2 GB, twice that with their gradient).
MICRO_BATCH_TOKENS = 2048


class UserInputError(ValueError):
    """A request the client got wrong: answered 400 naming `field`."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def lora_targets(model: torch.nn.Module, *, attn: bool, mlp: bool, unembed: bool,
                 projector: bool = False, vision: bool = False) -> list[str]:
    """Full module names of the linear layers that get an adapter: the text model's, with
    `projector` the vision projector's, and with `vision` every linear layer of the vision tower
    (its convolutional patch embedding stays as it is)."""
    from mmrl.trainer.model_setup import find_vision_parts

    suffixes = (ATTN if attn else ()) + (MLP if mlp else ())
    tied = bool(getattr(model.config, "tie_word_embeddings", False)
                or getattr(getattr(model.config, "text_config", None), "tie_word_embeddings", False))
    parts = find_vision_parts(model) if projector or vision else None
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if "language_model" in name and name.rsplit(".", 1)[-1] in suffixes:
            out.append(name)
        elif unembed and not tied and name == "lm_head":
            out.append(name)
        elif parts is not None and projector and parts.is_projector(name):
            out.append(name)
        elif parts is not None and vision and parts.is_tower(name):
            out.append(name)
    return out


class LoraTrainer:
    def __init__(self, model_path: str, *, rank: int, alpha: float | None, seed: int | None,
                 train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True,
                 train_projector: bool = False, train_vision: bool = False, dtype: str = "float32", trust_remote_code: bool = False):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForImageTextToText

        from mmrl.trainer.model_setup import freeze_vision

        torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        base = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch_dtype,
                                                           trust_remote_code=trust_remote_code)
        base.config.use_cache = False
        self.vocab_size = int(base.get_output_embeddings().weight.shape[0])
        targets = lora_targets(base, attn=train_attn, mlp=train_mlp, unembed=train_unembed,
                               projector=train_projector, vision=train_vision)
        if not targets:
            raise UserInputError("lora_config: train_attn, train_mlp and train_unembed leave no layer to adapt",
                                 "lora_config")
        self.rank, self.alpha = rank, float(alpha if alpha is not None else rank)
        if seed is not None:
            torch.manual_seed(seed)
        self.model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=self.alpha, target_modules=targets,
                                                      lora_dropout=0.0, bias="none"))
        # base weights of the vision parts frozen; the adapters put on them (peft) stay trainable
        freeze_vision(self.model, tower=not train_vision, projector=not train_projector)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer: torch.optim.AdamW | None = None
        self.steps = 0
        self.model.train()

    # ---- forward / backward ------------------------------------------------------------------
    def _logprobs_batch(self, prompts: list[Any], targets: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per datum, logprob of targets[t] after prompt.ids[:t+1] (`mmrl.serve.inputs.Prompt`s), in
        one forward: rows RIGHT-padded, so under causal attention a row's real tokens never see its
        pads; the vision inputs concatenated in row order, as the processor batches them."""
        from mmrl.trainer.batch import model_positions

        L = max(len(p.ids) for p in prompts)
        ids_BL = torch.zeros((len(prompts), L), dtype=torch.long)
        mask_BL = torch.zeros((len(prompts), L), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids_BL[b, :len(p.ids)] = torch.tensor(p.ids)
            mask_BL[b, :len(p.ids)] = 1
        kwargs: dict[str, Any] = {}
        for key in sorted({k for p in prompts for k in p.mm_inputs}):
            kwargs[key] = torch.cat([p.mm_inputs[key] for p in prompts if key in p.mm_inputs])
        with_positions = [p.positions_AP for p in prompts if p.positions_AP is not None]
        if with_positions:  # images: M-RoPE positions from the processor; text rows count along every axis
            A = with_positions[0].shape[0]
            pos_ABL = torch.zeros((A, len(prompts), L), dtype=torch.long)
            for b, p in enumerate(prompts):
                pos = p.positions_AP if p.positions_AP is not None else torch.arange(len(p.ids)).expand(A, -1)
                pos_ABL[:, b, :len(p.ids)] = pos
            kwargs["position_ids"] = model_positions(pos_ABL)
        logits_BLV = self.model(input_ids=ids_BL, attention_mask=mask_BL, **kwargs).logits.float()
        lse_BL = torch.logsumexp(logits_BLV, dim=-1)  # no (B, L, V) log-softmax copy
        return [logits_BLV[b, :len(t)].gather(-1, t.view(-1, 1)).squeeze(-1) - lse_BL[b, :len(t)]
                for b, t in enumerate(targets)]

    def _micro_batches(self, prompts: list[Any]) -> list[list[int]]:
        """Datum indices in order, cut so no micro-batch holds more than MICRO_BATCH_TOKENS padded
        tokens (one datum alone may exceed it)."""
        batches: list[list[int]] = [[]]
        longest = 0
        for i, p in enumerate(prompts):
            longest_if_added = max(longest, len(p.ids))
            if batches[-1] and longest_if_added * (len(batches[-1]) + 1) > MICRO_BATCH_TOKENS:
                batches.append([])
                longest_if_added = len(p.ids)
            batches[-1].append(i)
            longest = longest_if_added
        return batches

    def _checked_targets(self, prompt: Any, loss_inputs: dict[str, np.ndarray], where: str) -> torch.Tensor:
        if "target_tokens" not in loss_inputs:
            raise UserInputError(f"{where}.loss_fn_inputs.target_tokens is required",
                                 f"{where}.loss_fn_inputs.target_tokens")
        targets = torch.tensor(np.array(loss_inputs["target_tokens"], dtype=np.int64).reshape(-1))
        if targets.numel() != len(prompt.ids):
            raise UserInputError(f"{where}.loss_fn_inputs.target_tokens has {targets.numel()} tokens, the model "
                                 f"input has {len(prompt.ids)}", f"{where}.loss_fn_inputs.target_tokens")
        if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= self.vocab_size):
            raise UserInputError(f"{where}.loss_fn_inputs.target_tokens: ids must be in [0, {self.vocab_size})",
                                 f"{where}.loss_fn_inputs.target_tokens")
        return targets

    def forward_backward(self, prompts: list[Any], data: list[dict[str, np.ndarray]], loss_fn: str,
                         config: dict[str, Any], backward: bool) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        try:
            check_loss_name(loss_fn)
        except LossInputError as e:
            raise UserInputError(str(e), e.field) from None
        if not data:
            raise UserInputError("data is empty", "data")
        loss_fn_impl = LOSSES[loss_fn]
        # every datum checked before any gradient accumulates (the loss on stand-in logprobs checks its
        # inputs and config): a bad datum leaves the gradients of earlier calls as they were
        targets = [self._checked_targets(p, d, f"data[{i}]") for i, (p, d) in enumerate(zip(prompts, data))]
        inputs = [{k: torch.tensor(np.array(v, dtype=np.float32)) for k, v in d.items() if k != "target_tokens"}
                  for d in data]
        for i, (t, x) in enumerate(zip(targets, inputs)):
            try:
                loss_fn_impl(torch.zeros(t.numel()), x, config, f"data[{i}]")
            except LossInputError as e:
                raise UserInputError(str(e), e.field) from None
        outputs: list[dict[str, np.ndarray]] = [{} for _ in data]
        total = 0.0
        for batch in self._micro_batches(prompts):
            with torch.set_grad_enabled(backward):
                logps = self._logprobs_batch([prompts[i] for i in batch], [targets[i] for i in batch])
                losses = [loss_fn_impl(logp, inputs[i], config, f"data[{i}]") for i, logp in zip(batch, logps)]
                loss = torch.stack([loss_T.sum() for loss_T in losses]).sum()
                if backward:
                    loss.backward()
            total += float(loss.detach())
            for i, logp, loss_T in zip(batch, logps, losses):
                outputs[i] = {"logprobs": logp.detach().numpy().astype(np.float32),
                              "elementwise_loss": loss_T.detach().numpy().astype(np.float32)}
        return outputs, {"loss:sum": total}

    # ---- optimizer -----------------------------------------------------------------------------
    def optim_step(self, adam: dict[str, Any]) -> dict[str, float]:
        lr = float(adam.get("learning_rate", 1e-4))
        betas = (float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95)))
        eps, wd = float(adam.get("eps", 1e-12)), float(adam.get("weight_decay", 0.0))
        clip = float(adam.get("grad_clip_norm", 0.0))
        for name, v in (("learning_rate", lr), ("eps", eps), ("weight_decay", wd), ("grad_clip_norm", clip)):
            if not math.isfinite(v) or v < 0:
                raise UserInputError(f"adam_params.{name} must be a finite number >= 0, got {v}", f"adam_params.{name}")
        if not all(0 <= b < 1 for b in betas):
            raise UserInputError(f"adam_params.beta1/beta2 must be in [0, 1), got {betas}", "adam_params.beta1")
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=betas, eps=eps, weight_decay=wd)
        for group in self.optimizer.param_groups:  # per-step hyperparameters, as the API passes them
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=wd)
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        if clip > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(self.params, clip, torch.tensor(norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm": norm, "learning_rate": lr}

    # ---- weights -------------------------------------------------------------------------------
    def adapter_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone().contiguous() for n, p in self.model.named_parameters() if ".lora_" in n}

    def merged_lora_deltas(self) -> dict[str, torch.Tensor]:
        """HF checkpoint name -> the adapter's weight delta (alpha/r) * B @ A, per adapted layer."""
        from mmrl.weight_sync.gather import weight_units

        out = {}
        for unit in weight_units(self.model):
            if unit.lora_scaling is not None:
                _, lora_a, lora_b, *_ = unit.params
                out[unit.name] = (unit.lora_scaling * (lora_b.detach().float() @ lora_a.detach().float())).contiguous()
        return out
