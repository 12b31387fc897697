"""trainer.freeze_vision_tower / freeze_projector / gradient_checkpointing (mmrl/trainer/model_setup.py).

The rank tests drive the real trainer rank (`TrainerWorker`: DeepSpeed ZeRO-3, the optimizer
built from the trainable parameters, the update, the weight gather the sync uses) in this
process at world size 1, on the tiny Qwen2.5-VL."""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from mmrl.data.sample import Sample, messages_from_prompt
from mmrl.models.tiny_vlm import build_tiny_vlm
from mmrl.processors import build_processor
from mmrl.trainer.batch import TrainSequence, collate
from mmrl.trainer.model_setup import (VisionPartsNotFound, checkpointing_paused, enable_gradient_checkpointing,
                                      find_vision_parts, freeze_vision)
from mmrl.trainer.plan import plan_updates


def _samples(n: int) -> list[Sample]:
    rng = np.random.default_rng(0)
    return [Sample(key=f"s{i}", messages=messages_from_prompt("What colour is the shape?", n_images=1),
                   images=[Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8))])
            for i in range(n)]


def _sequences(model_dir: Path, n_prompts: int = 2, group: int = 2) -> tuple[list[TrainSequence], int]:
    """A small GRPO-like batch with an image per prompt; responses of random ordinary tokens."""
    proc = build_processor("auto", str(model_dir))
    rng = np.random.default_rng(1)
    seqs = []
    for prompt in [proc(s) for s in _samples(n_prompts)]:
        for j in range(group):
            response = [int(t) for t in rng.integers(20, 200, size=3 + 2 * j)]
            seqs.append(TrainSequence.from_prompt(prompt, response, [-1.5] * len(response), [1] * len(response),
                                                  advantage=1.0 if j % 2 else -1.0))
    for uid, s in enumerate(seqs):
        s.uid = uid
    return seqs, proc.pad_token_id


@contextmanager
def trainer_rank(model_dir: Path, run_dir: Path, pad_id: int, **options: Any) -> Iterator[Any]:
    """One real ZeRO-3 trainer rank (world size 1) in this process; the process environment,
    thread count and transformers' DeepSpeed hook are restored afterwards."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from mmrl.trainer.update import LossSettings
    from mmrl.trainer.worker import TrainerSpec, TrainerWorker
    from mmrl.utils.env import engine_env

    saved_env, threads = dict(os.environ), torch.get_num_threads()
    options = {"dtype": "float32", **options}
    spec = TrainerSpec(model_path=str(model_dir), world_size=1,
                       device="cpu", lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0, grad_clip=1e6, deepspeed={},
                       temperature=1.0, forbidden_token_ids=[], pad_token_id=pad_id, loss=LossSettings(), seed=0,
                       env=engine_env(run_dir, "cpu"), **options)
    worker = TrainerWorker(0, spec)
    try:
        worker.setup(worker.open_rendezvous())
        yield worker
    finally:
        try:
            worker.shutdown()
        finally:
            unset_hf_deepspeed_config()
            os.environ.clear()
            os.environ.update(saved_env)
            torch.set_num_threads(threads)


def _is_tower(name: str) -> bool:
    return ".visual." in name and ".merger." not in name


def _optimizer_numel(worker: Any) -> int:
    """Elements of Adam's first moment over all of DeepSpeed's fp32 partitions."""
    states = worker.engine.optimizer.optimizer.state.values()
    return sum(s["exp_avg"].numel() for s in states)


def test_frozen_tower_gets_no_optimizer_state_and_does_not_change_checkpointing_changes_nothing(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Frozen encoder: no optimizer state, unchanged after updates (and still gathered for the
    weight sync); the merger and the text model train. Gradient checkpointing on top gives the
    same losses, gradient norms and weights as the same rank without it."""
    seqs, pad_id = _sequences(tiny_model_dir)
    inputs = plan_updates(seqs, world_size=1, micro_batch_size=2)[0]
    results = {}
    for checkpointing in (True, False):
        with trainer_rank(tiny_model_dir, tmp_path / str(checkpointing), pad_id, freeze_vision_tower=True,
                          gradient_checkpointing=checkpointing) as rank:
            info = rank.setup_info()
            module = rank.engine.module
            layers = [m for m in module.modules() if getattr(m, "gradient_checkpointing", False)]
            assert bool(layers) == checkpointing
            # the frozen tower is left out of checkpointing (it runs no backward)
            assert not any(getattr(m, "gradient_checkpointing", False) for m in module.model.visual.blocks.modules())
            before = rank.full_state_dict()
            stats = [rank.train_step(inputs) for _ in range(2)]
            after = rank.full_state_dict()
            optimizer_numel = _optimizer_numel(rank)
            if not checkpointing:  # the checkpoint keeps the frozen weights (what `mmrl export` reads)
                from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

                rank.save_checkpoint(str(tmp_path / "ckpt"))
                saved = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"), tag="deepspeed")
                assert set(saved) == set(after)
                assert all(torch.equal(saved[n], after[n]) for n in saved if n in after)
            in_optimizer = {id(p) for group in rank.engine.optimizer.fp16_groups for p in group}
            frozen_in_optimizer = [n for n, p in module.named_parameters() if _is_tower(n) and id(p) in in_optimizer]
        tower = [n for n in before if _is_tower(n)]
        tower_numel = sum(before[n].numel() for n in tower)
        assert tower and info["frozen_vision_tensors"] == len(tower)
        assert info["trainable"] == info["params"] - tower_numel
        assert optimizer_numel == info["trainable"] and not frozen_in_optimizer  # no state for the tower
        assert set(before) == set(after)  # the gather for the weight sync still holds the tower
        assert all(torch.equal(before[n], after[n]) for n in tower)
        merger = [n for n in before if ".merger." in n]
        text = [n for n in before if ".language_model." in n or n.startswith("lm_head")]
        assert all(not torch.equal(before[n], after[n]) for n in merger + text if n.endswith("weight"))
        assert all(s["skipped_updates"] == 0 for s in stats)
        results[checkpointing] = (stats, after)
    (stats_ckpt, after_ckpt), (stats_plain, after_plain) = results[True], results[False]
    for a, b in zip(stats_ckpt, stats_plain):
        assert a["pg_loss"] == pytest.approx(b["pg_loss"], rel=1e-5, abs=1e-7)
        assert a["grad_norms"] == pytest.approx(b["grad_norms"], rel=1e-5)
    for name in after_plain:
        assert torch.allclose(after_ckpt[name], after_plain[name], atol=1e-6, rtol=1e-5), name


