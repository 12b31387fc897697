"""rollouts.html (controller/rollouts_html.py): built from real rollout records (GUI screenshots the
GuiEnvironment returned for the expert actions, written by rollout_log.rollout_records), then opened
in headless Chromium over the DevTools protocol (`--remote-debugging-pipe`, stdlib only): no console
errors or JS exceptions, every thumbnail loaded, injected markup shown as text and never run, the
step and reward filters hide what they should. Chromium: Debian's `chromium` (scripts/setup_env.sh)."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from mmrl.controller.report import write_report
from mmrl.controller.rollout_log import rollout_records
from mmrl.controller.rollouts_html import load_rollouts, write_rollouts_html
from mmrl.data.sample import Sample, messages_from_prompt
from mmrl.rollout.types import Trajectory
from mmrl.tools.base import run_tool
from mmrl.tools.gui import DesktopSpec, GuiEnvironment, expert_actions, render_screen
from mmrl.utils.thumbnails import thumbnail

INJECTED = '<script>window.__pwned = 1; alert(1)</script></div><img src="x" onerror="window.__pwned = 2">'


def _sample(seed: int) -> Sample:
    spec = DesktopSpec.generate(seed, task="gui_click")
    return Sample(key=f"gui-{seed}", messages=messages_from_prompt(spec.task.instruction, n_images=1),
                  images=[render_screen(spec)], answer=spec.task.target_key(), metadata={"gui": spec.to_dict()})


def _trajectory(sample: Sample, actions: list[tuple[str, dict]], reward: float, version: int,
                text_suffix: str = "") -> Trajectory:
    """A trajectory that made `actions` on the sample's GUI, as the tool loop records it."""
    env = GuiEnvironment(sample)
    transcript: list[dict[str, Any]] = []
    for name, args in actions:
        call = json.dumps({"name": name, "arguments": args})
        transcript.append({"role": "assistant", "content": f"<tool_call>{call}</tool_call>",
                           "tool_calls": [{"name": name, "arguments": args}]})
        result, _ = asyncio.run(run_tool(env, name, args, timeout_s=10.0))
        transcript.append({"role": "tool", "name": name, "content": result.text, "images": len(result.images),
                           "error": result.error, "thumbnails": [thumbnail(i, 96) for i in result.images]})
        if result.done:
            break
    state = env.state()
    text = "".join(t["content"] for t in transcript if t["role"] == "assistant") + text_suffix
    if text_suffix:
        transcript.append({"role": "assistant", "content": text_suffix, "tool_calls": []})
    n = 12
    errors = sum(t["role"] == "tool" and t["error"] for t in transcript)
    return Trajectory(prompt_index=0, response_ids=list(range(n)), behaviour_logprobs=[-0.5] * n,
                      loss_mask=[1] * 8 + [0] * 4, text=text, finish_reason="done" if state["done"] else "stop",
                      weight_version=version, token_versions=[version] * 4 + [version + 1] * 4 + [-1] * 4,
                      reward=reward, reward_components={"gui_success": float(state["success"]),
                                                        "progress": state["progress"]},
                      transcript=transcript, tool_state=state,
                      stats={"turns": float(len(actions)), "tool_calls": float(len(actions)),
                             "tool_errors": float(errors)})


def _write_step(run_dir: Path, step: int, samples: list[Sample], groups: list[list[Trajectory]]) -> list[dict]:
    """Write rollouts/step_NNNNNN.jsonl the way rollout_log.log_rollouts does."""
    records = rollout_records(step, samples, [s.key for s in samples], groups, decode=None)
    folder = run_dir / "rollouts"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"step_{step:06d}.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(folder / f"step_{step:06d}.jsonl")
    return records


def _n_images(records: list[dict]) -> int:
    return sum(len(r["images"]) + sum(len(t.get("thumbnails", [])) for t in r["transcript"]) for r in records)


