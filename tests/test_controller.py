"""Controller pieces that run without engines: prompt rejection into the quarantine report,
and how a step's trajectories are split over trainer ranks."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from mmrl.controller.loop import _prompts, build_step_inputs
from mmrl.data.quarantine import QuarantineLedger
from mmrl.processors import build_processor
from mmrl.rollout.types import Trajectory
from mmrl.trainer.batch import micro_batches


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


def test_step_inputs_split_evenly_with_one_global_denominator(tiny_model_dir: Path, colors_samples: list) -> None:
    proc = build_processor("qwen_vl", str(tiny_model_dir))
    prompts = [proc(s) for s in colors_samples[:3]]
    lengths = [[1, 2, 3], [3, 3, 1], [2, 2, 2]]  # 3 prompts x group 3
    groups = [[Trajectory(i, [5] * n, [-1.0] * n, [1] * n, "", "stop", 0) for n in row] for i, row in enumerate(lengths)]
    adv = torch.arange(9, dtype=torch.float32).view(3, 3)
    inputs = build_step_inputs(prompts, groups, adv, world_size=2, micro_batch_size=2, loss_agg="token_mean")
    assert [len(x.sequences) for x in inputs] == [5, 4]
    assert {x.num_micro_batches for x in inputs} == {3}  # ceil(5 / 2) on every rank
    assert all(x.loss_denominator == 19.0 for x in inputs)  # all response tokens of the step
    assert [s.advantage for x in inputs for s in x.sequences] == list(range(9))
    seq_mean = build_step_inputs(prompts, groups, adv, 2, 2, "seq_mean_token_mean")
    assert seq_mean[0].loss_denominator == 9.0  # sequences, not tokens
    # the rank with 4 sequences still runs 3 micro-batches (no filler needed: 2+1+1)
    chunks = micro_batches(inputs[1].sequences, inputs[1].num_micro_batches)
    assert [len(c) for c, filler in chunks] == [2, 1, 1] and not any(f for _, f in chunks)
    filled = micro_batches(inputs[1].sequences[:1], 3)
    assert [f for _, f in filled] == [False, True, True]
    assert all(sum(c[0].loss_mask) == 0 for c, f in filled if f)  # fillers carry no loss
