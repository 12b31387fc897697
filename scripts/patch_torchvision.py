"""Make torchvision importable beside a CPU-only torch.

PyPI's torchvision 0.28 wheel is a CUDA build: its C++ ops cannot load, and
`_meta_registrations.py` then fails at import registering fake kernels for
`torchvision::nms` / `torchvision::qnms`. We only need torchvision's pure-Python
transforms (used by transformers' Qwen-VL processors), so guard those two
registrations with `torchvision.extension._has_ops()`. Idempotent.
"""
import importlib.util
import pathlib
import sys

MARK = "# mmrl: guarded for CPU torch"


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        print("[patch_torchvision] torchvision not installed; nothing to do")
        return 0
    path = pathlib.Path(spec.origin).parent / "_meta_registrations.py"
    text = path.read_text()
    if MARK in text:
        return 0
    patched = text
    for op in ("nms", "qnms"):
        old = f'@torch.library.register_fake("torchvision::{op}")\n'
        new = (f'@(torch.library.register_fake("torchvision::{op}") '
               f'if torchvision.extension._has_ops() else (lambda f: f))  {MARK}\n')
        patched = patched.replace(old, new)
    if patched.count(MARK) != 2:
        print(f"[patch_torchvision] unexpected file layout in {path}; not patched", file=sys.stderr)
        return 1
    path.write_text(patched)
    print(f"[patch_torchvision] patched {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
