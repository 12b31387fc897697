"""`mmrl train` through a shard with images the processor refuses (a web banner, 1xN strips) and odd
ones it accepts (smaller than one patch): the refused ones are quarantined in the loader worker
with their reason, the run finishes, and every good sample -- the odd ones included -- trains
(real vLLM engine, real ZeRO-3 ranks, the default demo config shortened)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _data_media import ACCEPTED_ODD_IMAGE_SIZES, REFUSED_IMAGE_SIZES, image_bytes, js, write_tar

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
PROMPT = "What colour is the shape? Answer with one word."


def test_refused_images_are_quarantined_and_every_good_sample_trains(tiny_model_dir: Path, tmp_path: Path) -> None:
    normal = [(f"good-{i:02d}", (24 + i, 32)) for i in range(18)]
    odd = [(f"odd-{w}x{h}", (w, h)) for w, h in ACCEPTED_ODD_IMAGE_SIZES]
    refused = [(f"refused-{w}x{h}", (w, h)) for w, h in REFUSED_IMAGE_SIZES]
    samples = [(key, [("json", js(prompt=PROMPT, answer="red")), ("png", image_bytes(size=size))])
               for key, size in normal + odd + refused]
    shard = write_tar(tmp_path / "odd-000000.tar", samples)
    good = {k for k, _ in normal + odd}

    config = yaml.safe_load((REPO / "configs" / "colors_demo.yaml").read_text())
    config["rewards"] = [{"name": "answer_match", "args": {"first_word": True}}]
    (tmp_path / "odd.yaml").write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    # 4 steps of 8 prompts: the 24 good samples of epoch 0 (every one read, refused ones included),
    # then 8 of epoch 1
    cmd = [sys.executable, "-m", "mmrl.cli", "train", str(tmp_path / "odd.yaml"), f"model.path={tiny_model_dir}",
           f"data.train_shards={shard}", "data.heldout_shards=null", f"run.output_dir={run_dir}",
           "run.max_steps=4", "run.time_limit_s=null", "rollout.prompts_per_step=8", "rollout.group_size=4",
           "stability.enabled=false",
           "checkpoint.every_steps=0", "logging.progress_bar=false"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]

    batches = [json.loads(line) for line in (run_dir / "batches.jsonl").read_text().splitlines()]
    assert [len(b["keys"]) for b in batches] == [8, 8, 8, 8]  # refilled: every step has a full batch
    epoch0 = [k for b in batches[:3] for k in b["keys"]]
    assert sorted(epoch0) == sorted(good)  # every good sample trained, once, odd sizes included
    assert not {k for b in batches for k in b["keys"]} - good

    rows = [json.loads(line) for line in (run_dir / "quarantine.jsonl").read_text().splitlines()]
    assert {r["key"] for r in rows if r["epoch"] == 0} == {k for k, _ in refused}
    assert all(r["reason"] == "processor_limit" and "aspect ratio" in r["detail"] and r["url"] == shard for r in rows)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 4 and metrics[-1]["data/bad_samples"] == len(rows) >= len(refused)
    assert all("loss/pg" in m and "train/skipped_steps" not in m for m in metrics if m["step"] > 0)
