"""What a user sees is autoprec's output: torchao is imported only where one of its int8
methods runs, and its import-time noise ("Failed to load ...so", torch's pytree warning
about its enums) never reaches the terminal."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

NOISE = ("Failed to load", "_pytree", "torchao")


def _python(code: str, *args: str, cwd=None):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def test_commands_do_not_import_torchao(tmp_path):
    (tmp_path / "p.yaml").write_text("default: bf16\n")
    done = _python(
        """
        import sys
        import autoprec
        assert "torchao" not in sys.modules, "import autoprec imported torchao"
        from autoprec.cli import main
        for argv in (["resolve", "--policy", "p.yaml"], ["best", "--study", "none"]):
            main(argv)
        try:
            main(["--help"])
        except SystemExit:
            pass
        print("torchao" in sys.modules, file=sys.stderr)
        """,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "False"
    assert not any(word in done.stderr for word in NOISE[:2]), done.stderr


def test_help_and_resolve_print_no_import_noise(tmp_path):
    (tmp_path / "p.yaml").write_text("default: bf16\n")
    for args in (["--help"], ["resolve", "--policy", "p.yaml"]):
        done = subprocess.run(
            [sys.executable, "-m", "autoprec.cli", *args],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr
        assert done.stderr == ""


def test_a_torchao_int8_method_converts_quietly():
    pytest.importorskip("torchao")
    done = _python(
        """
        import torch
        from torch import nn
        from autoprec.serving.conversion import convert, weight_dtypes

        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        served = convert(model, {"0": "int8"}, "cpu", int8="torchao-dynamic")
        assert weight_dtypes(served.get_submodule("0"))[""] == "int8"
        print(served(torch.randn(2, 16)).shape)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "torch.Size([2, 4])"
    assert not any(word in done.stderr for word in NOISE), done.stderr
