"""The Qwen-VL adapter: one processor call feeds vLLM and the trainer consistently, and its
explicit M-RoPE positions are exactly what the model family computes for itself."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText

from _data_media import video_and_multi_image_samples
from mmrl.data.sample import Sample, Video, messages_from_prompt
from mmrl.models.tiny_vlm import build_tiny_vlm
from mmrl.processors import build_processor
from mmrl.processors.base import PromptRejected
from mmrl.trainer.batch import TrainSequence, collate, sampling_logprobs


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_explicit_positions_match_the_models_own(arch: str, tmp_path: Path, colors_samples: list) -> None:
    """Image, multi-image, video and mixed prompts, batched with padding, against each
    sequence alone with the model computing its own M-RoPE positions. (Qwen2/2.5-VL video
    prompts deliberately differ from transformers 5.19: see the next test.)"""
    model_dir = build_tiny_vlm(arch, tmp_path / arch, seed=1)
    proc = build_processor("auto", str(model_dir))
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    samples = colors_samples[:2] + video_and_multi_image_samples(colors_samples)
    prompts = [proc(s) for s in samples]
    responses = [[11, 12, 13], [14], [15, 16], [17, 18, 19, 20], [21]]
    seqs = [TrainSequence.from_prompt(p, r, [0.0] * len(r), [1] * len(r)) for p, r in zip(prompts, responses)]
    mb = collate(seqs, proc.pad_token_id)
    with torch.no_grad():
        ours = model(**mb.model_inputs()).logits
    # reference: each sequence alone, unpadded, positions computed by the model from mm_token_type_ids
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if not arch.startswith("qwen3_vl") and samples[i].videos:
            continue
        ids = torch.tensor([p.prompt_ids + r])
        types = torch.tensor([[1 if t == proc.image_token_id else 2 if t == proc.video_token_id else 0
                               for t in ids[0].tolist()]])
        with torch.no_grad():
            ref = model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                        use_cache=False, **p.mm_inputs).logits[0, len(p.prompt_ids) - 1:-1]
        assert torch.allclose(ours[i, :len(r)], ref, atol=1e-4), (arch, i, (ours[i, :len(r)] - ref).abs().max())


def test_vllm_prompt_is_the_trainer_prompt_with_one_pad_per_image(tiny_model_dir: Path, colors_samples: list) -> None:
    proc = build_processor("qwen_vl", str(tiny_model_dir))
    p = proc(colors_samples[0])
    text = proc.tokenizer.decode(p.vllm_input["prompt_token_ids"])
    assert text.count("<|image_pad|>") == 1 and "What colour is the shape?" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert p.prompt_ids.count(proc.image_token_id) == 4  # 56x56, patch 14, merge 2
    assert p.mm_inputs["pixel_values"].shape[0] == int(p.mm_inputs["image_grid_thw"].prod())


def test_prompt_longer_than_limit_is_rejected_not_truncated(tiny_model_dir: Path, colors_samples: list) -> None:
    proc = build_processor("qwen_vl", str(tiny_model_dir), max_prompt_tokens=10)
    with pytest.raises(PromptRejected, match="max_prompt_tokens=10"):
        proc(colors_samples[0])


def test_sampling_logprobs_apply_bias_and_temperature() -> None:
    logits_BTV = torch.tensor([[[1.0, 2.0, 3.0, 0.5]]])
    ids_BT = torch.tensor([[1]])
    lp, ent = sampling_logprobs(logits_BTV, ids_BT, temperature=2.0, forbidden_token_ids=[2])
    expected = torch.log_softmax(torch.tensor([1.0, 2.0, 3.0 - 100.0, 0.5]) / 2.0, -1)[1]
    assert torch.allclose(lp[0, 0], expected)
    p = torch.softmax(torch.tensor([1.0, 2.0, -97.0, 0.5]) / 2.0, -1)
    assert torch.allclose(ent[0, 0], -(p * p.log()).sum(), atol=1e-6)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl"])
def test_text_after_video_continues_after_the_whole_block(arch: str, tmp_path: Path, colors_samples: list) -> None:
    """vLLM and the original Qwen code start the text after a vision block at max(block)+1;
    transformers 5.19 uses start + max(h, w)/merge, which ignores the temporal extent of a
    video. We follow vLLM (the sampler), so the trainer's logprobs match the behaviour policy."""
    proc = build_processor("auto", str(build_tiny_vlm(arch, tmp_path / arch, seed=1)))
    sample = video_and_multi_image_samples(colors_samples)[0]
    p = proc(sample)
    pos = p.positions_AP
    video = [i for i, t in enumerate(p.prompt_ids) if t == proc.video_token_id]
    after = video[-1] + 1  # <|vision_end|>
    assert (pos[:, after] == pos[:, video[0]:after].max() + 1).all()
    t = int(p.mm_inputs["video_grid_thw"][0, 0])
    assert int(pos[0, video].max() - pos[0, video].min()) >= t - 1  # time really spans the block
    # the transformers rule would have put the text lower: this is the divergence we avoid
    model_cls_pos = proc._rope_index._cls.get_rope_index(
        proc._rope_index, input_ids=torch.tensor([p.prompt_ids]),
        mm_token_type_ids=torch.tensor([[2 if x == proc.video_token_id else 0 for x in p.prompt_ids]]),
        attention_mask=None, **{k: v for k, v in p.mm_inputs.items() if k in proc._rope_index.accepts})[0][:, 0]
    assert int(model_cls_pos[0, after]) < int(pos[0, after])


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_declared_media_limits_are_the_processors_own(arch: str, tmp_path: Path) -> None:
    """`media_limits` (checked in the loader workers) says exactly what the real HF processor
    refuses: right at a limit it processes, just past it it raises, and the limits flag it."""
    from PIL import Image

    proc = build_processor("auto", str(build_tiny_vlm(arch, tmp_path / arch, seed=1)))
    limits = proc.media_limits

    def image(width: int, height: int) -> Sample:
        return Sample(key=f"{width}x{height}", messages=messages_from_prompt("What is it?", n_images=1),
                      images=[Image.new("RGB", (width, height), (200, 30, 30))])

    def video(frames: int, height: int = 56, width: int = 56) -> Sample:
        return Sample(key=f"v{frames}", messages=messages_from_prompt("Which way?", n_videos=1),
                      videos=[Video(frames=np.zeros((frames, height, width, 3), np.uint8), fps=2.0,
                                    frame_indices=list(range(frames)), source_fps=2.0, total_num_frames=frames)])

    for width, height in [(200, 1), (2000, 10), (1, 1), (3, 40)]:  # at the ratio limit; tiny images upscale
        assert limits.image_problem(width, height) is None
        assert proc(image(width, height)).mm_inputs["image_grid_thw"].numel() == 3
    for width, height in [(201, 1), (1, 201), (8000, 12)]:
        assert "aspect ratio" in limits.image_problem(width, height)
        with pytest.raises(ValueError, match="aspect ratio"):
            proc(image(width, height))
    assert limits.video_problem(2, 400, 2) is None and "aspect ratio" in limits.video_problem(2, 402, 2)
    with pytest.raises(ValueError, match="aspect ratio"):
        proc(video(2, height=2, width=402))
    assert limits.video_problem(2, 56, 56) is None and proc(video(2)).mm_inputs["video_grid_thw"].numel() == 3
    if arch == "qwen3_vl":  # its video smart_resize needs a full temporal patch
        assert "frame" in limits.video_problem(1, 56, 56)
        with pytest.raises(ValueError, match="temporal_factor"):
            proc(video(1))
    else:
        assert limits.video_problem(1, 56, 56) is None and proc(video(1)).mm_inputs


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_expanding_the_engine_prompt_gives_the_trainer_prompt(arch: str, tmp_path: Path, colors_samples: list) -> None:
    """`expand(vllm_input)` (what rollout.backend=trainer sees) reproduces the trainer side of the
    one processor call exactly, for image, multi-image, video and mixed prompts; tokens appended
    after the prompt (a later turn) continue at the next text position."""
    proc = build_processor("auto", str(build_tiny_vlm(arch, tmp_path / arch, seed=1)))
    for sample in colors_samples[:1] + video_and_multi_image_samples(colors_samples):
        p = proc(sample)
        e = proc.expand(p.vllm_input)
        assert e.prompt_ids == p.prompt_ids, (arch, sample.key)
        assert torch.equal(e.positions_AP, p.positions_AP) and e.next_position == p.next_position
        assert sorted(e.mm_inputs) == sorted(p.mm_inputs)
        for k, v in p.mm_inputs.items():
            assert torch.equal(e.mm_inputs[k], v), (arch, sample.key, k)
        turn = proc.expand({**p.vllm_input, "prompt_token_ids": p.vllm_input["prompt_token_ids"] + [11, 12]})
        assert turn.prompt_ids == p.prompt_ids + [11, 12]
        assert turn.positions_AP[:, -2:].tolist() == [[p.next_position, p.next_position + 1]] * 3
    lone = proc(colors_samples[0]).vllm_input
    with pytest.raises(PromptRejected, match="more vision pads"):
        proc.expand({"prompt_token_ids": lone["prompt_token_ids"]})


