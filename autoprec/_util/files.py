"""Files autoprec reads and writes, one way everywhere.

Reading: a policy or space file may come from a shared runs folder or an MLflow artifact,
so it is read as untrusted data: its size is checked before anything is parsed (PyYAML
takes about 14 s and 180 MB per MB of YAML), it must be UTF-8 text, it is parsed with
``yaml.safe_load``'s constructors (no Python objects), a key given twice in one mapping
is refused rather than silently overridden by the last one, and anchors may not expand
it past `MAX_YAML_VALUES` values. Every failure is one line naming the file.

Writing: every file autoprec writes goes through `write_atomic` (or `atomic_file`, for
a library that writes into a file object; `open_log` for a log a child process writes).
A runs folder may be shared, so anyone who can write into it could plant a symbolic link
at a name autoprec writes, to make the next command overwrite a file elsewhere. So no
write follows a link: the new content goes to a temporary file created beside the target
with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a fresh inode, never an existing file or a link's
target), which is then renamed over the target (``os.replace`` replaces a link planted
there itself, not what it points to). The rename is also what makes a rewrite atomic: a
crash, a full disk or a Ctrl-C leaves the old file or the new one, never half of one.

Folders: a writer given ``within`` (the runs folder, for the files of a study) creates
and opens every folder from ``within`` down to the file one at a time, refusing a folder
that is a link (``O_NOFOLLOW``), so a study folder swapped for a link leads nowhere; the
folder ``within`` itself, and any folder the user names (``--out``), are taken as given:
a runs folder linked to a bigger disk is the user's choice. A write that fails (a
read-only or full disk, no permission, a link in the way) raises `WriteError`, one line
naming the file (the CLI prints it and exits 2).
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import yaml

from autoprec.errors import AutoprecError, DuplicateKey, WriteError

MAX_YAML_BYTES = 256 * 1024  # a policy or space of thousands of rules is under 100 KB
MAX_YAML_VALUES = 100_000  # values after anchors are expanded (a "billion laughs" file)


def read_text(path: str | Path, error: type[AutoprecError], max_bytes: int) -> str:
    """The UTF-8 text of the file at ``path``, at most ``max_bytes`` long (checked before
    reading); ``error`` with one line naming the file otherwise."""
    path = Path(path)
    try:
        if path.is_dir():
            raise error(f"{path}: is a folder, not a file")
        if path.exists() and not path.is_file():
            raise error(f"{path}: not a regular file")
        size = path.stat().st_size
        if size > max_bytes:
            raise error(f"{path}: {size // 1024} KB, more than the {max_bytes // 1024} KB allowed")
        with path.open("rb") as file:
            data = file.read(max_bytes + 1)
    except OSError as failure:
        raise error(f"{path}: cannot read ({failure.strerror or failure})") from None
    if len(data) > max_bytes:  # grew after the check
        raise error(f"{path}: more than the {max_bytes // 1024} KB allowed")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as failure:
        raise error(f"{path}: not UTF-8 text (byte {failure.start})") from None


def load_yaml(path: str | Path, error: type[AutoprecError]) -> Any:
    """The data of a YAML file (see the module docstring for what is refused)."""
    return parse_yaml(read_text(path, error, MAX_YAML_BYTES), str(path), error)


def parse_yaml(text: str, source: str, error: type[AutoprecError]) -> Any:
    """The data of YAML ``text`` read from ``source`` (a file or an MLflow artifact)."""
    if len(text) > MAX_YAML_BYTES:
        raise error(f"{source}: more than the {MAX_YAML_BYTES // 1024} KB allowed")
    loader = _StrictLoader(text)
    try:
        data = loader.get_single_data()
    except DuplicateKey as duplicate:
        raise error(f"{source}: {duplicate}") from None
    except yaml.YAMLError as failure:
        mark = getattr(failure, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise error(f"{source}: not valid YAML{where}") from None
    finally:
        loader.dispose()
    if _expanded_size(data) > MAX_YAML_VALUES:
        raise error(f"{source}: its anchors expand to more than {MAX_YAML_VALUES} values")
    return data


_Base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser where installed


class _StrictLoader(_Base):  # type: ignore[misc, valid-type]
    """yaml.safe_load's loader, refusing a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # "<<: *base" then overriding keys is how merges are written
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise DuplicateKey(
                        f"line {line}: key {key!r} given twice (first on line {seen[key]})"
                    )
                seen[key] = line
            except TypeError:
                continue  # an unhashable key: the constructor below says so
        return super().construct_mapping(node, deep=deep)


def _expanded_size(data: Any) -> int:
    """How many values ``data`` has with every shared (aliased) part counted each time it
    appears; counting stops past `MAX_YAML_VALUES`."""
    count, stack = 0, [data]
    while stack and count <= MAX_YAML_VALUES:
        value = stack.pop()
        count += 1
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return count


