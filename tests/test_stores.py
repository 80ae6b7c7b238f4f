"""Nothing overwrites a study by mistake: outputs replaced whole, study names that stay
under runs/, and outputs tied to the Optuna study they came from."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from autoprec.cli import main

# A process whose files may grow to 4 KiB only (RLIMIT_FSIZE): a write past that fails
# half-way with EFBIG, as one on a full disk fails with ENOSPC.
_WRITE_WITH_A_FULL_DISK = textwrap.dedent(
    """
    import json, resource, signal, sys
    from pathlib import Path
    from autoprec.policy import Policy
    from autoprec.search.summary import write_outputs

    out = Path(sys.argv[1])
    policy = Policy.from_dict({"name": "big-" + "x" * 6000, "default": "fp16"})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    try:
        write_outputs({"study": "s", "pad": "y" * 20000}, policy, out)
    except OSError as error:
        print(error.errno)
    """
)


def test_a_write_that_fails_half_way_leaves_the_old_outputs_whole(tmp_path):
    from autoprec.policy import Policy
    from autoprec.search.summary import write_outputs

    old_policy = Policy.from_dict({"name": "old", "default": "bf16"})
    policy_path, summary_path = write_outputs({"study": "s", "n": 1}, old_policy, tmp_path)
    before = {p: p.read_bytes() for p in (policy_path, summary_path)}
    done = subprocess.run(
        [sys.executable, "-c", _WRITE_WITH_A_FULL_DISK, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "27"  # EFBIG: the write did fail half-way
    assert {p: p.read_bytes() for p in before} == before  # the old files, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best_policy.yaml", "summary.json"]


@pytest.mark.parametrize("command", ["report", "export", "best"])
@pytest.mark.parametrize("study", ["../outside", "/tmp/abs", "a/b", ".."])
def test_a_study_name_that_leads_outside_runs_is_refused(in_tmp, capsys, command, study):
    (in_tmp / "runs").mkdir()
    (in_tmp / "outside").mkdir()
    (in_tmp / "outside" / "summary.json").write_text(json.dumps({"study": "outside"}))
    before = sorted(str(p) for p in in_tmp.rglob("*"))
    assert main([command, "--study", study]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--study" in err[0], err
    assert sorted(str(p) for p in in_tmp.rglob("*")) == before  # nothing written


def test_compare_refuses_a_study_name_that_leads_outside_runs(in_tmp, capsys):
    assert main(["compare", "--study", "ok", "--study", "../x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'../x'" in err[0], err
    assert list(in_tmp.iterdir()) == []  # not even runs/
