"""Controller pieces that run without engines: prompt rejection into the quarantine report.
(How a step's trajectories are split over trainer ranks: tests/test_trainer_plan.py.)"""
from __future__ import annotations

import json
from pathlib import Path

from mmrl.controller.loop import _prompts
from mmrl.data.quarantine import QuarantineLedger
from mmrl.processors import build_processor


def test_rejected_prompt_goes_to_the_quarantine_report(tiny_model_dir: Path, colors_samples: list,
                                                      tmp_path: Path) -> None:
    proc = build_processor("qwen_vl", str(tiny_model_dir), max_prompt_tokens=10)
    ledger = QuarantineLedger(tmp_path / "q.jsonl", max_bad_ratio=None)
    rejected: set[str] = set()
    assert _prompts(proc, colors_samples[:3], rejected, ledger) == []
    assert len(rejected) == 3 and ledger.counts["prompt_rejected"] == 3
    rows = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert [r["key"] for r in rows] == [s.key for s in colors_samples[:3]]
    assert all("max_prompt_tokens=10" in r["detail"] for r in rows)


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
