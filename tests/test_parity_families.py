"""Per-family logprob parity on video, multi-image and mixed prompts: the real vLLM engine (in a
Ray actor) vs the trainer's logprob computation (the same batch layout, explicit M-RoPE positions
and sampling transform the ZeRO-3 ranks use), fp32. tests/test_parity.py covers the same check
through the 2-rank ZeRO-3 trainer and a weight sync on image prompts."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from transformers import AutoModelForImageTextToText

from mmrl.data.sample import Sample, Video, messages_from_prompt
from mmrl.models.tiny_vlm import build_tiny_vlm
from mmrl.processors import build_processor
from mmrl.rollout.client import generate_groups
from mmrl.rollout.engine import RolloutEngine, cpu_engine_defaults, engine_kwargs
from mmrl.rollout.types import SamplingConfig
from mmrl.trainer.batch import TrainSequence, collate, sampling_logprobs
from mmrl.utils.env import engine_env, init_local_ray

pytestmark = pytest.mark.slow


def _samples(colors_samples: list) -> list[Sample]:
    rng = np.random.default_rng(1)
    # a square moving right over 8 frames: real structure, not noise
    frames = np.full((8, 56, 56, 3), 128, dtype=np.uint8)
    for t in range(8):
        frames[t, 20:36, 4 + 4 * t:20 + 4 * t] = (220, 30, 30)
    frames = np.clip(frames + rng.normal(0, 8, frames.shape), 0, 255).astype(np.uint8)
    video = Video(frames=frames, fps=2.0, frame_indices=list(range(0, 16, 2)), source_fps=4.0, total_num_frames=16)
    a, b = colors_samples[0].images[0], colors_samples[1].images[0]
    return [
        Sample(key="video", messages=messages_from_prompt("Which direction does the shape move?", n_videos=1),
               videos=[video]),
        Sample(key="two-images", messages=messages_from_prompt("Same colour in both?", n_images=2), images=[a, b]),
        Sample(key="mixed", messages=[{"role": "user", "content": [
            {"type": "image"}, {"type": "video"}, {"type": "text", "text": "Is the image a frame of the video?"}]}],
            images=[a], videos=[video]),
    ]


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    init_local_ray(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_video_and_multi_image_parity(arch: str, tmp_path: Path, colors_samples: list) -> None:
    model_dir = str(build_tiny_vlm(arch, tmp_path / arch, seed=3))
    proc = build_processor("auto", model_dir)
    samples = _samples(colors_samples)
    prompts = [proc(s) for s in samples]
    env = engine_env(tmp_path / "run", "cpu", {"VLLM_LOGGING_LEVEL": "ERROR"})
    llm_kwargs = cpu_engine_defaults(engine_kwargs(model_dir, "float32", 0, {
        "max_model_len": 1024, "limit_mm_per_prompt": {"image": 2, "video": 1}}))
    engine = RolloutEngine.as_actor({"num_cpus": 1}, llm_kwargs, env)
    try:
        sampling = SamplingConfig(n=3, max_new_tokens=6, forbidden_token_ids=proc.forbidden_token_ids)
        ray.get(engine.ready.remote())
        groups = generate_groups([engine], [p.vllm_input for p in prompts], sampling)
    finally:
        ray.get(engine.shutdown.remote())
        ray.kill(engine)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    seqs = [TrainSequence.from_prompt(p, c.token_ids, c.logprobs, [1] * len(c.token_ids))
            for p, group in zip(prompts, groups) for c in group]
    mb = collate(seqs, proc.pad_token_id)
    with torch.no_grad():
        logits = model(**mb.model_inputs()).logits
    logprobs_BT, _ = sampling_logprobs(logits, mb.response_ids_BT, 1.0, proc.forbidden_token_ids)
    diff_BT = (logprobs_BT - mb.behaviour_logprobs_BT).abs() * mb.mask_BT
    mean_diff = float(diff_BT.sum() / mb.mask_BT.sum())
    per_prompt = [float(diff_BT[i * 3:(i + 1) * 3].sum() / mb.mask_BT[i * 3:(i + 1) * 3].sum()) for i in range(3)]
    assert mean_diff <= 1e-4, (arch, per_prompt)
    assert all(d <= 1e-4 for d in per_prompt), (arch, dict(zip([s.key for s in samples], per_prompt)))
