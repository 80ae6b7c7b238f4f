"""Files autoprec writes, whole or not at all.

summary.json, best_policy.yaml and profile.json are rewritten by every run of a study; a
crash, a full disk or a Ctrl-C in the middle of a plain rewrite would leave half a file
where the last good one was. So each is written to a temporary file beside its target
and renamed over it (`os.replace` is atomic within one file system): a reader finds the
old file or the new one, never a mix.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` through a temporary file in the same
    folder, renamed over ``path`` once complete; on any error ``path`` is left as it was
    and the temporary file is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else data
    temporary = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial"
    # Created as open() would create it (0666 less the umask), not 0600 as mkstemp does.
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return path
