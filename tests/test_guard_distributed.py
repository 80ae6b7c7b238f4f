"""The guard on 2 CPU ranks (gloo) under torchrun, in a user's own loop
(tests/guard_distributed_loop.py): fragile zoo tasks under uniform fp16, each rank on its
half of every global batch, under DDP and under FSDP2. Every rank must make the same
change at the same step (one all-reduce a check, one a failure), so that all ranks run
the same regions; under DDP the weights end equal. Each zoo launch takes 30-50 s (slow).
A planted FSDP2 run without loss scaling (tests/guard_shard_loop.py) overflows one
rank's gradient shard only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# What a change decides; its reason, headroom and trend are each rank's own observation.
DECIDED = ("step", "action", "layer", "leaves", "from_dtype", "to_dtype", "restored_step")


def _torchrun(tmp_path: Path, script: str, *args: str) -> None:
    """``script`` on 2 ranks, writing into ``tmp_path``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    done = subprocess.run(
        [*command, "2", script, str(tmp_path), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        # gloo's threads can abort a process at exit after its group was destroyed, as
        # tests/test_distributed_rank.py tolerates: only after every rank finished.
        finished = all((tmp_path / f"done{r}").exists() for r in (0, 1))
        assert finished and "terminate called without an active exception" in done.stderr, (
            done.stderr[-3000:]
        )


def _guarded_ranks(tmp_path: Path, task: str, steps: int, *modes: str) -> dict[str, list[dict]]:
    """Each rank's report, by mode, after a guarded run of ``steps`` steps on 2 ranks."""
    _torchrun(tmp_path, "tests/guard_distributed_loop.py", task, str(steps), *modes)
    return {
        mode: [json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for r in (0, 1)]
        for mode in modes
    }


def _decided(report: dict) -> list[dict]:
    return [{key: change[key] for key in DECIDED} for change in report["changes"]]


def _ranks_agree(reports: list[dict], tmp_path: Path, mode: str) -> None:
    first, second = reports
    assert _decided(first) == _decided(second)
    assert first["policy"] == second["policy"] and first["seen"] == second["seen"]
    assert first["step_count"] == second["step_count"]
    assert first["trained_steps"] == second["trained_steps"]
    assert first["finite"] and second["finite"]
    weights = [torch.load(tmp_path / f"{mode}-rank{r}.pt", weights_only=True) for r in (0, 1)]
    # (BatchNorm's running statistics are each rank's own after its last forward: DDP
    # broadcasts rank 0's at the start of the next)
    names = first["parameters"]
    assert names and set(names) <= set(weights[0])
    if mode == "ddp":
        assert all(torch.equal(weights[0][name], weights[1][name]) for name in names)
    else:
        assert first["sharded"] and second["sharded"]
        # each rank holds its own half of every parameter: not the same tensors
        assert any(not torch.equal(weights[0][name], weights[1][name]) for name in names)


@pytest.mark.slow
def test_ranks_promote_the_same_layer_at_the_same_step_under_ddp_and_fsdp2(tmp_path):
    """zoo-exp-growth: the head's output grows exponentially; a plain loop promotes it
    at step 350."""
    reports = _guarded_ranks(tmp_path, "zoo-exp-growth", 400, "ddp", "fsdp2")
    for mode, ranks in reports.items():
        _ranks_agree(ranks, tmp_path, mode)
        changes = ranks[0]["changes"]
        assert [(c["action"], c["layer"], c["to_dtype"]) for c in changes] == [
            ("promote", "head", "bf16")
        ]
        assert 0 < changes[0]["step"] < 400
        assert ranks[0]["seen"]["head"] == "bf16" and ranks[0]["seen"]["body.fc1"] == "fp16"
        assert ranks[0]["trained_steps"] == 400  # nothing rolled back


@pytest.mark.slow
def test_ranks_roll_back_together_and_replay_under_ddp_and_fsdp2(tmp_path):
    """zoo-kernel-underflow: the kernel's fp16 values underflow to 0/0 late in the run;
    every rank restores the copy of step 600, promotes the kernel and trains the lost
    steps again (under FSDP2 the optimizer's sharded state comes back sharded)."""
    reports = _guarded_ranks(tmp_path, "zoo-kernel-underflow", 800, "ddp", "fsdp2")
    for mode, ranks in reports.items():
        _ranks_agree(ranks, tmp_path, mode)
        (rollback,) = ranks[0]["changes"]
        assert (rollback["action"], rollback["layer"], rollback["to_dtype"]) == (
            "rollback",
            "kernel",
            "bf16",
        )
        assert rollback["restored_step"] == 600 and rollback["replayed"]
        lost = rollback["step"] + 1 - rollback["restored_step"]
        assert ranks[0]["trained_steps"] == 800 + lost and ranks[0]["step_count"] == 800
        assert ranks[0]["seen"]["kernel"] == "bf16" and ranks[0]["seen"]["fc"] == "fp16"


@pytest.mark.slow
def test_ddp_ranks_agree_on_the_culprit_of_a_forward_overflow(tmp_path):
    """zoo-norm-drift: fc1 is promoted at the first check, then the loss overflows late
    in the run. Each rank diagnoses the failure on its own inputs and may name another
    layer (once rank 0 named bn1 and rank 1 head, and each promoted its own): the lowest
    failing rank's culprit is everyone's. (Under FSDP2 this model does not run at all
    in uniform fp16, guard or none: FSDP2's fp16 BatchNorm weights meet its fp32
    running statistics.)"""
    (ranks,) = _guarded_ranks(tmp_path, "zoo-norm-drift", 1000, "ddp").values()
    _ranks_agree(ranks, tmp_path, "ddp")
    promote, rollback, *_ = ranks[0]["changes"]
    assert (promote["step"], promote["action"], promote["layer"]) == (0, "promote", "fc1")
    assert rollback["action"] == "rollback" and rollback["restored_step"] == 600
    assert "the loss was not finite" in rollback["reason"]
    assert ranks[0]["seen"][rollback["layer"]] == "bf16"


def test_a_gradient_overflow_on_one_rank_s_shard_is_every_rank_s_failure(tmp_path):
    """FSDP2 without loss scaling (tests/guard_shard_loop.py): only rank 0's shard of the
    weight's gradient overflows. Every rank skips the step, rolls back to step 0 and
    promotes the layer at the same step (before, rank 1 stepped on while rank 0 waited
    in the failure's all-reduce, and the run hung). FSDP2 still computes the weight's
    gradient in its unit's fp16, so the promotions cannot mend it: every rank stops with
    the same error, after the same changes."""
    _torchrun(tmp_path, "tests/guard_shard_loop.py")
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert first["changes"] == second["changes"]
    assert [(c["step"], c["action"], c["layer"], c["to_dtype"]) for c in first["changes"]] == [
        (5, "rollback", "fc", "bf16"),
        (5, "rollback", "fc", "fp32"),
    ]
    assert all(c["restored_step"] == 0 and c["replayed"] for c in first["changes"])
    assert first["trained_steps"] == second["trained_steps"] == 3 * 6
    assert first["error"] == second["error"] and "cannot be mended" in first["error"]
    assert first["finite"] and second["finite"]  # no step took the overflowed gradient
