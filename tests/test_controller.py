"""Controller pieces that run without engines: prompt rejection into the quarantine report, and
refused samples replaced in their slot by the rollout workers' pipeline (real Ray actors running
a loop that needs no engine). (How a step's trajectories are split over trainer ranks:
tests/test_trainer_plan.py.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from _data_media import REFUSED_IMAGE_SIZES, image_bytes, js, write_tar

from mmrl.controller.prompts import MAX_FAILURES_BEFORE_FIRST_SUCCESS, ProcessorFailing, SampleBatches
from mmrl.data.quarantine import QuarantineLedger
from mmrl.data.stream import ShardStream
from mmrl.processors import build_processor, process_sample


def test_rejected_prompt_goes_to_the_quarantine_report(tiny_model_dir: Path, colors_samples: list,
                                                      tmp_path: Path) -> None:
    proc = build_processor("qwen_vl", str(tiny_model_dir), max_prompt_tokens=10)
    ledger = QuarantineLedger(tmp_path / "q.jsonl", max_bad_ratio=None)
    batches = SampleBatches(_LedgerOnly(ledger), size=3)
    failures = [process_sample(proc, s) for s in colors_samples[:3]]
    assert [f.reason for f in failures] == ["prompt_rejected"] * 3
    for bad in failures:
        batches.record_failure(bad)
    assert len(batches.rejected) == 3 and ledger.counts["prompt_rejected"] == 3
    rows = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert [r["key"] for r in rows] == [s.key for s in colors_samples[:3]]
    assert all("max_prompt_tokens=10" in r["detail"] for r in rows)


class _LedgerOnly:
    """The part of a ShardStream that SampleBatches.record_failure uses."""

    def __init__(self, ledger: QuarantineLedger):
        self.quarantine = ledger


NO_ENGINE_LOOP = """
from mmrl.rollout.agent_loops import make_trajectory
from mmrl.rollout.types import Completion


async def echo_length(ctx, sample, prompt):
    # answers with the prompt's length: exercises the workers without an engine
    return make_trajectory([Completion([len(prompt.prompt_ids)], [0.0], str(len(prompt.prompt_ids)), "stop", [0])])
"""


@pytest.fixture(scope="module")
def rollout_workers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    import ray

    from mmrl.rollout.workers import RolloutWorkers
    from mmrl.utils.env import init_local_ray

    plugin = tmp_path_factory.mktemp("loops") / "no_engine.py"
    plugin.write_text(NO_ENGINE_LOOP)
    init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    workers = RolloutWorkers(2, [], {"name": "auto", "model_path": str(tiny_model_dir)}, f"{plugin}:echo_length")
    workers.ready()
    yield workers
    workers.close()
    ray.shutdown()


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


def test_any_processor_error_is_quarantined_and_the_batch_refilled(rollout_workers, tmp_path: Path) -> None:
    from mmrl.controller.rollout import run_rollout
    from mmrl.rollout.types import SamplingConfig

    url, good, refused = _shard_with_refused_images(tmp_path / "odd.tar", n_good=12)
    stream = ShardStream(url, shuffle_buffer=0, quarantine_path=tmp_path / "q.jsonl", max_bad_ratio=None)
    batches = SampleBatches(stream, size=4)
    trained = []
    for _ in range(3):
        rollout = run_rollout(rollout_workers, batches(), SamplingConfig(n=2), refill=batches.refill,
                              on_failure=batches.record_failure)
        assert len(rollout.groups) == 4 and all(len(g) == 2 for g in rollout.groups)  # full batches
        assert [t.prompt_index for g in rollout.groups for t in g] == [0, 0, 1, 1, 2, 2, 3, 3]
        trained += [s.key for s in rollout.samples]
    assert sorted(trained) == good  # every good sample once, in one epoch
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
    batches = SampleBatches(stream, size=8, processor_name="QwenVLProcessor", model_path=str(tiny_model_dir))
    with pytest.raises(ProcessorFailing, match="processor.max_prompt_tokens") as e:
        while True:
            batches.record_failure(process_sample(processor, batches.refill()))
    assert f"first {MAX_FAILURES_BEFORE_FIRST_SUCCESS} samples" in str(e.value)
    assert str(tiny_model_dir) in str(e.value)


def test_neighbouring_steps_never_share_a_sampling_seed() -> None:
    """Every sample of every step gets its own random stream. (Seeds of seed + step replayed the
    previous step's streams shifted by one sample, and exploration stalled.)"""
    from mmrl.controller.loop import step_seed
    from mmrl.rollout.types import SEED_STRIDE, SamplingConfig

    steps, prompts, group = 300, 32, 16
    seeds = {SamplingConfig(seed=step_seed(0, s)).for_trajectory(i, j).seed
             for s in range(steps) for i in range(prompts) for j in range(group)}
    assert len(seeds) == steps * prompts * group
    assert step_seed(0, 5) == step_seed(0, 5) != step_seed(1, 5)
    assert SamplingConfig(seed=10).for_trajectory(3, 0).seed == 10 + 3 * SEED_STRIDE


def test_trainer_inputs_travel_by_reference(rollout_workers, colors_samples: list, tiny_model_dir: Path) -> None:
    """The driver gets a PromptRef per group (key, length, object ref), never the pixel tensors;
    resolving it (as a trainer rank does) gives exactly the processor's trainer side. Evaluation
    rollouts keep no trainer inputs at all."""
    import dataclasses

    import ray
    import torch

    from mmrl.controller.rollout import run_rollout
    from mmrl.processors import PromptRef
    from mmrl.rollout.types import SamplingConfig
    from mmrl.trainer.batch import TrainSequence, resolve_prompts

    samples = colors_samples[:3]
    rollout = run_rollout(rollout_workers, samples, SamplingConfig(n=2))
    processor = build_processor("auto", str(tiny_model_dir))
    for sample, ref, group in zip(rollout.samples, rollout.prompts, rollout.groups):
        assert isinstance(ref, PromptRef) and ref.key == sample.key
        assert not any(isinstance(v, torch.Tensor) for v in dataclasses.asdict(ref).values())
        local = processor(sample)
        assert ref.num_tokens == len(local.prompt_ids)
        seqs = [TrainSequence.from_prompt(ref, t.response_ids, t.behaviour_logprobs, t.loss_mask) for t in group]
        assert seqs[0].num_tokens == len(local.prompt_ids) + len(group[0].response_ids) and not seqs[0].prompt_ids
        resolve_prompts(seqs)
        for s in seqs:
            assert s.prompt_ids == local.prompt_ids and s.next_position == local.next_position
            assert torch.equal(s.positions_AP, local.positions_AP)
            assert all(torch.equal(s.mm_inputs[k], v) for k, v in local.mm_inputs.items())
        assert ray.get(ref.ref).vllm_input == {}  # the raw media stay with the sample, not in the store
    assert run_rollout(rollout_workers, samples, SamplingConfig(n=1), evaluation=True).prompts == [None] * 3
