"""autoprec's own exception and warning types, all in this one module.

Every error a user can cause by bad input is an `AutoprecError`; the CLI prints its
message on one line and exits with status 2. The message names the file and field.
The few other types here are signals: `SearchInterrupted` carries the results of a
search stopped by Ctrl-C, `TrialTimeout` and `DuplicateKey` never leave autoprec.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import yaml


class _Written(Protocol):
    """What a search stopped by Ctrl-C hands back (`autoprec.study.SearchResult`), as
    this module sees it: it imports nothing of the project."""

    @property
    def summary_path(self) -> Path: ...


ResultT = TypeVar("ResultT", bound=_Written)

__all__ = [
    "AutoprecError",
    "DeviceError",
    "DuplicateKey",
    "ExportError",
    "ExportWarning",
    "GuardError",
    "LoopError",
    "PolicyError",
    "SearchInterrupted",
    "SpaceError",
    "StoreError",
    "SummaryError",
    "TaskError",
    "TrialTimeout",
    "WriteError",
    "first_line",
    "redact",
]


class AutoprecError(Exception):
    """Base class of every error caused by bad input or an unusable environment."""


class PolicyError(AutoprecError):
    """A policy is malformed, or does not fit the model it is applied to."""


class SpaceError(AutoprecError):
    """A search-space file is malformed, or does not fit the task's model."""


class TaskError(AutoprecError):
    """A task cannot be imported or does not follow the Task contract."""


class DeviceError(AutoprecError):
    """A device was asked for that is not there, or cannot run a requested dtype."""


class LoopError(AutoprecError, RuntimeError):
    """A training loop called the precision hooks out of order (unscaled or stepped one
    optimizer twice in an iteration), where torch's GradScaler raises a RuntimeError too."""


class StoreError(AutoprecError):
    """An Optuna or MLflow store cannot be used, or does not hold what was asked for."""


class SummaryError(AutoprecError):
    """A field of summary.json is missing or of the wrong type (the message names it)."""


class WriteError(AutoprecError, OSError):
    """A file could not be written (a read-only or full disk, no permission, a symbolic
    link where autoprec writes no file through one); the message names the file. An
    OSError too, so that code catching the OSError of a write still catches it."""


class ExportError(AutoprecError):
    """A policy cannot be exported in the format asked for (a missing model or example
    input, an unknown format, a model the exporter cannot trace)."""


class GuardError(AutoprecError):
    """A guard setting is out of range, a promotion target cannot run on the device, or
    a guarded run cannot go on (a layer that failed is in fp32 already)."""


class ExportWarning(UserWarning):
    """A format cannot express the policy exactly; the message says what it approximates.
    The same text stands in the header comment of the file written."""


class SearchInterrupted(KeyboardInterrupt, Generic[ResultT]):
    """Ctrl-C during the trials: the running trial was recorded as interrupted (failed in
    Optuna, not counted), and the summary and best policy so far were written. A
    KeyboardInterrupt, so that code which stops on Ctrl-C stops on it too. ``result``: the
    search's `autoprec.SearchResult` so far."""

    def __init__(self, result: ResultT) -> None:
        super().__init__(f"search interrupted; results so far in {result.summary_path}")
        self.result = result


class TrialTimeout(Exception):
    """Raised inside a trial that ran past its time limit (the trial then fails)."""


class DuplicateKey(yaml.YAMLError):
    """A YAML mapping gives one key twice (`autoprec._util.files` turns it into the caller's
    error type, naming the key and both lines)."""


def first_line(error: BaseException, limit: int = 300) -> str:
    """An error's message cut to its first line (tracebacks of other libraries can run to
    pages), at most ``limit`` characters; a longer one is cut between words and ends in
    " ...", so that no URL or path in it is left cut in the middle."""
    line = (str(error).splitlines() or [""])[0]
    if len(line) <= limit:
        return line
    cut = line[: max(limit - 4, 0)]
    return (cut[: cut.rfind(" ")] if " " in cut else cut) + " ..."


# The password part of a URL: scheme://user:password@host. The password runs to the last
# "@" that a host follows (host[:port], then a path, query, fragment or the end), so a
# password holding an unescaped "@" or ":" is covered whole; a URL ends at whitespace.
_PASSWORD = re.compile(
    r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*):(?P<password>\S*)@"
    r"(?=[^\s/@?#]*(?:[/?#]|\s|$))"
)
# User-info without a colon, scheme://TOKEN@host: the form token proxies and git hosts
# use, where the "user" is the secret. Runs to the last "@" a host follows, as above.
_TOKEN = re.compile(
    r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<token>[^:/\s]+)@(?=[^\s/@?#]*(?:[/?#]|\s|$))"
)
# A secret in a URL's query or fragment: a parameter whose name contains one of these
# (?password=, &sslpassword=, ;pwd=, ?api_key=, &X-Amz-Signature=, &sig=, #access_token=).
QUERY_SECRET_NAMES = (
    "password",
    "passwd",
    "pwd",
    "secret",
    "token",
    "key",  # api_key, apikey, access_key, sas_key
    "auth",
    "sig",  # sig, signature
    "credential",
)
_QUERY_SECRET = re.compile(
    r"(?i)(?P<head>[?&;#][\w.-]*(?:" + "|".join(QUERY_SECRET_NAMES) + r")[\w.-]*=)[^&#;\s'\"]*"
)


def redact(text: str) -> str:
    """``text`` with every secret of every URL in it replaced by ``***``: the password of
    the user-info (``postgresql://user:***@db/optuna``), a user-info that is a token
    (``https://***@host``), and every query parameter whose name says it holds a secret
    (``...?sslpassword=***``, ``...&api_key=***``, ``...&sig=***``), for anything written
    down or printed."""
    text = _PASSWORD.sub(lambda m: f"{m['head']}:***@", text)
    text = _TOKEN.sub(lambda m: f"{m['head']}***@", text)
    return _QUERY_SECRET.sub(lambda m: f"{m['head']}***", text)
