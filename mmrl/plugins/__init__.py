"""The built-in plugins, kept in the repository's top-level folders (the things a user copies and
adds to), installed under this package:

    processors/  ->  mmrl.plugins.processors   model-family adapters (qwen_vl, llava, internvl)
    rewards/     ->  mmrl.plugins.rewards      reward functions (answer_match, grounding_iou, ...)
    data/        ->  mmrl.plugins.data         dataset recipes (`mmrl data build`) and converters

The mapping is `[tool.setuptools.package-dir]` in pyproject.toml: an editable install imports the
folders in place, a wheel carries them under mmrl/plugins/. The machinery they plug into (the
processor contract, reward execution, the shard stream) stays in mmrl/. Importing a subpackage
registers its plugins (mmrl.registry.KINDS names the package per kind).
"""
from pathlib import Path as _Path

# A source checkout used without installing it (the repository root on sys.path, as in a script
# run from another environment): the folders are found in place, as an editable install does.
_CHECKOUT = _Path(__file__).resolve().parents[2]
if (_CHECKOUT / "setup.py").is_file() and all((_CHECKOUT / f / "__init__.py").is_file()
                                              for f in ("processors", "rewards", "data")):
    __path__.append(str(_CHECKOUT))  # noqa: F821  (a package's __path__)
