"""One registry mechanism for every plugin kind.

A plugin is found by
  (a) a decorator in an imported module:      @register("reward", "iou")
  (b) a string in the config:                  "my_pkg.rewards:iou" or "path/to/file.py:iou"
  (c) a Python entry point in the group        "mmrl.<kind>"  (e.g. mmrl.reward)

`resolve(kind, spec)` accepts any of the three; `entries()` lists what is known and where it
came from (`mmrl plugins list`).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

# Every plugin kind, and the built-in module that registers its defaults on import (the
# mmrl.plugins.* packages are the repository's top-level processors/, rewards/ and data/).
KINDS: dict[str, str] = {
    "processor": "mmrl.plugins.processors",
    "reward": "mmrl.plugins.rewards",
    "agent_loop": "mmrl.rollout.agent_loops",
    "advantage": "mmrl.algorithms.advantages",
    "policy_loss": "mmrl.algorithms.losses",
    "dataset": "mmrl.plugins.data.recipes",
    "tool": "mmrl.tools",
    "tool_parser": "mmrl.tools.parsers",
}
ENTRY_POINT_PREFIX = "mmrl."


class PluginError(ValueError):
    """A plugin could not be found or loaded; the message says what to do."""


@dataclass(frozen=True)
class Entry:
    kind: str
    name: str
    obj: Any
    origin: str  # "builtin", "decorator (module)", "entry point (dist)", "path (file)"


_REGISTRY: dict[str, dict[str, Entry]] = {k: {} for k in KINDS}
_builtins_loaded: set[str] = set()
_entry_points_loaded: set[str] = set()


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise PluginError(f"unknown plugin kind {kind!r}; kinds are: {', '.join(KINDS)}")


def register(kind: str, name: str | None = None) -> Callable[[Any], Any]:
    """Decorator: register `obj` as plugin `name` (default: its __name__) of `kind`."""
    _check_kind(kind)

    def deco(obj: Any) -> Any:
        key = name or getattr(obj, "__name__", None)
        if not key:
            raise PluginError(f"cannot infer a name for {obj!r}; pass register({kind!r}, 'name')")
        module = getattr(obj, "__module__", "?") or "?"
        origin = "builtin" if module.startswith("mmrl.") else f"decorator ({module})"
        prev = _REGISTRY[kind].get(key)
        if prev is not None and prev.obj is not obj and _qualname(prev.obj) != _qualname(obj):
            raise PluginError(
                f"{kind} plugin {key!r} is already registered by {_qualname(prev.obj)} ({prev.origin}); "
                f"pick another name for {_qualname(obj)}")
        _REGISTRY[kind][key] = Entry(kind, key, obj, origin)
        return obj

    return deco


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def load_builtins(kind: str) -> None:
    if kind not in _builtins_loaded:
        _builtins_loaded.add(kind)
        importlib.import_module(KINDS[kind])


def load_entry_points(kind: str) -> None:
    """Register the plugins that installed packages advertise in the group `mmrl.<kind>`."""
    if kind in _entry_points_loaded:
        return
    _entry_points_loaded.add(kind)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_PREFIX + kind):
        if ep.name in _REGISTRY[kind]:
            continue
        try:
            obj = ep.load()
        except Exception as e:  # a broken third-party plugin must not break unrelated runs
            print(f"[mmrl] warning: entry point {ep.name!r} ({ep.value}) in group "
                  f"'{ENTRY_POINT_PREFIX + kind}' failed to load: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        dist = getattr(getattr(ep, "dist", None), "name", "?")
        _REGISTRY[kind][ep.name] = Entry(kind, ep.name, obj, f"entry point ({dist}: {ep.value})")


def _load_ref(kind: str, spec: str) -> Any:
    """Load `module:attr` or `path/to/file.py:attr`."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise PluginError(f"{kind} plugin {spec!r}: expected 'module:attr' or 'path/to/file.py:attr'")
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = os.path.abspath(os.path.expanduser(target))
        if not os.path.isfile(path):
            raise PluginError(
                f"{kind} plugin {spec!r}: file {path} does not exist. Give a path relative to the "
                f"directory you run mmrl from, or an absolute path.")
        # A stable module name per file, so Ray workers that import the same path share it and
        # pickled references by module name resolve there too.
        mod_name = "mmrl_user_" + "".join(c if c.isalnum() else "_" for c in path)
        module = sys.modules.get(mod_name)
        if module is None:
            module_spec = importlib.util.spec_from_file_location(mod_name, path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[mod_name] = module
            try:
                module_spec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[mod_name]
                raise PluginError(
                    f"{kind} plugin {spec!r}: importing {path} failed with {type(e).__name__}: {e}. "
                    f"Fix the error in that file (try `python {path}`).") from e
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:
            raise PluginError(
                f"{kind} plugin {spec!r}: module {target!r} does not import ({type(e).__name__}: {e}). "
                f"Check the module name, that its package is installed in this environment, or give "
                f"a file path instead: 'path/to/file.py:{attr}'.") from e
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise PluginError(f"{kind} plugin {spec!r}: {target} has no attribute {attr!r}; "
                          f"callables there: {', '.join(public) or '(none)'}")
    return getattr(module, attr)


def resolve(kind: str, spec: Any) -> Any:
    """Find a plugin by registered name, `module:attr`, `file.py:attr`, or pass a callable through."""
    _check_kind(kind)
    if not isinstance(spec, str):
        if callable(spec):
            return spec
        raise PluginError(f"{kind} plugin must be a name or 'module:attr' string, got {spec!r}")
    load_builtins(kind)
    if spec in _REGISTRY[kind]:
        return _REGISTRY[kind][spec].obj
    if ":" in spec:
        obj = _load_ref(kind, spec)
        # remember where it came from, for `plugins list` and for error messages
        _REGISTRY[kind].setdefault(spec, Entry(kind, spec, obj, f"path ({spec})"))
        return obj
    load_entry_points(kind)
    if spec in _REGISTRY[kind]:
        return _REGISTRY[kind][spec].obj
    known = ", ".join(sorted(_REGISTRY[kind])) or "(none)"
    raise PluginError(
        f"unknown {kind} plugin {spec!r}. Registered {kind} plugins: {known}. To use your own, give "
        f"'my_module:function' or 'path/to/file.py:function', or register it with "
        f"@mmrl.registry.register({kind!r}, {spec!r}) in a module that is imported.")


def entries(kind: str | None = None) -> list[Entry]:
    """Everything registered (built-ins and entry points loaded), sorted by kind and name."""
    kinds = [kind] if kind else list(KINDS)
    out: list[Entry] = []
    for k in kinds:
        _check_kind(k)
        load_builtins(k)
        load_entry_points(k)
        out.extend(sorted(_REGISTRY[k].values(), key=lambda e: e.name))
    return out


def describe(obj: Any) -> str:
    """First docstring line, for listings."""
    doc = inspect.getdoc(obj) or ""
    return doc.splitlines()[0] if doc else ""


def load_ref(spec: str, what: str = "object") -> Any:
    """Load a `module:attr` or `path/to/file.py:attr` that is not a registered plugin kind (an
    agent function, say); errors name `what` and the fix like plugin errors do."""
    return _load_ref(what, spec)
