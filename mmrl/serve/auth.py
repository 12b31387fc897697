"""API keys: `MMRL_API_KEYS` (comma-separated) and/or `serve.api_keys_file` (one key a line, `#`
comments). The SDK refuses keys that do not start with `tml-`, so the server does too. A key is
stored and compared only as its SHA-256 (the owner id on every row of the store)."""
from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

PREFIX = "tml-"


class AuthError(Exception):
    pass


class KeyConfigError(ValueError):
    """No keys configured, or a key without the tml- prefix (the server does not start)."""


def owner_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def load_keys(keys_file: str | None = None, env: str | None = None) -> list[str]:
    raw = (os.environ.get("MMRL_API_KEYS", "") if env is None else env).split(",")
    if keys_file:
        raw += [line.split("#", 1)[0] for line in Path(keys_file).read_text().splitlines()]
    keys = [k.strip() for k in raw if k.strip()]
    bad = [k[:8] + "..." for k in keys if not k.startswith(PREFIX)]
    if bad:
        raise KeyConfigError(f"API keys must start with {PREFIX!r} (the tinker SDK requires it): {bad}")
    if not keys:
        raise KeyConfigError("no API keys: set MMRL_API_KEYS=tml-... (comma-separated) or serve.api_keys_file")
    return keys


class Keys:
    def __init__(self, keys: list[str]):
        self._owners = {owner_id(k): k for k in keys}

    def check(self, header_value: str | None) -> str:
        """The owner id of a valid key (from `X-API-Key` or `Authorization: Bearer`), else AuthError."""
        key = (header_value or "").strip()
        if key.lower().startswith("bearer "):
            key = key[7:].strip()
        if not key:
            raise AuthError("missing API key (X-API-Key header)")
        owner = owner_id(key)
        known = self._owners.get(owner)
        if known is None or not hmac.compare_digest(known, key):
            raise AuthError("invalid API key")
        return owner