def test_frozen_projector_and_lora(tiny_model_dir: Path, tmp_path: Path) -> None:
    """freeze_projector freezes Qwen's merger as well; with LoRA only the text model's adapters
    train (nothing of the vision side holds optimizer state)."""
    seqs, pad_id = _sequences(tiny_model_dir)
    inputs = plan_updates(seqs, world_size=1, micro_batch_size=4)[0]
    lora = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "qkv"]}
    with trainer_rank(tiny_model_dir, tmp_path, pad_id, freeze_vision_tower=True, freeze_projector=True,
                      gradient_checkpointing=True, lora=lora) as rank:
        trainable = [n for n, p in rank.engine.module.named_parameters() if p.requires_grad]
        before = rank.full_state_dict()
        rank.train_step(inputs)
        after = rank.full_state_dict()
        optimizer_numel = _optimizer_numel(rank)
    assert trainable and all(".lora_" in n and ".language_model." in n for n in trainable), trainable
    assert optimizer_numel == rank.setup_info()["trainable"]
    changed = [n for n in after if not torch.equal(before[n], after[n])]
    assert changed and all(n.endswith(("q_proj.weight", "v_proj.weight")) and ".language_model." in n
                           for n in changed), changed


def test_a_bfloat16_rank_trains_bf16_weights_from_fp32_master_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    """model.dtype=bfloat16 (what a 7B run uses): the module's weights are bf16, DeepSpeed keeps the
    optimizer's master copy in fp32 and the module's weights are that copy rounded to bf16. Adam
    steps smaller than bf16's spacing still add up in the master copy: one Adam step at lr 1e-5 is
    below the spacing of bf16 near the weights' ~0.02 scale (~8e-5) and moves few bf16 weights,
    yet it moved (nearly) every fp32 master element."""
    seqs, pad_id = _sequences(tiny_model_dir)
    inputs = plan_updates(seqs, world_size=1, micro_batch_size=4)[0]
    with trainer_rank(tiny_model_dir, tmp_path, pad_id, dtype="bfloat16") as rank:
        module, optimizer = rank.engine.module, rank.engine.optimizer
        assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
        masters = optimizer.fp32_partitioned_groups_flat
        assert masters and {m.dtype for m in masters} == {torch.float32}
        before_master = [m.detach().clone() for m in masters]
        before = rank.full_state_dict()
        rank.set_lr(1e-5)
        stats = rank.train_step(inputs)
        after = rank.full_state_dict()
        assert np.isfinite(stats["pg_loss"]) and stats["skipped_updates"] == 0
        moved = sum(int((a != b).sum()) for a, b in zip(masters, before_master))
        assert moved > 0.5 * sum(m.numel() for m in masters)  # Adam moves every trained element
        # the bf16 weights are the rounded masters: few changed at all after this small step
        flat_after = torch.cat([t.flatten() for t in after.values()])
        flat_before = torch.cat([t.flatten() for t in before.values()])
        assert flat_after.dtype == torch.bfloat16
        changed = int((flat_after != flat_before).sum())
        print(f"bf16 weights changed by one step: {changed} of {flat_after.numel()}; fp32 masters moved: {moved}")
        assert changed < 0.5 * flat_after.numel(), (changed, flat_after.numel())
        # the module's weights (its bf16 partitions) are the master copy rounded to bf16
        bf16_flat = optimizer.fp16_partitioned_groups_flat
        assert [b.numel() for b in bf16_flat] == [m.numel() for m in masters]
        assert all(torch.equal(b, m.to(torch.bfloat16)) for b, m in zip(bf16_flat, masters))


