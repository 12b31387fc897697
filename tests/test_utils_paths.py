"""Paths recorded in committed benchmark results are relative to the checkout."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmrl.utils.paths import repo_relative


def test_inside_the_root_becomes_relative(tmp_path: Path) -> None:
    assert repo_relative(tmp_path / "benchmarks" / "results" / "x.json", tmp_path) == "benchmarks/results/x.json"


def test_relative_input_counts_from_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "benchmarks").mkdir()
    monkeypatch.chdir(tmp_path / "benchmarks")
    assert repo_relative("results/x.json", tmp_path) == "benchmarks/results/x.json"


def test_outside_the_root_is_kept_as_given(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    root.mkdir()
    elsewhere = str(tmp_path / "elsewhere" / "x.json")
    assert repo_relative(elsewhere, root) == elsewhere


def test_committed_results_name_no_absolute_path() -> None:
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    for name in ("data_pipeline.json", "profiler_overhead.json"):
        out = json.loads((results / name).read_text())["args"]["out"]
        assert not Path(out).is_absolute() and out == f"benchmarks/results/{name}", out
