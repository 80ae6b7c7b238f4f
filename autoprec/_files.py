"""Files autoprec reads and writes, one way everywhere.

Reading: a policy or space file may come from a shared runs folder or an MLflow artifact,
so it is read as untrusted data: its size is checked before anything is parsed (PyYAML
takes about 14 s and 180 MB per MB of YAML), it must be UTF-8 text, it is parsed with
``yaml.safe_load``'s constructors (no Python objects), a key given twice in one mapping
is refused rather than silently overridden by the last one, and anchors may not expand
it past `MAX_YAML_VALUES` values. Every failure is one line naming the file.

Writing: summary.json, best_policy.yaml and profile.json are rewritten by every run of a
study; a crash, a full disk or a Ctrl-C in the middle of a plain rewrite would leave half
a file where the last good one was. So each is written to a temporary file beside its
target and renamed over it (`os.replace` is atomic within one file system): a reader
finds the old file or the new one, never a mix.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Any

import yaml

from autoprec.errors import AutoprecError, DuplicateKey

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