def write_atomic(path: str | Path, data: str | bytes, within: str | Path | None = None) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` without following a link (see the module
    docstring): through a temporary file in the same folder, renamed over ``path`` once
    complete. On any error ``path`` is left as it was, the temporary file is removed, and
    a `WriteError` names the file."""
    with atomic_file(path, within) as out:
        out.write(data.encode() if isinstance(data, str) else data)
    return Path(path)


@contextlib.contextmanager
def atomic_file(path: str | Path, within: str | Path | None = None) -> Iterator[IO[bytes]]:
    """A binary file to write ``path``'s new content into (``torch.save(obj, out)``,
    ``fig.savefig(out)``); renamed over ``path`` when the block ends without an error,
    removed otherwise. No link is followed (see the module docstring)."""
    path = Path(path)
    temporary = f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial"
    with _failing_as_write_error(path):
        folder = open_folder(path.parent, within)
    created = False
    try:
        with _failing_as_write_error(path):
            # Created as open() would create it (0666 less the umask), not 0600 as mkstemp does.
            handle = os.open(temporary, _NEW_FILE, 0o666, dir_fd=folder)
            created = True
        with _failing_as_write_error(path), os.fdopen(handle, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        with _failing_as_write_error(path):
            os.replace(temporary, path.name, src_dir_fd=folder, dst_dir_fd=folder)
            created = False
    finally:
        if created:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=folder)
        os.close(folder)


def open_log(path: str | Path, within: str | Path | None = None, append: bool = False) -> IO[bytes]:
    """``path`` opened for a log that a child process writes as it runs (so it cannot be
    renamed into place once complete). A fresh log is created as `atomic_file` creates
    a file and renamed into place at once, replacing a link planted there; a log appended
    to is opened with ``O_NOFOLLOW``, so a link there is refused, not written through."""
    path = Path(path)
    with _failing_as_write_error(path):
        folder = open_folder(path.parent, within)
        try:
            if append:
                flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                return os.fdopen(os.open(path.name, flags, 0o666, dir_fd=folder), "ab")
            temporary = f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial"
            handle = os.open(temporary, _NEW_FILE, 0o666, dir_fd=folder)
            try:
                os.replace(temporary, path.name, src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                os.close(handle)
                with contextlib.suppress(OSError):
                    os.unlink(temporary, dir_fd=folder)
                raise
            return os.fdopen(handle, "wb")
        finally:
            os.close(folder)


def make_folder(path: str | Path, within: str | Path | None = None) -> Path:
    """``path`` created where missing, no link followed below ``within`` (as the writers
    create the folders of the files they write)."""
    path = Path(path)
    with _failing_as_write_error(path):
        os.close(open_folder(path, within))
    return path


def refuse_links(folder: str | Path, within: str | Path) -> None:
    """A `WriteError` where a folder from ``within`` (itself excluded) down to ``folder``
    is a link, checked before anything is created (the writers check again as they
    create each folder)."""
    root = Path(os.path.abspath(within))
    try:
        relative = Path(os.path.abspath(folder)).relative_to(root)
    except ValueError:
        return
    for depth in range(1, len(relative.parts) + 1):
        path = root.joinpath(*relative.parts[:depth])
        if path.is_symlink():
            raise WriteError(
                f"{path}: a symbolic link under {root}; autoprec writes no file through one "
                "(remove it, or choose another folder)"
            )


def open_folder(folder: Path, within: str | Path | None) -> int:
    """A descriptor of ``folder`` (created where missing) to create files in by name.
    Below ``within``, each folder is created and opened one at a time without following
    a link; ``within`` itself, or ``folder`` where no ``within`` is given, is taken as
    the caller names it."""
    if within is None:
        folder.mkdir(parents=True, exist_ok=True)
        return os.open(folder, _FOLDER)
    root = Path(os.path.abspath(within))
    try:
        relative = Path(os.path.abspath(folder)).relative_to(root)
    except ValueError:  # not inside ``within``: a folder the caller named
        return open_folder(folder, None)
    root.mkdir(parents=True, exist_ok=True)
    handle = os.open(root, _FOLDER)
    try:
        for part in relative.parts:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o777, dir_fd=handle)
            try:
                child = os.open(part, _FOLDER | os.O_NOFOLLOW, dir_fd=handle)
            except OSError as failure:
                if failure.errno in (errno.ELOOP, errno.ENOTDIR):  # a link, or a file
                    refuse_links(folder, root)  # names the link
                raise
            os.close(handle)
            handle = child
    except BaseException:
        os.close(handle)
        raise
    return handle


_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@contextlib.contextmanager
def _failing_as_write_error(path: Path) -> Iterator[None]:
    """An OSError in the block as a `WriteError` naming ``path``: one line, no traceback."""
    try:
        yield
    except WriteError:
        raise
    except OSError as failure:
        reason = failure.strerror or str(failure) or type(failure).__name__
        if failure.errno == errno.ELOOP:
            reason = "a symbolic link, which autoprec writes no file through"
        error = WriteError(f"{path}: cannot write ({reason})")
        error.errno = failure.errno  # still the OSError's (ENOSPC, EROFS, EFBIG, ...)
        raise error from None