@pytest.fixture(scope="module")
def gui_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """Two logged steps of GUI rollouts: per sample, one expert trajectory (success) and one that
    clicks nothing, then makes a bad call (tool error); one response carries injected markup."""
    run_dir = tmp_path_factory.mktemp("run")
    records: list[dict] = []
    for step, seeds in ((1, (0, 1)), (2, (2,))):
        samples = [_sample(s) for s in seeds]
        groups = []
        for i, sample in enumerate(samples):
            spec = DesktopSpec.from_dict(sample.metadata["gui"])
            good = _trajectory(sample, expert_actions(spec), reward=1.0, version=step - 1)
            bad = _trajectory(sample, [("click", {"x": 250, "y": 250}), ("type", {"text": "x"})], reward=0.0,
                              version=step - 1, text_suffix=INJECTED if (step, i) == (1, 0) else "")
            groups.append([good, bad])
        records += _write_step(run_dir, step, samples, groups)
    (run_dir / "rollouts" / "step_000003.tmp").write_text('{"half": ')  # a file still being written
    return run_dir, records


def test_records_are_real_gui_rollouts(gui_run: tuple[Path, list[dict]]) -> None:
    _, records = gui_run
    assert len(records) == 6 and {r["step"] for r in records} == {1, 2}
    good = [r for r in records if r["member"] == 0]
    assert all(r["tool_state"]["success"] and r["images"] for r in good)
    assert all(len(t["thumbnails"]) == 1 for r in good for t in r["transcript"] if t["role"] == "tool")
    assert any(t["error"] for r in records if r["member"] == 1 for t in r["transcript"] if t["role"] == "tool")


def test_page_is_self_contained_and_escaped(gui_run: tuple[Path, list[dict]]) -> None:
    run_dir, records = gui_run
    page = write_rollouts_html(run_dir)
    text = page.read_text()
    assert page == run_dir / "rollouts.html" and not (run_dir / "rollouts.html.tmp").exists()
    assert "<script>window.__pwned" not in text and 'onerror="window' not in text
    assert "&lt;script&gt;window.__pwned = 1; alert(1)&lt;/script&gt;&lt;/div&gt;" in text
    assert text.count("<script>") == 1 and "http://" not in text and "https://" not in text
    assert text.count("<img ") == _n_images(records)
    assert text.count('<article class="traj"') == len(records)
    assert len(text) < 400_000, len(text)  # thumbnails only


def test_empty_or_missing_rollouts(tmp_path: Path) -> None:
    assert "No rollouts logged yet" in write_rollouts_html(tmp_path).read_text()
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "step_000001.jsonl").write_text("")
    (tmp_path / "rollouts" / "step_000002.jsonl").write_text('{"step": 2, "reward": 1.0}\nnot json\n')
    steps, notes = load_rollouts(tmp_path)
    assert steps == {1: [], 2: [{"step": 2, "reward": 1.0}]}
    assert notes == ["skipped unreadable line 2 of step_000002.jsonl"]
    assert '<article class="traj"' in write_rollouts_html(tmp_path).read_text()


def test_report_writes_rollouts_page(gui_run: tuple[Path, list[dict]]) -> None:
    run_dir, _ = gui_run
    (run_dir / "rollouts.html").unlink(missing_ok=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "time/step_s": 2.0, "time/rollout_s": 1.5}) + "\n")
    out = io.StringIO()
    write_report(run_dir, Console(file=out, width=200))
    assert (run_dir / "rollouts.html").is_file()
    assert f"wrote the logged rollouts to {run_dir / 'rollouts.html'}" in out.getvalue()


# --- the page in a real browser -------------------------------------------------------------------

def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip("no Chromium: install Debian's `chromium` (scripts/setup_env.sh does)")