def test_auto_picks_the_adapter_that_declares_the_model_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """processor.name "auto": the adapter whose own `model_types` lists the model's model_type. A
    subclass of a built-in does not inherit its model types (it cannot take over "auto" by being
    imported); two adapters declaring one type is an error that names both."""
    from mmrl import registry
    from mmrl.plugins.processors.qwen_vl import QwenVLProcessor
    from mmrl.processors.base import families

    assert families() == {"qwen2_vl": "qwen_vl", "qwen2_5_vl": "qwen_vl", "qwen3_vl": "qwen_vl", "qwen3_vl_moe": "qwen_vl",
                          "llava": "llava", "internvl": "internvl"}
    table = registry._REGISTRY["processor"]
    quiet = type("WithASystemPrompt", (QwenVLProcessor,), {})
    monkeypatch.setitem(table, "a_system_prompt", registry.Entry("processor", "a_system_prompt", quiet, "test"))
    monkeypatch.setitem(table, "qwen_alias", registry.Entry("processor", "qwen_alias", QwenVLProcessor, "test"))
    # inherited types are not declarations, and the same class under a second name is no rival
    assert registry.resolve("processor", families()["qwen2_5_vl"]) is QwenVLProcessor
    rival = type("Rival", (QwenVLProcessor,), {"model_types": ("qwen3_vl",)})
    monkeypatch.setitem(table, "rival", registry.Entry("processor", "rival", rival, "test"))
    with pytest.raises(registry.PluginError, match="and 'rival' both declare model_type 'qwen3_vl'"):
        families()
