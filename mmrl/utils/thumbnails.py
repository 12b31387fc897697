"""Small PNG data URLs of images, for logs and pages that show what the model saw."""
from __future__ import annotations

import base64
import io
from typing import Any


def thumbnail(image: Any, max_px: int = 160) -> str:
    """A PNG data URL of the PIL `image` shrunk to at most `max_px` a side."""
    img = image.convert("RGB").copy()
    img.thumbnail((max_px, max_px))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
