"""trainer.padding_free: sequences packed end to end in one row give the same response logprobs,
entropies and gradients as the padded layout, for every Qwen-VL family, with images, videos,
several images per prompt and a response that carries an image of its own (a tool's result)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _data_media import video_and_multi_image_samples
from transformers import AutoModelForImageTextToText

from mmrl.models.tiny_vlm import build_tiny_vlm
from mmrl.processors import build_processor
from mmrl.trainer.batch import TrainSequence, collate
from mmrl.trainer.plan import pack_micro_batches, padded_tokens


def _sequences(proc, samples) -> list[TrainSequence]:
    prompts = [proc(s) for s in samples]
    responses = [[11, 12, 13], [14], [15, 16], [17, 18, 19, 20, 21, 22, 23], [24]]
    seqs = [TrainSequence.from_prompt(p, r, [-1.0] * len(r), [1] * len(r), advantage=1.0)
            for p, r in zip(prompts, responses)]
    # a response holding an image: a tool's screenshot between two generated turns. Its tokens
    # are another prompt's; its positions continue after this sequence's prompt.
    first, tool = prompts[0], prompts[1]
    response = [30, 31, *tool.prompt_ids, 32, 33]
    n_tool = len(tool.prompt_ids)
    text_before = first.next_position + torch.arange(2).expand(3, 2)
    image_part = tool.positions_AP + first.next_position + 2
    after = int(image_part.max()) + 1 + torch.arange(2).expand(3, 2)
    seqs.append(TrainSequence(
        prompt_ids=first.prompt_ids, positions_AP=first.positions_AP, next_position=first.next_position,
        mm_inputs=first.mm_inputs, response_ids=response, behaviour_logprobs=[-1.0] * len(response),
        loss_mask=[1, 1] + [0] * n_tool + [1, 1], advantage=-1.0,
        response_positions_AT=torch.cat([text_before, image_part, after], dim=1),
        response_mm_inputs=tool.mm_inputs))
    return seqs


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_packed_row_equals_padded_rows(arch: str, tmp_path: Path, colors_samples: list) -> None:
    model_dir = build_tiny_vlm(arch, tmp_path / arch, seed=1)
    proc = build_processor("auto", str(model_dir))
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    seqs = _sequences(proc, colors_samples[:2] + video_and_multi_image_samples(colors_samples))
    padded = collate(seqs, proc.pad_token_id)
    packed = collate(seqs, proc.pad_token_id, padding_free=True)
    n_tokens = sum(s.num_tokens for s in seqs)
    assert packed.input_ids_BL.shape == (1, n_tokens) and proc.pad_token_id not in packed.input_ids_BL.tolist()[0]
    assert packed.position_ids_ABL.shape == (4, 1, n_tokens)
    assert padded.input_ids_BL.numel() > n_tokens  # the padded layout does pay for padding here
    for name in ("response_ids_BT", "mask_BT", "behaviour_logprobs_BT", "advantages_B"):
        assert torch.equal(getattr(packed, name), getattr(padded, name)), name
    with torch.no_grad():
        lp_pad, ent_pad = padded.response_logprobs(model(**padded.model_inputs()).logits, 1.0, [])
        lp_pack, ent_pack = packed.response_logprobs(model(**packed.model_inputs()).logits, 1.0, [])
    valid = padded.mask_BT > 0
    assert torch.allclose(lp_pack[valid], lp_pad[valid], atol=1e-4), (lp_pack - lp_pad)[valid].abs().max()
    assert torch.allclose(ent_pack[valid], ent_pad[valid], atol=1e-4)
    # positions past a response's end are zeros in the packed layout (nothing computed there)
    assert not lp_pack[~packed.response_present_BT].any()


def test_packed_gradients_equal_padded(tiny_model_dir: Path, colors_samples: list) -> None:
    """The loss through the packed row backpropagates the same gradient, vision tower included."""
    proc = build_processor("auto", str(tiny_model_dir))
    seqs = _sequences(proc, colors_samples[:2] + video_and_multi_image_samples(colors_samples))
    grads = []
    for padding_free in (False, True):
        model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)
        mb = collate(seqs, proc.pad_token_id, padding_free=padding_free)
        logprobs_BT, entropy_BT = mb.response_logprobs(model(**mb.model_inputs()).logits, 0.7, [proc.image_token_id])
        loss = -((logprobs_BT + 0.1 * entropy_BT) * mb.mask_BT * mb.advantages_B[:, None]).sum()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    padded, packed = grads
    assert padded.keys() == packed.keys() and any("visual" in n for n in padded)
    for name in padded:
        assert torch.allclose(packed[name], padded[name], atol=1e-5, rtol=1e-4), name


def test_the_plan_budgets_real_tokens_when_padding_free(tiny_model_dir: Path, colors_samples: list) -> None:
    """With padding_free the micro-batch token budget counts tokens, not rows x the longest."""
    proc = build_processor("auto", str(tiny_model_dir))
    seqs = _sequences(proc, colors_samples[:2] + video_and_multi_image_samples(colors_samples))
    real = sum(s.num_tokens for s in seqs)
    assert padded_tokens(seqs, padding_free=True) == real < padded_tokens(seqs)
    budget = real  # all of them fit padding-free; padded, they need several micro-batches
    assert len(pack_micro_batches(seqs, max_rows=64, max_tokens=budget, padding_free=True)) == 1
    assert len(pack_micro_batches(seqs, max_rows=64, max_tokens=budget)) > 1


def test_the_update_reports_its_padding(tiny_model_dir: Path, colors_samples: list) -> None:
    """actor/padding_fraction: the share of the forward's tokens that are padding, over all ranks;
    0 with padding_free."""
    from mmrl.controller.learn import forward_token_metrics
    from mmrl.trainer.plan import plan_updates

    proc = build_processor("auto", str(tiny_model_dir))
    seqs = _sequences(proc, colors_samples[:2] + video_and_multi_image_samples(colors_samples))
    real = sum(s.num_tokens for s in seqs)
    for padding_free in (False, True):
        inputs = plan_updates(seqs, world_size=2, micro_batch_size=2, padding_free=padding_free)
        m = forward_token_metrics(inputs, padding_free)
        expected = sum(padded_tokens(c, padding_free) for x in inputs for mini in x.mini_batches
                       for c in mini.micro_batches)
        assert m["actor/forward_tokens"] == expected
        assert m["actor/padding_fraction"] == pytest.approx(1 - real / expected)
        assert (m["actor/padding_fraction"] == 0) == padding_free


def test_plain_positions_need_no_family_knowledge() -> None:
    """A family with one position axis (A = 1): the batcher hands the model (B, L) positions, and
    packed sequences restart their positions, which is all transformers needs to keep attention
    inside each one. Shown on a tiny random text-only decoder, padded vs packed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mmrl.trainer.batch import model_positions

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         attn_implementation="sdpa")).eval()
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    responses = [[20, 21, 22], [23], [24, 25, 26, 27]]
    seqs = [TrainSequence(prompt_ids=p, positions_AP=torch.arange(len(p)).unsqueeze(0), next_position=len(p),
                          mm_inputs={}, response_ids=r, behaviour_logprobs=[-1.0] * len(r), loss_mask=[1] * len(r))
            for p, r in zip(prompts, responses)]
    padded, packed = collate(seqs, 0), collate(seqs, 0, padding_free=True)
    assert padded.model_inputs()["position_ids"].shape == padded.input_ids_BL.shape
    assert packed.model_inputs()["position_ids"].tolist() == [[*range(8), *range(3), *range(7)]]
    with torch.no_grad():
        lp_pad, _ = padded.response_logprobs(model(**padded.model_inputs()).logits, 1.0, [])
        lp_pack, _ = packed.response_logprobs(model(**packed.model_inputs()).logits, 1.0, [])
    valid = padded.mask_BT > 0
    assert torch.allclose(lp_pack[valid], lp_pad[valid], atol=1e-5), (lp_pack - lp_pad)[valid].abs().max()
    with pytest.raises(ValueError, match="different numbers of position axes"):
        collate([seqs[0], TrainSequence(prompt_ids=[1], positions_AP=torch.zeros((3, 1), dtype=torch.long),
                                        next_position=1, mm_inputs={}, response_ids=[2], behaviour_logprobs=[-1.0],
                                        loss_mask=[1])], 0)
    assert model_positions(torch.zeros((3, 2, 5))).shape == (3, 2, 5)
