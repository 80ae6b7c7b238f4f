"""A guarded run killed with SIGKILL and resumed from its checkpoint in a new process ends
exactly as the run that was never interrupted (tests/guard_resume_loop.py): the same
weights, bit for bit, and the same changes at the same steps. The checkpoint is a copy
point of the guard's, so the rollback after the resume goes back to the checkpoint's step
in both runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
STEPS = 1000
CHECKPOINT_STEP = 900  # the last checkpoint before the kill (every 300 batches)
KILL_AFTER = 910  # mid-step, after the promotion at step 0 and before the rollback at 941


def _run(folder: Path, *args: str) -> subprocess.CompletedProcess:
    folder.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "tests/guard_resume_loop.py", str(folder), str(STEPS), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _ended(folder: Path) -> tuple[dict[str, torch.Tensor], list[dict]]:
    weights = torch.load(folder / "final.pt", weights_only=True)
    return weights, json.loads((folder / "changes.json").read_text())["changes"]


@pytest.mark.slow
def test_a_run_killed_after_a_checkpoint_resumes_to_the_same_weights_and_changes(tmp_path):
    whole = _run(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]

    killed = _run(tmp_path / "killed", "--kill-after", str(KILL_AFTER))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (tmp_path / "killed" / "final.pt").exists()
    checkpoint = torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=True)
    assert checkpoint["step"] == CHECKPOINT_STEP
    kept = checkpoint["precision"]["guard"]["changes"]
    assert [(c["step"], c["action"]) for c in kept] == [(0, "promote")]

    resumed = _run(tmp_path / "killed", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    expected_weights, expected_changes = _ended(tmp_path / "whole")
    weights, changes = _ended(tmp_path / "killed")
    assert weights.keys() == expected_weights.keys()
    assert all(torch.equal(weights[name], expected_weights[name]) for name in weights)
    assert changes == expected_changes
    promote, rollback = changes
    assert (promote["step"], promote["action"], promote["layer"]) == (0, "promote", "fc1")
    assert rollback["action"] == "rollback" and rollback["replayed"]
    assert CHECKPOINT_STEP < rollback["step"] < STEPS
    assert rollback["restored_step"] == CHECKPOINT_STEP  # the checkpoint, a copy point
