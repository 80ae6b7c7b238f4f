"""A file's SHA-256, read in blocks: what identifies a checkpoint (a serving study's fp32
weights) and what tells an export whether a file is still the one it wrote."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of the file at ``path``, without reading it whole into memory."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
