"""One Tinker training client's model: a peft LoRA on the VLM, trained in this process
(`serve.trainer: local`; `mmrl/serve/ranks.py` trains it on DeepSpeed ZeRO-3 ranks instead).

Built like a trainer rank builds its model (`AutoModelForImageTextToText.from_pretrained`, peft
`get_peft_model`, `mmrl.trainer.model_setup.freeze_vision`), so each client has its own adapter and
optimizer. The functions at module level (input checks, micro-batches, the logprob forward, the
loss of a micro-batch, AdamW's per-call hyperparameters) are shared with the ranks, so both
trainers check and compute alike.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
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


def add_lora(base: torch.nn.Module, targets: list[str], *, rank: int, alpha: float, seed: int | None,
             train_projector: bool, train_vision: bool) -> Any:
    """`base` with a peft LoRA on `targets` (A initialised from `seed`: the same adapter on every
    trainer kind), the base weights of the vision parts frozen; the adapters put on them stay
    trainable."""
    from peft import LoraConfig, get_peft_model

    from mmrl.trainer.model_setup import freeze_vision

    if seed is not None:
        torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                                            bias="none"))
    freeze_vision(model, tower=not train_vision, projector=not train_projector)
    return model


def lora_deltas(units: list[Any]) -> dict[str, torch.Tensor]:
    """HF checkpoint name -> (alpha/r) * B @ A of each LoRA unit (`weight_sync.gather.weight_units`;
    under ZeRO-3, call inside a gather of their parameters)."""
    out = {}
    for unit in units:
        if unit.lora_scaling is not None:
            _, lora_a, lora_b, *_ = unit.params
            out[unit.name] = (unit.lora_scaling * (lora_b.detach().float() @ lora_a.detach().float())).contiguous()
    return out


def check_targets(prompt: Any, loss_inputs: dict[str, np.ndarray], where: str, vocab_size: int) -> torch.Tensor:
    """The datum's target token ids, checked against its model input and the vocabulary."""
    if "target_tokens" not in loss_inputs:
        raise UserInputError(f"{where}.loss_fn_inputs.target_tokens is required",
                             f"{where}.loss_fn_inputs.target_tokens")
    targets = torch.tensor(np.array(loss_inputs["target_tokens"], dtype=np.int64).reshape(-1))
    if targets.numel() != len(prompt.ids):
        raise UserInputError(f"{where}.loss_fn_inputs.target_tokens has {targets.numel()} tokens, the model "
                             f"input has {len(prompt.ids)}", f"{where}.loss_fn_inputs.target_tokens")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        raise UserInputError(f"{where}.loss_fn_inputs.target_tokens: ids must be in [0, {vocab_size})",
                             f"{where}.loss_fn_inputs.target_tokens")
    return targets


def checked_batch(prompts: list[Any], data: list[dict[str, np.ndarray]], loss_fn: str, config: dict[str, Any],
                  vocab_size: int) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """(targets, loss inputs as float tensors) of every datum, all checked before any gradient
    accumulates (the loss on stand-in logprobs checks its inputs and config): a bad datum leaves
    the gradients of earlier calls as they were."""
    try:
        check_loss_name(loss_fn)
    except LossInputError as e:
        raise UserInputError(str(e), e.field) from None
    if not data:
        raise UserInputError("data is empty", "data")
    targets = [check_targets(p, d, f"data[{i}]", vocab_size) for i, (p, d) in enumerate(zip(prompts, data))]
    inputs = [{k: torch.tensor(np.array(v, dtype=np.float32)) for k, v in d.items() if k != "target_tokens"}
              for d in data]
    for i, (t, x) in enumerate(zip(targets, inputs)):
        try:
            LOSSES[loss_fn](torch.zeros(t.numel()), x, config, f"data[{i}]")
        except LossInputError as e:
            raise UserInputError(str(e), e.field) from None
    return targets, inputs


def micro_batches(prompts: list[Any]) -> list[list[int]]:
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


