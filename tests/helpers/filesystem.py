"""Looking at and tampering with files on disk: directory listings and safetensors header surgery."""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Callable, Dict


def listing(dirpath) -> list:
    """File names under ``dirpath`` (relative, sorted)."""
    out = []
    for root, _, names in os.walk(dirpath):
        out += [os.path.relpath(os.path.join(root, n), dirpath) for n in names]
    return sorted(out)


def rewrite_header(path: str, edit: Callable[[Dict[str, Any]], None], pad: bool = True) -> None:
    """Parse a safetensors header, apply ``edit`` to the JSON dict, write it back with a fixed length."""
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    doc = json.loads(raw[8 : 8 + n])
    edit(doc)
    new = json.dumps(doc).encode()
    if pad:
        new += b" " * (-len(new) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(new)) + new + raw[8 + n :])
