"""Exact checkpoints through the real CLI: a run killed (SIGKILL, whole process group) after its
step-4 checkpoint and restarted with the same command must continue exactly like the run that
was never interrupted: the same samples every step and the same metrics. Then `mmrl export`
turns the final checkpoint into an HF folder that transformers and vLLM both load, and vLLM's
greedy answers from it are the run's own final evaluation answers."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _runs import assert_same_steps, kill_run, rows, run_env, run_to_end, start, train_cmd, wait_until

pytestmark = pytest.mark.slow


def _cmd(run_dir: Path, model: Path, data: Path) -> list[str]:
    return train_cmd(run_dir, model, data, "run.max_steps=6", "rollout.prompts_per_step=8", "rollout.group_size=8",
                     "eval.every_steps=3", "eval.num_prompts=32", "checkpoint.every_steps=2", "checkpoint.keep_last=3",
                     # the entropy bonus fades across the kill: a resumed run must use the same coefficients
                     "algorithm.entropy_schedule.kind=linear", "algorithm.entropy_schedule.start_step=3",
                     "algorithm.entropy_schedule.steps=4", "trainer.lr_schedule.kind=linear",
                     "trainer.lr_schedule.start_step=3", "trainer.lr_schedule.steps=4",
                     "trainer.lr_schedule.end_factor=0.5", "trainer.lr=1e-3")


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, colors_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("resume")
    straight, resumed = root / "straight", root / "resumed"
    run_to_end(_cmd(straight, tiny_model_dir, colors_dir), root)

    # the same command, killed hard once its step-4 checkpoint is complete
    log = root / "victim.log"
    victim = start(_cmd(resumed, tiny_model_dir, colors_dir), root, log)
    marker = resumed / "checkpoints" / "step_000004" / "meta.json"
    wait_until(marker.exists, victim, log, "it could be killed")
    kill_run(victim)
    proc = run_to_end(_cmd(resumed, tiny_model_dir, colors_dir), root)
    assert "resumed from" in proc.stdout and "step_000004" in proc.stdout
    return {"straight": straight, "resumed": resumed, "root": root}


def test_resumed_run_matches_the_uninterrupted_run(runs: dict[str, Path]) -> None:
    straight, resumed = rows(runs["straight"]), rows(runs["resumed"])
    assert sorted(straight) == sorted(resumed) == list(range(7))  # no duplicated or missing step
    # the same samples in every step: the data cursor continued with the next unseen sample
    assert rows(runs["straight"], "batches.jsonl") == rows(runs["resumed"], "batches.jsonl")
    assert_same_steps(straight, resumed, (5, 6))
    for step in (5, 6):
        a, b = straight[step], resumed[step]
        assert b["actor/entropy_coef"] == a["actor/entropy_coef"] == pytest.approx(0.1 * (1 - (step - 3) / 4))
        assert b["train/lr"] == a["train/lr"] == pytest.approx(1e-3 * (1 - 0.5 * (step - 3) / 4))
    # the interrupted run kept only complete checkpoints
    names = sorted(p.name for p in (runs["resumed"] / "checkpoints").iterdir())
    assert names == ["step_000002", "step_000004", "step_000006"], names


_VLLM_GREEDY = textwrap.dedent("""
    import asyncio, json, sys
    from pathlib import Path

    async def main():
        from mmrl.data.stream import load_all
        from mmrl.processors import build_processor
        from mmrl.rollout.engine import RolloutEngine, cpu_engine_defaults, engine_kwargs
        from mmrl.rollout.types import RequestSampling
        from mmrl.utils.env import engine_env

        model, shards, keys = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
        env = engine_env(Path(sys.argv[4]), "cpu", {})
        proc = build_processor("auto", model)
        samples = {s.key: s for s in load_all(shards)}
        engine = RolloutEngine(cpu_engine_defaults(engine_kwargs(model, "float32", 0, {})), env)
        await engine.ready()
        greedy = RequestSampling(max_tokens=2, greedy=True, forbidden_token_ids=proc.forbidden_token_ids)
        texts = [(await engine.generate(proc(samples[k]).vllm_input, greedy)).text for k in keys]
        print("RESULT " + json.dumps(texts))
        await engine.shutdown()

    if __name__ == "__main__":
        asyncio.run(main())
""")


def test_export_loads_in_transformers_and_vllm_with_the_runs_answers(runs: dict[str, Path], tiny_model_dir: Path,
                                                                     colors_dir: Path) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    from mmrl.cli import main
    from mmrl.trainer.export import consolidated_state_dict

    out = runs["root"] / "exported"
    assert main(["export", str(runs["straight"]), "--out", str(out)]) == 0
    ckpt = runs["straight"] / "checkpoints" / "step_000006"
    trained = AutoModelForImageTextToText.from_pretrained(out)
    initial = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)
    state = consolidated_state_dict(ckpt)
    loaded = trained.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items() if k in loaded)
    assert any(not torch.equal(loaded[k], v) for k, v in initial.state_dict().items()), "weights were trained"

    # vLLM serves the folder and its greedy answers are the ones the run's step-6 evaluation gave
    evals = [json.loads(line) for line in (runs["straight"] / "eval_samples.jsonl").read_text().splitlines()]
    final = next(e for e in evals if e["weight_version"] == 6)
    keys = [x["key"] for x in final["examples"]]
    proc = subprocess.run([sys.executable, "-c", _VLLM_GREEDY, str(out), f"{colors_dir}/heldout-000000.tar",
                           json.dumps(keys), str(runs["root"] / "vllm_run")], cwd=runs["root"], capture_output=True,
                          text=True, timeout=600, env=run_env())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    assert json.loads(lines[-1][len("RESULT "):]) == [x["response"] for x in final["examples"]]


def test_export_errors_name_the_fix(tmp_path: Path) -> None:
    from mmrl.cli import main

    assert main(["export", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