def prompt_logprobs(model: Any, prompts: list[Any], targets: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per datum, logprob of targets[t] after prompt.ids[:t+1] (`mmrl.serve.inputs.Prompt`s), in
    one forward of `model` (a module or a DeepSpeed engine): rows RIGHT-padded, so under causal
    attention a row's real tokens never see its pads; the vision inputs concatenated in row order,
    as the processor batches them."""
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
    logits_BLV = model(input_ids=ids_BL, attention_mask=mask_BL, **kwargs).logits.float()
    lse_BL = torch.logsumexp(logits_BLV, dim=-1)  # no (B, L, V) log-softmax copy
    return [logits_BLV[b, :len(t)].gather(-1, t.view(-1, 1)).squeeze(-1) - lse_BL[b, :len(t)]
            for b, t in enumerate(targets)]


def batch_loss(logps: list[torch.Tensor], inputs: list[dict[str, torch.Tensor]], indices: list[int], loss_fn: str,
               config: dict[str, Any]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the micro-batch's summed loss, each datum's per-token loss); `indices` name the datums
    (in `data[i]` messages)."""
    losses = [LOSSES[loss_fn](logp, x, config, f"data[{i}]") for i, logp, x in zip(indices, logps, inputs)]
    return torch.stack([loss_T.sum() for loss_T in losses]).sum(), losses


def datum_output(logp: torch.Tensor, loss_T: torch.Tensor) -> dict[str, np.ndarray]:
    return {"logprobs": logp.detach().numpy().astype(np.float32),
            "elementwise_loss": loss_T.detach().numpy().astype(np.float32)}


@dataclass(frozen=True)
class AdamStep:
    """One optim_step's AdamW hyperparameters (the API passes them with every call)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    grad_clip_norm: float  # 0 = no clipping

    @classmethod
    def from_params(cls, adam: dict[str, Any]) -> "AdamStep":
        """From the request's adam_params (Tinker's defaults for what it leaves out), checked."""
        lr = float(adam.get("learning_rate", 1e-4))
        betas = (float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95)))
        eps, wd = float(adam.get("eps", 1e-12)), float(adam.get("weight_decay", 0.0))
        clip = float(adam.get("grad_clip_norm", 0.0))
        for name, v in (("learning_rate", lr), ("eps", eps), ("weight_decay", wd), ("grad_clip_norm", clip)):
            if not math.isfinite(v) or v < 0:
                raise UserInputError(f"adam_params.{name} must be a finite number >= 0, got {v}", f"adam_params.{name}")
        if not all(0 <= b < 1 for b in betas):
            raise UserInputError(f"adam_params.beta1/beta2 must be in [0, 1), got {betas}", "adam_params.beta1")
        return cls(lr, betas, eps, wd, clip)

    def apply(self, param_groups: list[dict[str, Any]]) -> None:
        for group in param_groups:
            group.update(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


def check_adapter_layout(own: dict[str, tuple[int, ...]], saved: dict[str, torch.Tensor], path: str) -> None:
    """Raise a 400 naming `path` unless `saved` has exactly the adapter tensors (names, shapes) `own` lists."""
    missing, extra = sorted(own.keys() - saved.keys()), sorted(saved.keys() - own.keys())
    if missing or extra:
        raise UserInputError(f"path {path!r}: its adapter does not match this model's LoRA layout "
                             f"({len(missing)} tensors missing, {len(extra)} unexpected, e.g. "
                             f"{(missing or extra)[0]})", "path")
    for n, shape in own.items():
        if tuple(saved[n].shape) != tuple(shape):
            raise UserInputError(f"path {path!r}: {n} has shape {tuple(saved[n].shape)}, this model's is "
                                 f"{tuple(shape)} (another LoRA rank?)", "path")


class LoraTrainer:
    def __init__(self, model_path: str, *, rank: int, alpha: float | None, seed: int | None,
                 train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True,
                 train_projector: bool = False, train_vision: bool = False, dtype: str = "float32", trust_remote_code: bool = False):
        from transformers import AutoModelForImageTextToText

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
        self.model = add_lora(base, targets, rank=rank, alpha=self.alpha, seed=seed, train_projector=train_projector,
                              train_vision=train_vision)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer: torch.optim.AdamW | None = None
        self.steps = 0
        self.model.train()

    # ---- forward / backward ------------------------------------------------------------------
    def forward_backward(self, prompts: list[Any], data: list[dict[str, np.ndarray]], loss_fn: str,
                         config: dict[str, Any], backward: bool) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        targets, inputs = checked_batch(prompts, data, loss_fn, config, self.vocab_size)
        outputs: list[dict[str, np.ndarray]] = [{} for _ in data]
        total = 0.0
        for batch in micro_batches(prompts):
            with torch.set_grad_enabled(backward):
                logps = prompt_logprobs(self.model, [prompts[i] for i in batch], [targets[i] for i in batch])
                loss, losses = batch_loss(logps, [inputs[i] for i in batch], batch, loss_fn, config)
                if backward:
                    loss.backward()
            total += float(loss.detach())
            for i, logp, loss_T in zip(batch, logps, losses):
                outputs[i] = datum_output(logp, loss_T)
        return outputs, {"loss:sum": total}

    # ---- optimizer -----------------------------------------------------------------------------
    def optim_step(self, adam: dict[str, Any]) -> dict[str, float]:
        step = AdamStep.from_params(adam)
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.params, lr=step.lr, betas=step.betas, eps=step.eps,
                                               weight_decay=step.weight_decay)
        step.apply(self.optimizer.param_groups)
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        if step.grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(self.params, step.grad_clip_norm, torch.tensor(norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm": norm, "learning_rate": step.lr}

    # ---- training state (mmrl/serve/state.py writes and reads the files) -------------------------
    def trainable_names(self) -> list[str]:
        """Names of `self.params`, in the same order (the optimizer's positional ids)."""
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    def adapter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(p.shape) for n, p in self.model.named_parameters() if ".lora_" in n}

    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """(AdamW's per-parameter state keyed `<param name>::<key>`, its hyperparameters) — ({}, None)
        before any step."""
        if self.optimizer is None:
            return {}, None
        sd = self.optimizer.state_dict()
        if len(sd["param_groups"]) != 1:  # one group is built here; a second would need its own ids
            raise RuntimeError("optimizer state with several parameter groups is not supported")
        names = self.trainable_names()
        tensors = {f"{names[i]}::{k}": v.detach().clone().contiguous()
                   for i, entry in sd["state"].items() for k, v in entry.items()}
        return tensors, {k: v for k, v in sd["param_groups"][0].items() if k != "params"}

    def load_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace the adapter (layout checked by the caller); accumulated gradients are dropped:
        they belong to the replaced weights."""
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if ".lora_" in n:
                    p.copy_(tensors[n].to(p.dtype))
        for p in self.params:
            p.grad = None

    def load_optimizer(self, tensors: dict[str, torch.Tensor] | None, hyper: dict[str, Any] | None) -> None:
        """AdamW's saved state (`optimizer_state`'s form), or with None a fresh optimizer (the next
        optim_step starts Adam anew)."""
        self.optimizer = None
        if tensors is None or hyper is None:
            return
        names = self.trainable_names()
        state: dict[int, dict[str, torch.Tensor]] = {}
        for i, name in enumerate(names):
            entry = {k.split("::", 1)[1]: v for k, v in tensors.items() if k.split("::", 1)[0] == name}
            if entry:
                state[i] = entry
        optimizer = torch.optim.AdamW(self.params, lr=float(hyper.get("lr", 1e-4)))
        group = {**hyper, "betas": tuple(hyper.get("betas", (0.9, 0.95))), "params": list(range(len(names)))}
        optimizer.load_state_dict({"state": state, "param_groups": [group]})
        self.optimizer = optimizer

    def close(self) -> None:
        """Nothing outside this process to release (the ranks' trainer kills its actors here)."""

    # ---- weights -------------------------------------------------------------------------------
    def adapter_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone().contiguous() for n, p in self.model.named_parameters() if ".lora_" in n}

    def merged_lora_deltas(self) -> dict[str, torch.Tensor]:
        """HF checkpoint name -> the adapter's weight delta (alpha/r) * B @ A, per adapted layer."""
        from mmrl.weight_sync.gather import weight_units

        return lora_deltas(weight_units(self.model))