class Browser:
    """Headless Chromium driven over the DevTools protocol on the pipe of --remote-debugging-pipe
    (fd 3: commands in, fd 4: replies and events out, each JSON message ended by a NUL byte)."""

    def __init__(self, profile: Path):
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()

        def fds() -> None:  # in the child: the two pipe ends at fds 3 and 4
            a, b = os.dup(to_chrome_r), os.dup(from_chrome_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [_chromium(), "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check", "--renderer-process-limit=1",
             f"--user-data-dir={profile}", "about:blank"],
            pass_fds=(3, 4), preexec_fn=fds, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf, self._id, self.events, self.session = b"", 0, [], None

    def send(self, method: str, timeout: float = 60.0, **params: Any) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if self.session and not method.startswith(("Target.", "Browser.")):
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        reply = self._read(lambda m: m.get("id") == self._id, timeout)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def wait_event(self, method: str, timeout: float = 60.0) -> dict:
        for e in self.events:
            if e["method"] == method:
                return e
        return self._read(lambda m: m.get("method") == method, timeout)

    def _read(self, wanted: Any, timeout: float) -> dict:
        end = time.monotonic() + timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "method" in msg:
                    self.events.append(msg)
                if wanted(msg):
                    return msg
            left = end - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError("no answer from Chromium")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium exited (rc {self.proc.poll()})")
            self._buf += chunk

    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.send(f"{domain}.enable")
        self.send("Emulation.setDeviceMetricsOverride", width=1280, height=900, deviceScaleFactor=1, mobile=False)
        self.events.clear()
        self.send("Page.navigate", url=url)
        self.wait_event("Page.loadEventFired")

    def eval(self, expression: str) -> Any:
        out = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in out:
            raise RuntimeError(f"{expression}: {out['exceptionDetails']}")
        return out["result"].get("value")

    def problems(self) -> list[dict]:
        """Console errors/warnings, uncaught exceptions, failed loads, dialogs (alert) so far."""
        bad = {"Runtime.exceptionThrown", "Page.javascriptDialogOpening"}
        return [e for e in self.events if e["method"] in bad
                or (e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "warning", "assert"))
                or (e["method"] == "Log.entryAdded" and e["params"]["entry"]["level"] in ("error", "warning"))]

    def screenshot(self, path: Path) -> None:
        size = self.send("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": 1280, "height": min(size["height"], 4000), "scale": 1}
        data = self.send("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._w)
        os.close(self._r)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):
    _chromium()
    b = Browser(tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


VISIBLE = "[...document.querySelectorAll('article.traj')].filter(a => a.offsetParent !== null)"


def test_page_in_browser(gui_run: tuple[Path, list[dict]], browser: Browser, tmp_path: Path) -> None:
    run_dir, records = gui_run
    page = write_rollouts_html(run_dir)
    browser.open(page.as_uri())
    assert browser.problems() == []
    n_img = _n_images(records)
    assert browser.eval("document.images.length") == n_img
    assert browser.eval("[...document.images].filter(i => i.complete && i.naturalWidth > 0).length") == n_img
    # the injected markup is text on the page, and none of it ran
    assert browser.eval("typeof window.__pwned") == "undefined"
    assert browser.eval("document.querySelectorAll('script').length") == 1
    assert INJECTED in browser.eval("document.body.innerText")
    assert browser.eval("document.querySelectorAll('article.traj').length") == len(records)
    assert browser.eval(f"{VISIBLE}.length") == len(records)
    browser.screenshot(tmp_path / "rollouts.png")
    assert (tmp_path / "rollouts.png").stat().st_size > 10_000

    # filters: a step, then a reward range, then back to everything
    step2 = sum(r["step"] == 2 for r in records)
    browser.eval("document.querySelector('#step').value = '2';"
                 "document.querySelector('#step').dispatchEvent(new Event('input'))")
    assert browser.eval(f"{VISIBLE}.map(a => a.dataset.step)") == ["2"] * step2
    assert browser.eval("[...document.querySelectorAll('section.step')].filter(s => !s.hidden).length") == 1
    assert browser.eval("document.querySelector('#count').textContent") == f"{step2} of {len(records)} shown"
    browser.eval("document.querySelector('#step').value = 'all'; const m = document.querySelector('#rmin');"
                 "m.value = '0.5'; m.dispatchEvent(new Event('input'))")
    assert browser.eval(f"{VISIBLE}.map(a => +a.dataset.reward)") == [1] * sum(r["reward"] >= 0.5 for r in records)
    browser.eval("const m2 = document.querySelector('#rmin'); m2.value = ''; m2.dispatchEvent(new Event('input'))")
    assert browser.eval(f"{VISIBLE}.length") == len(records)
    assert browser.problems() == []


def test_empty_page_in_browser(tmp_path: Path, browser: Browser) -> None:
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "step_000001.jsonl").write_text("")
    browser.open(write_rollouts_html(tmp_path).as_uri())
    assert browser.problems() == []
    assert "No rollouts logged yet" in browser.eval("document.body.innerText")
    assert browser.eval("document.querySelector('#count').textContent") == "0 of 0 shown"


