"""A planted pickle: what someone who can write a checkpoint or an artifact could leave.
Unpickling it runs a command that creates ``marker``; loading without unpickling does not."""

from __future__ import annotations

import os
import pickle
from pathlib import Path


class Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(path: Path, marker: Path) -> Path:
    """Replace ``path`` with a pickle that creates ``marker`` when unpickled."""
    path.write_bytes(pickle.dumps(Planted(marker)))
    return path
