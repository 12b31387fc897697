"""`mmrl export` turns a run's newest checkpoint into an HF folder that transformers and vLLM both
load, and vLLM's greedy answers from it are the run's own final evaluation answers. The run is
conftest.py's `reference_run` (40 steps; exact resume is tested on it in test_restarts.py)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _runs import run_env

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


@pytest.mark.slow
def test_export_loads_in_transformers_and_vllm_with_the_runs_answers(reference_run: Path, tiny_model_dir: Path,
                                                                     colors_dir: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    from mmrl.cli import main
    from mmrl.trainer.export import consolidated_state_dict

    out = tmp_path / "exported"
    assert main(["export", str(reference_run), "--out", str(out)]) == 0
    ckpt = reference_run / "checkpoints" / "step_000040"  # the newest
    trained = AutoModelForImageTextToText.from_pretrained(out)
    initial = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)
    state = consolidated_state_dict(ckpt)
    loaded = trained.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items() if k in loaded)
    assert any(not torch.equal(loaded[k], v) for k, v in initial.state_dict().items()), "weights were trained"

    # vLLM serves the folder and its greedy answers are the ones the run's step-6 evaluation gave
    evals = [json.loads(line) for line in (reference_run / "eval_samples.jsonl").read_text().splitlines()]
    final = next(e for e in evals if e["weight_version"] == 40)
    keys = [x["key"] for x in final["examples"]]
    proc = subprocess.run([sys.executable, "-c", _VLLM_GREEDY, str(out), f"{colors_dir}/heldout-000000.tar",
                           json.dumps(keys), str(tmp_path / "vllm_run")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env=run_env())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    assert json.loads(lines[-1][len("RESULT "):]) == [x["response"] for x in final["examples"]]


def test_export_errors_name_the_fix(tmp_path: Path) -> None:
    from mmrl.cli import main

    assert main(["export", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
