"""rollout.backend=trainer: the ZeRO-3 ranks (2, gloo, fp32) sample the rollouts themselves,
behind the same router, rollout workers and agent loops as the vLLM engines (here a two-turn
loop with a tool output between the turns). The behaviour logprobs come from the forward the
update runs, so the mismatch metric reads zero: what is left is floating-point reduction order
between batch shapes, below 1e-5 where vLLM's CPU engine in fp32 is allowed 1e-4."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from _engine import demo_runtime

from mmrl import registry
from mmrl.config import load_config
from mmrl.config.load import ConfigError
from mmrl.controller.learn import logprob_pass, make_sequences
from mmrl.controller.loop import run_step
from mmrl.controller.rollout import run_rollout
from mmrl.rollout.types import SamplingConfig
from mmrl.utils.timing import StepSpans
from test_plugin_contracts import TWO_TURN_LOOP

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
TOOL_TEXT = " tool says: red"


@pytest.fixture(scope="module")
def runtime(tiny_model_dir: Path, colors_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    loop = tmp_path_factory.mktemp("loops") / "two_turn.py"
    loop.write_text(TWO_TURN_LOOP)
    with demo_runtime(tiny_model_dir, colors_dir, tmp_path_factory.mktemp("trainer_backend_run"),
                      "rollout.backend=trainer", f"rollout.agent_loop={loop}:two_turn",
                      f"rollout.agent_loop_args={{tool_text: '{TOOL_TEXT}'}}", "rollout.prompts_per_step=3",
                      "rollout.group_size=4", "rollout.max_new_tokens=4", "trainer.lr=0.02") as rt:
        yield rt


def test_training_steps_sampled_by_the_trainer_have_no_mismatch(runtime, colors_samples: list) -> None:
    rt = runtime
    assert rt.engines and all("TrainerRolloutEngine" in repr(e) for e in rt.engines)
    advantage = registry.resolve("advantage", rt.cfg.algorithm.advantage)
    for step in range(2):
        metrics, used = run_step(rt, colors_samples[3 * step:3 * step + 3], advantage, StepSpans(), step=step)
        assert len(used) == 3 and metrics["weight_version"] == step + 1
        assert metrics["mismatch/max_abs_logprob_diff"] <= 1e-5, metrics["mismatch/max_abs_logprob_diff"]
        assert metrics["mismatch/mean_abs_logprob_diff"] <= 1e-6
        assert metrics["weight_sync/mb"] == 0.0  # nothing to push: the sampler is the trainer
    assert metrics["rollout/engine_0/tokens_per_busy_s"] > 0


def test_two_turn_trajectories_match_the_trainers_recompute_and_carry_the_version(runtime, colors_samples: list) -> None:
    rt = runtime
    sampling = SamplingConfig(n=2, max_new_tokens=4, forbidden_token_ids=rt.sampling.forbidden_token_ids, seed=3)
    rollout = run_rollout(rt.workers, colors_samples[:3], sampling)
    tool_ids = rt.processor.tokenizer.encode(TOOL_TEXT, add_special_tokens=False)
    for group in rollout.groups:
        for t in group:
            assert t.timings["requests"] == 2
            assert [tok for tok, m in zip(t.response_ids, t.loss_mask) if not m] == tool_ids
            assert {v for v, m in zip(t.token_versions, t.loss_mask) if m} == {rt.weight_version}
            assert t.weight_version == rt.weight_version
    seqs = make_sequences(rollout.prompts, rollout.groups)
    logprob_pass(rt.trainers, seqs, rt.cfg, old=True, reference=False)
    diffs = np.concatenate([np.abs(np.asarray(s.old_logprobs) - np.asarray(s.behaviour_logprobs))[np.asarray(s.loss_mask) == 1]
                            for s in seqs])
    assert diffs.size and diffs.max() <= 1e-5, diffs.max()
    # The draws are the trajectory's own (seeded per request): the same requests in a different
    # batch (another prompt count, another split over the ranks) sample the same tokens.
    again = run_rollout(rt.workers, colors_samples[:2], sampling)
    assert [[t.response_ids for t in g] for g in again.groups] == [[t.response_ids for t in g] for g in rollout.groups[:2]]


def test_trainer_backend_is_sync_only(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="rollout.backend"):
        load_config(str(REPO / "configs" / "colors_demo.yaml"),
                    [f"model.path={tiny_model_dir}", "rollout.backend=trainer", "rollout.mode=async"], check_files=False)
