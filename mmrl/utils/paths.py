"""Paths as recorded in files that get committed (benchmark results)."""
from __future__ import annotations

import os
from pathlib import Path


def repo_relative(path: str | os.PathLike, root: str | os.PathLike) -> str:
    """`path` relative to `root`, with '/' separators, when it lies inside `root` (a relative
    `path` counts from the working directory): a committed result then does not name the machine
    or the checkout that wrote it. A path outside `root` is returned as given."""
    try:
        return Path(path).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return str(path)
