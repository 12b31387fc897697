"""Exact checkpoints through the real CLI: a run killed (SIGKILL, whole process group) after its
step-4 checkpoint and restarted with the same command must continue exactly like the run that
was never interrupted: the same samples every step and the same metrics. Then `mmrl export`
turns the final checkpoint into an HF folder that transformers and vLLM both load, and vLLM's
greedy answers from it are the run's own final evaluation answers."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _cmd(run_dir: Path, model: Path, data: Path) -> list[str]:
    return [sys.executable, "-m", "mmrl.cli", "train", str(REPO / "configs" / "colors_demo.yaml"),
            f"model.path={model}", f"data.train_shards={data}/train-{{000000..000001}}.tar",
            f"data.heldout_shards={data}/heldout-000000.tar", f"run.output_dir={run_dir}", "run.max_steps=6", "run.time_limit_s=null",
            "rollout.prompts_per_step=8", "rollout.group_size=8", "eval.every_steps=3", "eval.num_prompts=32",
            "checkpoint.every_steps=2", "checkpoint.keep_last=3", "logging.progress_bar=false",
            # the entropy bonus fades across the kill: a resumed run must use the same coefficients
            "algorithm.entropy_schedule.kind=linear", "algorithm.entropy_schedule.start_step=3",
            "algorithm.entropy_schedule.steps=4", "trainer.lr_schedule.kind=linear", "trainer.lr_schedule.start_step=3",
            "trainer.lr_schedule.steps=4", "trainer.lr_schedule.end_factor=0.5", "trainer.lr=1e-3"]


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1"}


def _rows(run_dir: Path, name: str = "metrics.jsonl") -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / name).read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, colors_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("resume")
    straight, resumed = root / "straight", root / "resumed"
    proc = subprocess.run(_cmd(straight, tiny_model_dir, colors_dir), cwd=root, capture_output=True, text=True,
                          timeout=900, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]

    # the same command, killed hard once its step-4 checkpoint is complete
    log = open(root / "victim.log", "w")
    victim = subprocess.Popen(_cmd(resumed, tiny_model_dir, colors_dir), cwd=root, env=_env(),
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    marker = resumed / "checkpoints" / "step_000004" / "meta.json"
    deadline = time.time() + 900
    while not marker.exists() and victim.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert marker.exists() and victim.poll() is None, \
        "the run ended before it could be killed:\n" + (root / "victim.log").read_text()[-4000:]
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=60)
    from mmrl.utils.env import cleanup_shm

    cleanup_shm()
    proc = subprocess.run(_cmd(resumed, tiny_model_dir, colors_dir), cwd=root, capture_output=True, text=True,
                          timeout=900, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stdout and "step_000004" in proc.stdout
    return {"straight": straight, "resumed": resumed, "root": root}


def test_resumed_run_matches_the_uninterrupted_run(runs: dict[str, Path]) -> None:
    straight, resumed = _rows(runs["straight"]), _rows(runs["resumed"])
    assert sorted(straight) == sorted(resumed) == list(range(7))  # no duplicated or missing step
    # the same samples in every step: the data cursor continued with the next unseen sample
    assert _rows(runs["straight"], "batches.jsonl") == _rows(runs["resumed"], "batches.jsonl")
    for step in (5, 6):
        a, b = straight[step], resumed[step]
        assert b["reward/mean"] == pytest.approx(a["reward/mean"], abs=1e-9), step
        assert b["rollout/response_length"] == a["rollout/response_length"]
        for key in ("loss/pg", "actor/entropy", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (step, key, a[key], b[key])
        assert b["weight_version"] == a["weight_version"]
        assert b["actor/entropy_coef"] == a["actor/entropy_coef"] == pytest.approx(0.1 * (1 - (step - 3) / 4))
        assert b["train/lr"] == a["train/lr"] == pytest.approx(1e-3 * (1 - 0.5 * (step - 3) / 4))
    assert resumed[6]["eval/heldout_accuracy"] == straight[6]["eval/heldout_accuracy"]
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
                          text=True, timeout=600, env=_env())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    assert json.loads(lines[-1][len("RESULT "):]) == [x["response"] for x in final["examples"]]


def test_export_errors_name_the_fix(tmp_path: Path) -> None:
    from mmrl.cli import main

    assert main(["export", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
