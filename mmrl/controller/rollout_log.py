"""Rollouts as a researcher reads them: every `logging.rollouts_every` steps, the first
`logging.rollouts_per_step` groups of the step go to `RUN_DIR/rollouts/step_NNNNNN.jsonl`, one
trajectory a line: the sample (key, prompt, answer, image thumbnails), the transcript (model
turns, tool calls, tool results with thumbnails of the images tools returned), the response,
the reward and its components, weight versions, finish reason and the loop's counters.
`mmrl report` renders them as rollouts.html (controller/rollouts_html.py); the files are
complete when written, so the page can be made while the run goes on.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from mmrl.data.sample import Sample
from mmrl.utils.thumbnails import thumbnail


def _frames(sample: Sample) -> list[str]:
    """First frame of each video, as a thumbnail (the page shows what the model saw)."""
    from PIL import Image

    return [thumbnail(Image.fromarray(v.frames[0])) for v in sample.videos if len(v.frames)]


def rollout_records(step: int, samples: Sequence[Sample], keys: Sequence[str], groups: Sequence[Sequence[Any]],
                    decode: Any = None) -> list[dict[str, Any]]:
    """One record per trajectory; `keys[g]` names the sample of group g."""
    by_key = {s.key: s for s in samples}
    out: list[dict[str, Any]] = []
    for g, (key, group) in enumerate(zip(keys, groups)):
        sample = by_key.get(key)
        for member, t in enumerate(group):
            out.append({
                "step": step, "group": g, "member": member,
                "key": key,
                "prompt": sample.prompt_text if sample else None,
                "answer": sample.answer if sample else None,
                "images": [thumbnail(i) for i in sample.images] + _frames(sample) if sample and member == 0 else [],
                "response": decode(t.response_ids) if decode else t.text,
                "transcript": t.transcript or [{"role": "assistant", "content": t.text}],
                "reward": t.reward, "reward_components": t.reward_components,
                "weight_version": t.weight_version,
                "token_versions": sorted({v for v, m in zip(t.token_versions, t.loss_mask) if m and v >= 0}),
                "finish_reason": t.finish_reason, "stats": t.stats,
                "tool_state": {k: v for k, v in t.tool_state.items() if _plain(v)},
            })
    return out


def _plain(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def log_rollouts(rt: Any, step: int, samples: Sequence[Sample], prompts: Sequence[Any],
                 groups: Sequence[Sequence[Any]]) -> Path | None:
    """Write the step's rollouts if the step is one to log (`logging.rollouts_every`, counted
    from step 1); returns the file written. `prompts[g]` (a PromptRef) names group g's sample."""
    every, per_step = rt.cfg.logging.rollouts_every, rt.cfg.logging.rollouts_per_step
    if every <= 0 or per_step <= 0 or (step - 1) % every:
        return None
    run_dir = rt.run_dir
    records = rollout_records(step, samples, [p.key for p in prompts][:per_step], list(groups)[:per_step],
                              rt.processor.decode)
    folder = run_dir / "rollouts"
    folder.mkdir(exist_ok=True)
    path = folder / f"step_{step:06d}.jsonl"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)  # a reader never sees half a file
    return path
