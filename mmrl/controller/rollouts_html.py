"""RUN_DIR/rollouts.html: the logged rollouts (controller/rollout_log.py) as one static page.

`write_rollouts_html(run_dir)` reads every RUN_DIR/rollouts/step_*.jsonl there is (a live run adds
files; each is complete once it exists, `*.tmp` ones are still being written) and writes one
self-contained page: inline CSS, a little vanilla JS for the filters (step, reward range), the
images as the PNG data URLs the records carry. Per trajectory it shows the sample (images,
prompt, answer), the turns (model text, tool calls, tool results with their images), the
response, the reward and its components, weight versions, finish reason, stats and tool_state.
Every text from a record is HTML-escaped: model output is arbitrary text.
"""
from __future__ import annotations

import html
import json
import math
import re
from pathlib import Path
from typing import Any

STEP_FILE = re.compile(r"step_(\d+)\.jsonl$")

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f4f5f7;color:#222}
header{position:sticky;top:0;z-index:1;background:#263238;color:#fff;padding:8px 16px;display:flex;
 flex-wrap:wrap;gap:16px;align-items:center}
header h1{font-size:16px;margin:0 16px 0 0}header label{font-size:13px}
header input{width:70px}main{padding:8px 16px}
h2{font-size:15px;margin:16px 0 8px;border-bottom:2px solid #90a4ae}
.traj{background:#fff;border:1px solid #cfd8dc;border-radius:6px;margin:0 0 12px;padding:8px 12px}
.head{display:flex;flex-wrap:wrap;gap:6px 14px;align-items:baseline;font-size:13px;color:#455a64}
.reward{font-weight:bold;padding:1px 8px;border-radius:10px;color:#fff}
.good{background:#2e7d32}.bad{background:#c62828}.mid{background:#ef6c00}
.lbl{font-size:11px;text-transform:uppercase;color:#78909c;margin-top:6px}
pre{white-space:pre-wrap;word-break:break-word;margin:2px 0;background:#f7f9fa;padding:4px 6px;
 border-radius:4px;font:12px/1.35 ui-monospace,monospace;max-height:320px;overflow:auto}
.turn{border-left:4px solid #90a4ae;padding:2px 8px;margin:6px 0}
.assistant{border-color:#1e88e5}.tool{border-color:#8e24aa}.tool.err{border-color:#c62828}
.role{font-size:12px;font-weight:bold;color:#546e7a}.call{color:#6a1b9a}
.err .role{color:#c62828}img{border:1px solid #b0bec5;margin:2px 4px 2px 0;vertical-align:top}
.cols{display:grid;grid-template-columns:minmax(220px,1fr) 2.2fr;gap:0 20px}
@media (max-width:900px){.cols{grid-template-columns:1fr}}
table{border-collapse:collapse;font-size:12px;margin:2px 0}
td{padding:1px 8px 1px 0;vertical-align:top}td:first-child{color:#607d8b}
.kv{display:flex;flex-wrap:wrap;gap:0 24px;align-items:flex-start}.empty{color:#78909c;padding:16px}
"""

JS = """
const q = s => document.querySelector(s);
function apply() {
  const step = q('#step').value, lo = parseFloat(q('#rmin').value), hi = parseFloat(q('#rmax').value);
  let shown = 0;
  for (const a of document.querySelectorAll('article.traj')) {
    const r = parseFloat(a.dataset.reward);
    const ok = (step === 'all' || a.dataset.step === step) &&
      (isNaN(lo) || r >= lo) && (isNaN(hi) || r <= hi);
    a.hidden = !ok; shown += ok;
  }
  for (const s of document.querySelectorAll('section.step'))
    s.hidden = !s.querySelector('article.traj:not([hidden])');
  q('#count').textContent = shown + ' of ' + document.querySelectorAll('article.traj').length + ' shown';
}
for (const id of ['#step', '#rmin', '#rmax']) q(id).addEventListener('input', apply);
apply();
"""


def _esc(value: Any) -> str:
    return "" if value is None else html.escape(str(value), quote=True)


def _num(value: Any) -> str:
    """A number compactly; a string as it is; anything else (true, null, lists) as JSON."""
    if isinstance(value, str):
        return _esc(value) if value else '""'
    if isinstance(value, float):
        return f"{value:.4g}"
    return _esc(json.dumps(value, ensure_ascii=False))


def _imgs(urls: Any) -> str:
    """<img> tags for the PNG data URLs of a record (anything else is left out)."""
    ok = [u for u in urls or [] if isinstance(u, str) and u.startswith("data:image/")]
    return "".join(f'<img src="{_esc(u)}" alt="">' for u in ok)


def _table(title: str, data: Any) -> str:
    if not isinstance(data, dict) or not data:
        return ""
    rows = "".join(f"<tr><td>{_esc(k)}</td><td>{_num(v)}</td></tr>" for k, v in data.items())
    return f'<div><div class="lbl">{_esc(title)}</div><table>{rows}</table></div>'


def _turn(turn: Any) -> str:
    if not isinstance(turn, dict):
        return f'<div class="turn"><pre>{_esc(turn)}</pre></div>'
    role = turn.get("role") or "?"
    if role == "tool":
        err = turn.get("error")
        head = f'tool result: {_esc(turn.get("name"))}' + (" (error)" if err else "")
        return (f'<div class="turn tool{" err" if err else ""}"><div class="role">{head}</div>'
                f'<pre>{_esc(turn.get("content"))}</pre>{_imgs(turn.get("thumbnails"))}</div>')
    calls = "".join(f'<pre class="call">call {_esc(c.get("name"))}({_num(c.get("arguments"))})</pre>'
                    for c in turn.get("tool_calls") or [] if isinstance(c, dict))
    return (f'<div class="turn {_esc(role)}"><div class="role">{_esc(role)}</div>'
            f'<pre>{_esc(turn.get("content"))}</pre>{calls}</div>')


def _reward_class(r: Any) -> str:
    if not isinstance(r, (int, float)) or isinstance(r, bool) or not math.isfinite(r):
        return "mid"
    return "good" if r >= 1 else "bad" if r <= 0 else "mid"


def _trajectory(step: int, rec: dict[str, Any]) -> str:
    r = rec.get("reward")
    reward = float(r) if isinstance(r, (int, float)) and not isinstance(r, bool) else float("nan")
    versions = ", ".join(_esc(v) for v in rec.get("token_versions") or [])
    head = (f'<span class="reward {_reward_class(r)}">reward {_num(r)}</span>'
            f'<span>group {_esc(rec.get("group"))} · member {_esc(rec.get("member"))}</span>'
            f'<span>key {_esc(rec.get("key"))}</span><span>finish: {_esc(rec.get("finish_reason"))}</span>'
            f'<span>weights v{_esc(rec.get("weight_version"))}'
            + (f" (tokens from v{versions})" if versions else "") + "</span>")
    # left: what the model was given and the numbers; right: what it did
    left = [f'<div class="lbl">sample images</div>{_imgs(rec["images"])}' if rec.get("images") else
            f'<div class="lbl">sample images: see member 0 of group {_esc(rec.get("group"))}</div>'
            if rec.get("member") else ""]
    left.append(f'<div class="lbl">prompt</div><pre>{_esc(rec.get("prompt"))}</pre>')
    if rec.get("answer") is not None:
        left.append(f'<div class="lbl">answer</div><pre>{_esc(rec.get("answer"))}</pre>')
    left.append('<div class="kv">' + _table("reward components", rec.get("reward_components"))
                + _table("stats", rec.get("stats")) + _table("tool state", rec.get("tool_state")) + "</div>")
    right = [f'<div class="lbl">turns</div>{"".join(_turn(t) for t in rec.get("transcript") or [])}',
             f'<details><summary class="lbl">full response</summary><pre>{_esc(rec.get("response"))}</pre></details>']
    return (f'<article class="traj" data-step="{step}" data-reward="{reward}">'
            f'<div class="head">{head}</div><div class="cols"><div>{"".join(left)}</div>'
            f'<div>{"".join(right)}</div></div></article>')


def load_rollouts(run_dir: Path) -> tuple[dict[int, list[dict[str, Any]]], list[str]]:
    """The records of RUN_DIR/rollouts by step, and notes on lines that could not be read."""
    steps: dict[int, list[dict[str, Any]]] = {}
    notes: list[str] = []
    folder = Path(run_dir) / "rollouts"
    files = [(int(m.group(1)), p) for p in folder.glob("step_*.jsonl") if (m := STEP_FILE.search(p.name))] \
        if folder.is_dir() else []
    for step, path in sorted(files):
        records = steps.setdefault(step, [])
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            if isinstance(rec, dict):
                records.append(rec)
            else:
                notes.append(f"skipped unreadable line {n} of {path.name}")
    return steps, notes


def render_rollouts_html(run_dir: Path, steps: dict[int, list[dict[str, Any]]], notes: list[str]) -> str:
    total = sum(len(v) for v in steps.values())
    options = "".join(f'<option value="{s}">step {s} ({len(v)})</option>' for s, v in steps.items())
    body = "".join(f'<section class="step" data-step="{s}"><h2>step {s}: {len(v)} trajectories</h2>'
                   + "".join(_trajectory(s, r) for r in v) + "</section>" for s, v in steps.items())
    if not total:
        body += '<p class="empty">No rollouts logged yet (logging.rollouts_every, logging.rollouts_per_step).</p>'
    body += "".join(f'<p class="empty">note: {_esc(n)}</p>' for n in notes)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>rollouts: {_esc(Path(run_dir).name)}</title>
<style>{CSS}</style></head><body>
<header><h1>rollouts of {_esc(run_dir)}</h1>
<label>step <select id="step"><option value="all">all steps ({total})</option>{options}</select></label>
<label>reward min <input id="rmin" type="number" step="any"></label>
<label>max <input id="rmax" type="number" step="any"></label><span id="count"></span></header>
<main>{body}</main>
<script>{JS}</script></body></html>
"""


def write_rollouts_html(run_dir: Path) -> Path:
    """Write RUN_DIR/rollouts.html from RUN_DIR/rollouts/step_*.jsonl; returns its path."""
    run_dir = Path(run_dir)
    steps, notes = load_rollouts(run_dir)
    out = run_dir / "rollouts.html"
    tmp = out.with_suffix(".html.tmp")
    tmp.write_text(render_rollouts_html(run_dir, steps, notes), encoding="utf-8")
    tmp.replace(out)  # a browser reloading the page never reads half of it
    return out