def test_browser_check_catches_errors(tmp_path: Path, browser: Browser) -> None:
    """The harness itself: a broken image, a console error and an exception are all reported."""
    bad = tmp_path / "bad.html"
    bad.write_text('<html><body><img src="missing.png"><script>console.error("boom");'
                   'setTimeout(() => { throw new Error("late") }, 0)</script></body></html>')
    browser.open(bad.as_uri())
    browser.eval("new Promise(r => setTimeout(r, 100))")
    kinds = {e["method"] for e in browser.problems()}
    assert {"Runtime.consoleAPICalled", "Runtime.exceptionThrown", "Log.entryAdded"} <= kinds, kinds
    assert browser.eval("[...document.images].filter(i => i.naturalWidth > 0).length") == 0


@pytest.mark.slow
def test_a_gui_click_training_run_logs_rollouts_the_browser_shows(tiny_model_dir: Path, tmp_path: Path,
                                                                   browser: Browser) -> None:
    """A real `mmrl train` of the gui_click task through the multi_turn loop and the gui tool (the
    test parser clicks on every turn, since a random policy never writes a call): tool turns with
    screenshots reach the trainer, the steps log rollouts, `mmrl report` renders rollouts.html,
    and headless Chromium shows every screenshot without an error."""
    from mmrl.cli import main
    from mmrl.plugins.data.recipes import gui_click

    repo = Path(__file__).resolve().parents[1]
    data, run_dir = tmp_path / "gui_click", tmp_path / "run"
    gui_click.build(str(data), train_size=32, heldout_size=4, shard_size=32, seed=0)
    args = json.dumps({"tools": [{"name": "gui", "args": {"grid": gui_click.GRID}}], "max_turns": 2,
                       "parser": f"{repo}/tests/_tool_plugins.py:click_top_left", "max_total_tokens": 128})
    import signal

    sigterm_before = signal.getsignal(signal.SIGTERM)
    code = main(["train", str(repo / "configs" / "colors_demo.yaml"), f"model.path={tiny_model_dir}",
                 f"data.train_shards={data}/train-000000.tar", f"data.heldout_shards={data}/heldout-000000.tar",
                 f"run.output_dir={run_dir}", "run.max_steps=2", "run.time_limit_s=null", "checkpoint.every_steps=0",
                 "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
                 "rollout.agent_loop=multi_turn", f"rollout.agent_loop_args={args}",
                 "rollout.engine_args.limit_mm_per_prompt={image: 3, video: 0}", "rollout.engine_args.max_model_len=2048",
                 "rewards=[{name: tool_success, weight: 1.0, args: {progress_credit: 0.5}}]",
                 "processor.max_pixels=12544", "eval.every_steps=0", "stability.enabled=false",
                 "logging.rollouts_every=1", "logging.tensorboard=false", "logging.progress_bar=false"])
    assert code == 0
    # main() in a caller's process leaves its SIGTERM handler as it found it (a suite that ran it
    # used to exit silently at the next SIGTERM)
    assert signal.getsignal(signal.SIGTERM) == sigterm_before
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "agent/tool_calls" in r]
    # two turns: a click (the menu opens, its screenshot comes back), then the last turn
    assert len(steps) == 2 and all(r["agent/tool_calls"] == 1 and r["agent/tool_images"] == 1 for r in steps)
    assert all(r["agent/turns"] == 2 for r in steps)
    records = [json.loads(line) for p in sorted((run_dir / "rollouts").glob("step_*.jsonl"))
               for line in p.read_text().splitlines()]
    assert len(records) == 2 * 2 * 2 and all([t["role"] for t in r["transcript"]] == ["assistant", "tool", "assistant"]
                                             for r in records)
    assert all("opened menu" in r["transcript"][1]["content"] for r in records)
    write_report(run_dir, Console(file=io.StringIO()))
    browser.open((run_dir / "rollouts.html").as_uri())
    assert browser.problems() == []
    n_img = _n_images(records)
    assert n_img == 2 * 2 + 8  # the sample's screenshot on member 0 of each group, one per trajectory from the tool
    assert browser.eval("[...document.images].filter(i => i.complete && i.naturalWidth > 0).length") == n_img
