"""On a CPU whose oneDNN has no fp8 matmul (``ONEDNN_MAX_CPU_ISA=AVX2`` makes any x86-64 CPU
one), fp8 training cannot be emulated: ``--emulate fp8`` is refused in one line (exit 2)
before any store is opened, by a training search and by a profile, and a policy with fp8
layers is refused by ``apply``; serving's weight-only fp8 needs no such kernel and runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CAPPED = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "PYTHONPATH": str(REPO)}
REFUSED = "--emulate fp8: fp8 training is emulated with torch._scaled_mm, which has no kernel"


def _run(folder: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], cwd=folder, env=CAPPED, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip


@pytest.fixture(scope="module")
def capped_has_no_kernel(tmp_path_factory) -> None:
    probe = "from autoprec.devices import cpu_scaled_mm_error as e; print(e() is not None)"
    done = _run(tmp_path_factory.mktemp("probe"), "-c", probe)
    assert done.returncode == 0, done.stderr
    if done.stdout.strip() != "True":
        pytest.skip("torch._scaled_mm runs under ONEDNN_MAX_CPU_ISA=AVX2 here: nothing refused")


@pytest.mark.parametrize(
    "command",
    [
        ["search", "--task", "fp8-outliers", "--emulate", "fp8", "--trials", "2", "--steps", "5"],
        ["profile", "--task", "fp8-outliers", "--emulate", "fp8"],
    ],
    ids=["search", "profile"],
)
def test_emulated_fp8_training_is_refused_in_one_line(command, capped_has_no_kernel, tmp_path):
    done = _run(tmp_path, "-m", "autoprec.cli", *command)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and REFUSED in lines[0], done.stderr
    assert "AVX-512 FP16" in lines[0]
    assert not (tmp_path / "runs").exists()  # refused before any store was opened


def test_a_policy_with_fp8_layers_is_refused_by_apply(capped_has_no_kernel, tmp_path):
    code = (
        "import torch\n"
        "from autoprec import Policy, Rule\n"
        "from autoprec.errors import PolicyError\n"
        "from autoprec.policy import Quantization\n"
        "policy = Policy(rules=(Rule('fp8', types=('Linear',)),), default='bf16',\n"
        "                quantization=Quantization(fp8='tensorwise'))\n"
        "try:\n"
        "    policy.apply(torch.nn.Sequential(torch.nn.Linear(32, 32)), 'cpu', emulate='fp8')\n"
        "except PolicyError as error:\n"
        "    print(error)\n"
    )
    done = _run(tmp_path, "-c", code)
    assert done.returncode == 0, done.stderr
    assert "fp8 training is emulated with torch._scaled_mm" in done.stdout, done.stdout