def _loss_and_grads(model: torch.nn.Module, seqs: list[TrainSequence], pad_id: int) -> tuple[float, dict]:
    mb = collate(seqs, pad_id)
    logprobs_BT, entropy_BT = mb.response_logprobs(model(**mb.model_inputs()).logits, 1.0, [])
    loss = -((logprobs_BT + 0.1 * entropy_BT) * mb.mask_BT * mb.advantages_B[:, None]).sum()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model_dir: Path) -> None:
    """Checkpointing the text model and the (trained) vision tower recomputes every layer in the
    backward (each checkpointed layer runs twice) and gives the plain run's loss and gradients."""
    seqs, pad_id = _sequences(tiny_model_dir, n_prompts=2, group=2)
    calls = {}
    results = {}
    for checkpointing in (False, True):
        model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir).train()
        if checkpointing:
            enable_gradient_checkpointing(model, skip_vision_tower=False)
        counted = {"text": model.model.language_model.layers[0], "vision": model.model.visual.blocks[0]}
        calls[checkpointing] = dict.fromkeys(counted, 0)
        for key, layer in counted.items():
            # a pre-hook: the recompute stops once it has what the backward needs (torch's early
            # stop), before the layer's forward hooks would run
            layer.register_forward_pre_hook(lambda *_, key=key, c=calls[checkpointing]: c.__setitem__(key, c[key] + 1))
        results[checkpointing] = _loss_and_grads(model, seqs, pad_id)
    assert calls[False] == {"text": 1, "vision": 1}  # one forward (all images in one tower call)
    assert calls[True] == {"text": 2, "vision": 2}  # forward + recompute in the backward
    (loss_plain, plain), (loss_ckpt, ckpt) = results[False], results[True]
    assert loss_ckpt == pytest.approx(loss_plain, rel=1e-6)
    assert plain.keys() == ckpt.keys() and any(".visual." in n for n in plain)
    for name in plain:
        assert torch.allclose(ckpt[name], plain[name], atol=1e-6, rtol=1e-5), name


def test_checkpointing_pauses_for_sampling(tiny_model_dir: Path) -> None:
    """Sampling with the trainer's model (rollout.backend=trainer) needs the KV cache, which a
    checkpointed layer drops in training mode: the pause turns it off and back on."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir).train()
    enable_gradient_checkpointing(model, skip_vision_tower=True)
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    assert flagged and not any(getattr(m, "gradient_checkpointing", False) for m in model.model.visual.modules())
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        with checkpointing_paused(model):
            assert not any(m.gradient_checkpointing for m in flagged)
            cache = model(input_ids=ids, use_cache=True).past_key_values
        assert cache is not None and cache.get_seq_length() == 4
        assert model(input_ids=ids, use_cache=True).past_key_values is None  # what the pause avoids
    assert all(m.gradient_checkpointing for m in flagged)


@pytest.mark.parametrize("arch, tower, projector", [
    ("qwen2_vl", ["model.visual"], ["model.visual.merger"]),
    ("qwen3_vl", ["model.visual"], ["model.visual.deepstack_merger_list", "model.visual.merger"]),
    ("llava", ["model.vision_tower"], ["model.multi_modal_projector"]),
    ("internvl", ["model.vision_tower"], ["model.multi_modal_projector"]),
])
def test_vision_parts_of_every_family(arch: str, tower: list[str], projector: list[str], tmp_path: Path) -> None:
    """The encoder and projector are found by name in every supported family (built on the meta
    device: no weights), also inside a peft wrapper, and freezing touches exactly them."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(build_tiny_vlm(arch, tmp_path / arch, seed=0))
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    parts = find_vision_parts(model)
    assert parts.tower == tower and sorted(parts.projector) == projector
    frozen = set(freeze_vision(model, tower=True, projector=False))
    assert frozen == {n for n, _ in model.named_parameters() if parts.is_tower(n)} and frozen
    assert all(p.requires_grad for n, p in model.named_parameters() if n not in frozen)
    assert any(parts.is_projector(n) for n, p in model.named_parameters() if p.requires_grad)
    with torch.device("meta"):
        wrapped = get_peft_model(AutoModelForImageTextToText.from_config(config),
                                 LoraConfig(r=2, target_modules=["q_proj"]))
    assert find_vision_parts(wrapped).tower == ["base_model.model." + t for t in tower]


def test_no_vision_tower_is_a_clear_error() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(VisionPartsNotFound, match=r"no vision tower in LlamaForCausalLM.*visual, vision_tower"):
        freeze_vision(model, tower=True, projector=False)
    assert freeze_vision(model, tower=False, projector=False) == []
