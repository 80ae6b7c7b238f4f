"""The one rule for a name read from a policy file (a policy's, a rule's, an optimizer-state
group's): what the search names things with, and nothing that a generated file or a log
could misread."""

from __future__ import annotations

import re
from typing import Any

from autoprec.errors import PolicyError

# What a policy or rule name may hold: what the search names things with (``uniform-fp16``,
# ``t007 fc1=bf16 scale=dynamic:65536.0``, ``h.0-1.attn``), and no quote, newline or shell
# character, since names end up in generated files and logs. Exporters quote them anyway.
SAFE_NAME = re.compile(r"[A-Za-z0-9_.,:=+\- ]{0,200}")


def check_name(value: Any, where: str) -> str | None:
    """A policy's or rule's name as read from a file: None, or a string of `SAFE_NAME`."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise PolicyError(f"{where}: expected a string")
    if not SAFE_NAME.fullmatch(value):
        raise PolicyError(
            f"{where}: {value[:40]!r}{'...' if len(value) > 40 else ''} is not a safe name "
            "(up to 200 letters, digits, spaces and _ . , : = + -)"
        )
    return value
