"""Which files in an export folder an export wrote, so that no export overwrites any other.

An export folder may be one the user already keeps files in (``--out runs/<study>``, whose
``fp32.pt`` is the search's safety net). Each export records the files it wrote, with their
SHA-256, in ``.autoprec-export.json`` beside them; a later export replaces a file only where
that record says an export wrote it and it has not changed since, and refuses the folder,
before writing anything, where a file of a name it writes is someone else's.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from autoprec._util.digest import file_sha256
from autoprec._util.files import write_atomic
from autoprec.exports._common import ExportError, out_folder

RECORD_FILE = ".autoprec-export.json"


def export_folder(out_dir: str | Path, names: Iterable[str]) -> Path:
    """``out_dir``, created if need be, once no file of ``names`` in it is one an export did
    not write (or one changed since); raises ExportError naming the first such file."""
    folder = out_folder(out_dir)
    owned = _read(folder)
    for name in names:
        path = folder / name
        if path.is_symlink() or path.is_dir():
            raise ExportError(f"{path}: not a file an export wrote; choose another --out")
        if not path.exists():
            continue
        if name not in owned:
            raise ExportError(
                f"{path}: exists and was not written by an export, which never overwrites "
                "such a file; choose another --out"
            )
        if owned[name] != file_sha256(path):
            raise ExportError(
                f"{path}: changed since an export wrote it; move it away or choose another --out"
            )
    return folder


def record_written(folder: Path, written: list[Path], names: Iterable[str]) -> list[Path]:
    """Record ``written`` as this export's files, and remove the files of ``names`` that an
    earlier export wrote and this one did not (a ``program.pt2`` a re-export no longer
    makes), so the folder holds one export's files only. Returns ``written``."""
    owned = _read(folder)
    now = {path.name for path in written}
    for name in names:
        if name in owned and name not in now:
            (folder / name).unlink(missing_ok=True)
            del owned[name]
    owned.update({path.name: file_sha256(path) for path in written})
    text = json.dumps({"written_by": "autoprec export", "files": owned}, indent=2) + "\n"
    try:
        write_atomic(folder / RECORD_FILE, text)
    except OSError as error:
        raise ExportError(str(error)) from None
    return written


@contextlib.contextmanager
def removed_if_refused(out_dir: str | Path, names: Iterable[str]) -> Iterator[None]:
    """An export into ``out_dir`` that leaves nothing behind when it fails: where the
    folder did not exist before, the files of ``names`` (and the record) it wrote are
    removed, then the folder, once empty (a refused export leaves no empty folder)."""
    folder = Path(out_dir)
    existed = os.path.lexists(folder)
    try:
        yield
    except BaseException:
        if not existed and folder.is_dir() and not folder.is_symlink():
            for name in (*names, RECORD_FILE):
                path = folder / name
                if path.is_file() and not path.is_symlink():
                    path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # not empty: someone else's files
                folder.rmdir()
        raise


def _read(folder: Path) -> dict[str, str]:
    path = folder / RECORD_FILE
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        data = None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise ExportError(f"{path}: not the record of an export; choose another --out")
    return files
