"""The ``yaml`` format: the policy file itself, as ``autoprec.load_policy`` reads it back."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from autoprec.exports._common import warn, write
from autoprec.exports._owned import export_folder, record_written
from autoprec.exports.registry import FORMATS, ExportRequest
from autoprec.policy import Policy

(POLICY_FILE,) = FORMATS["yaml"].files


def export_yaml(policy: Policy, out_dir: str | Path) -> list[Path]:
    """Write ``policy.yaml``: the exchange format every other export refers back to, and
    what a training script loads with ``autoprec.load_policy``."""
    folder = export_folder(out_dir, [POLICY_FILE])
    return record_written(folder, [write(folder / POLICY_FILE, policy.to_yaml())], [POLICY_FILE])


def export_code_beside_policy(
    policy: Policy,
    path: Path,
    lines: Sequence[str],
    files: Sequence[str],
    notes: Sequence[str] = (),
) -> list[Path]:
    """A generated file at ``path`` (its ``lines``) with the ``policy.yaml`` it reads
    beside it, recorded as this export's ``files``; each of ``notes`` said as a warning."""
    written = write(path, "\n".join(lines))
    warn(list(notes))
    return record_written(path.parent, [written, *export_yaml(policy, path.parent)], list(files))


def export(r: ExportRequest) -> list[Path]:
    return export_yaml(r.policy, r.out_dir)
