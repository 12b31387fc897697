"""Controller pieces that run without engines: prompt rejection into the quarantine report.
(How a step's trajectories are split over trainer ranks: tests/test_trainer_plan.py.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from _data_media import REFUSED_IMAGE_SIZES, image_bytes, js, write_tar

from mmrl.controller.prompts import MAX_FAILURES_BEFORE_FIRST_SUCCESS, ProcessorFailing, PromptBatches, process_samples
from mmrl.data.quarantine import QuarantineLedger
from mmrl.data.stream import ShardStream
from mmrl.processors import build_processor


def test_rejected_prompt_goes_to_the_quarantine_report(tiny_model_dir: Path, colors_samples: list,
                                                      tmp_path: Path) -> None:
    proc = build_processor("qwen_vl", str(tiny_model_dir), max_prompt_tokens=10)
    ledger = QuarantineLedger(tmp_path / "q.jsonl", max_bad_ratio=None)
    rejected: set[str] = set()
    pairs, failures = process_samples(proc, colors_samples[:3], rejected, ledger)
    assert pairs == [] and [f.reason for f in failures] == ["prompt_rejected"] * 3
    assert len(rejected) == 3 and ledger.counts["prompt_rejected"] == 3
    rows = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert [r["key"] for r in rows] == [s.key for s in colors_samples[:3]]
    assert all("max_prompt_tokens=10" in r["detail"] for r in rows)


def _shard_with_refused_images(path: Path, n_good: int) -> tuple[str, list[str], list[str]]:
    """A shard whose refused images reach the processor: a stream without media limits stands in
    for a processor adapter that declares none, so the real Qwen processor raises in the driver."""
    good = [f"good-{i:02d}" for i in range(n_good)]
    refused = [f"refused-{w}x{h}" for w, h in REFUSED_IMAGE_SIZES]
    samples = [(k, [("json", js(prompt="What colour is the shape?", answer="red")), ("png", image_bytes(size=(32, 32)))])
               for k in good]
    samples += [(k, [("json", js(prompt="What colour is the shape?", answer="red")), ("png", image_bytes(size=size))])
                for k, size in zip(refused, REFUSED_IMAGE_SIZES)]
    samples.sort(key=lambda s: s[0][::-1])  # refused ones spread between good ones
    return write_tar(path, samples), good, refused


def test_any_processor_error_is_quarantined_and_the_batch_refilled(tiny_model_dir: Path, tmp_path: Path) -> None:
    url, good, refused = _shard_with_refused_images(tmp_path / "odd.tar", n_good=12)
    stream = ShardStream(url, shuffle_buffer=0, quarantine_path=tmp_path / "q.jsonl", max_bad_ratio=None)
    batches = PromptBatches(stream, build_processor("auto", str(tiny_model_dir)), size=4)
    trained = [s.key for _ in range(3) for s, _ in batches()]
    assert sorted(trained) == good  # full batches; every good sample once, in one epoch
    rows = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert sorted(r["key"] for r in rows) == sorted(refused) == sorted(batches.rejected)
    assert all(r["reason"] == "processor_error" and r["url"] == url for r in rows)
    assert all(r["detail"].startswith("ValueError: absolute aspect ratio must be smaller than 200") for r in rows)
    # counted like the worker's bad samples: in the ledger (metric data/bad_samples), once each
    assert stream.bad_counts["processor_error"] == len(refused) and stream.quarantine.seen == len(good) + len(refused)


def test_a_processor_that_fails_on_everything_stops_the_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    url, _, _ = _shard_with_refused_images(tmp_path / "odd.tar", n_good=40)
    stream = ShardStream(url, shuffle_buffer=0, max_bad_ratio=None)
    processor = build_processor("auto", str(tiny_model_dir), max_prompt_tokens=5)  # nothing fits
    with pytest.raises(ProcessorFailing, match="processor.max_prompt_tokens") as e:
        PromptBatches(stream, processor, size=8)()
    assert f"first {MAX_FAILURES_BEFORE_FIRST_SUCCESS} samples" in str(e.value)
    assert str(tiny_model_dir) in str(e.value)


def test_neighbouring_steps_never_share_a_sampling_seed() -> None:
    """Every sample of every step gets its own random stream. (Seeds of seed + step replayed the
    previous step's streams shifted by one sample, and exploration stalled.)"""
    from mmrl.controller.loop import step_seed
    from mmrl.rollout.engine import SEED_STRIDE
    from mmrl.rollout.types import SamplingConfig

    steps, prompts, group = 300, 32, 16
    seeds = {SamplingConfig(seed=step_seed(0, s)).for_requests_from(i).seed + j
             for s in range(steps) for i in range(prompts) for j in range(group)}
    assert len(seeds) == steps * prompts * group
    assert step_seed(0, 5) == step_seed(0, 5) != step_seed(1, 5)
    assert SamplingConfig(seed=10).for_requests_from(3).seed == 10 + 3 * SEED_STRIDE
