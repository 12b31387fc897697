"""One registry for every plugin kind: decorator, module:attr, file.py:attr, entry points."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from mmrl import registry
from mmrl.cli import main


def test_decorator_registration_and_listing(capsys: pytest.CaptureFixture[str]) -> None:
    @registry.register("reward", "test_always_half")
    def always_half(response: str, **_) -> float:
        """Half credit for anything (test plugin)."""
        return 0.5

    assert registry.resolve("reward", "test_always_half") is always_half
    entry = next(e for e in registry.entries("reward") if e.name == "test_always_half")
    assert entry.origin == f"decorator ({__name__})"
    assert main(["plugins", "list", "--kind", "reward"]) == 0
    out = capsys.readouterr().out
    assert "test_always_half" in out and "Half credit for anything" in out
    assert "shape_colour" in out and "builtin" in out


def test_duplicate_name_is_refused() -> None:
    @registry.register("advantage", "test_dup_adv")
    def first(rewards_BG, **_):
        return rewards_BG

    with pytest.raises(registry.PluginError, match="already registered"):
        @registry.register("advantage", "test_dup_adv")
        def second(rewards_BG, **_):
            return rewards_BG


def test_module_attr_and_file_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "mypkg_reg_test"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scores.py").write_text("def length_bonus(response, **_):\n    return min(len(response), 10) / 10\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = registry.resolve("reward", "mypkg_reg_test.scores:length_bonus")
    assert fn(response="abcde") == 0.5

    loose = tmp_path / "loose_rewards.py"
    loose.write_text("def shout(response, **_):\n    return float(response.isupper())\n")
    fn2 = registry.resolve("reward", f"{loose}:shout")
    assert fn2(response="HI") == 1.0
    # the same file resolves to the same module (workers that re-import it share it)
    assert registry.resolve("reward", f"{loose}:shout") is fn2
    with pytest.raises(registry.PluginError, match="has no attribute 'whisper'.*shout"):
        registry.resolve("reward", f"{loose}:whisper")


def test_entry_point_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed package advertises a plugin in the group 'mmrl.reward' (real importlib.metadata)."""
    (tmp_path / "ep_plugin_pkg.py").write_text(textwrap.dedent('''
        def exclaim(response, **_):
            """1.0 when the response ends with '!' (entry-point test plugin)."""
            return float(response.endswith("!"))
    '''))
    dist = tmp_path / "ep_plugin_pkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-plugin-pkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[mmrl.reward]\nexclaim = ep_plugin_pkg:exclaim\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_entry_points_loaded", set())
    fn = registry.resolve("reward", "exclaim")
    assert fn(response="yes!") == 1.0
    entry = next(e for e in registry.entries("reward") if e.name == "exclaim")
    assert entry.origin.startswith("entry point (ep-plugin-pkg")


def test_unknown_kind_and_name() -> None:
    with pytest.raises(registry.PluginError, match="unknown plugin kind 'rewardz'"):
        registry.resolve("rewardz", "x")
    with pytest.raises(registry.PluginError, match="unknown policy_loss plugin 'nope'.*ppo_clip"):
        registry.resolve("policy_loss", "nope")


def test_every_kind_has_builtins() -> None:
    for kind in registry.KINDS:
        assert registry.entries(kind), f"no built-in {kind} plugin"
