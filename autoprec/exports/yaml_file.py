"""The ``yaml`` format: the policy file itself, as ``autoprec.load_policy`` reads it back."""

from __future__ import annotations

from pathlib import Path

from autoprec import Policy
from autoprec.exports._common import write
from autoprec.exports._owned import export_folder, record_written

POLICY_FILE = "policy.yaml"


def export_yaml(policy: Policy, out_dir: str | Path) -> list[Path]:
    """Write ``policy.yaml``: the exchange format every other export refers back to, and
    what a training script loads with ``autoprec.load_policy``."""
    folder = export_folder(out_dir, [POLICY_FILE])
    return record_written(folder, [write(folder / POLICY_FILE, policy.to_yaml())], [POLICY_FILE])
