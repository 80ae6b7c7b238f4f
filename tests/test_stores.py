"""Nothing overwrites a study by mistake: outputs replaced whole, study names that stay
under runs/, and outputs tied to the Optuna study they came from."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autoprec.cli import main
from autoprec.tracking import mlflow_client

TASKS = Path(__file__).with_name("contract_tasks.py")
CLI = "import sys; from autoprec.cli import main; sys.exit(main(sys.argv[1:]))"

# A process whose files may grow to 4 KiB only (RLIMIT_FSIZE): a write past that fails
# half-way with EFBIG, as one on a full disk fails with ENOSPC.
_WRITE_WITH_A_FULL_DISK = textwrap.dedent(
    """
    import json, resource, signal, sys
    from pathlib import Path
    from autoprec.policy import Policy
    from autoprec.study.summary import write_outputs

    out = Path(sys.argv[1])
    rules = [{"patterns": [f"layer{i}"], "dtype": "bf16"} for i in range(400)]
    policy = Policy.from_dict({"name": "big", "default": "fp16", "rules": rules})
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
    from autoprec.study.summary import write_outputs

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


def _snapshot(folder):
    """Every file under ``folder`` with its bytes (the Optuna and MLflow databases too)."""
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _search_args(*extra):
    return [
        "search",
        "--task",
        f"{TASKS}:tiny",
        "--study",
        "tied",
        "--trials",
        "2",
        "--steps",
        "12",
        "--confirm-top",
        "0",
        "--device",
        "cpu",
        "--no-progress",
        *extra,
    ]


def _refused(capsys, *extra) -> str:
    assert main(_search_args(*extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.slow
def test_a_study_run_with_another_storage_overwrites_nothing(in_tmp, capsys, tmp_path_factory):
    assert main(_search_args()) == 0
    summary = json.loads((in_tmp / "runs/tied/summary.json").read_text())
    tied = summary["optuna_study"]
    assert tied["storage"] == f"sqlite:///{in_tmp}/runs/optuna.db" and tied["study_id"]
    client = mlflow_client(f"sqlite:///{in_tmp}/runs/mlflow.db")
    (parent,) = client.search_runs(
        [client.get_experiment_by_name("tied").experiment_id],
        filter_string="tags.`autoprec.role` = 'parent'",
    )
    assert parent.data.tags["autoprec.study_id"] == tied["study_id"]
    capsys.readouterr()
    before = _snapshot(in_tmp)

    # A typo: a folder that does not exist is an error, and nothing is created.
    typo = tmp_path_factory.mktemp("elsewhere") / "no" / "dir"
    line = _refused(capsys, "--storage", f"sqlite:///{typo}/x.db")
    assert "does not exist" in line and not typo.parent.exists()
    # Another database: the outputs came from runs/optuna.db, and are refused as such.
    line = _refused(capsys, "--storage", "sqlite:///other.db")
    assert "runs/tied" in line and "runs/optuna.db" in line
    assert _snapshot(in_tmp) == before  # other.db not even created
    # Without the outputs, the MLflow parent run still says where it came from.
    outputs = in_tmp / "runs/tied/summary.json"
    outputs.rename(in_tmp / "kept.json")
    line = _refused(capsys, "--storage", "sqlite:///other.db")
    assert "MLflow parent run" in line and not (in_tmp / "other.db").exists()
    # The same storage, but the study in it is another one (the database was lost).
    (in_tmp / "kept.json").rename(outputs)
    for path in (in_tmp / "runs").glob("optuna.db*"):
        path.rename(in_tmp / path.name)
    line = _refused(capsys)
    assert "no longer holds" in line
    assert not (in_tmp / "runs/optuna.db").exists()
    assert {k: v for k, v in _snapshot(in_tmp / "runs").items()} == {
        k: v for k, v in before.items() if "/runs/" in k and "optuna.db" not in k
    }


@pytest.mark.slow
def test_a_lost_tracking_store_is_written_again_baseline_included(in_tmp):
    # Two commands, as a user runs them (one process would keep MLflow's cached store).
    def search():
        done = subprocess.run(
            [sys.executable, "-c", CLI, *_search_args()],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stderr

    search()
    for path in (in_tmp / "runs").glob("mlflow.db*"):
        path.unlink()
    assert "warning" not in search()  # nothing left to train: MLflow catches up
    client = mlflow_client(f"sqlite:///{in_tmp}/runs/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("tied").experiment_id])
    names = sorted(r.info.run_name for r in runs if r.data.tags.get("autoprec.role") != "parent")
    assert len(names) == 3 and "baseline-fp32" in names, names
    (baseline,) = [r for r in runs if r.info.run_name == "baseline-fp32"]
    assert baseline.info.status == "FINISHED" and baseline.data.metrics["accuracy"] > 0
    assert baseline.data.tags["autoprec.logged"] == "true"


def _search_quietly_failing_to_track(folder, tracking_uri, wrap=()):
    """A search in a subprocess whose MLflow store cannot be used: it ends as it would
    with a working one, and says so in one warning line."""
    done = subprocess.run(
        [*wrap, sys.executable, "-c", CLI, *_search_args("--tracking-uri", tracking_uri)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "retried" not in done.stderr, done.stderr[-3000:]
    assert "best policy:" in done.stdout
    summary = json.loads((folder / "runs/tied/summary.json").read_text())
    assert len(summary["trials"]) == 2 and (folder / "runs/tied/best_policy.yaml").is_file()
    return warnings[0]


@pytest.mark.slow
def test_an_unreachable_postgresql_tracking_store_is_one_warning(tmp_path):
    pytest.importorskip("psycopg")
    line = _search_quietly_failing_to_track(tmp_path, "postgresql://127.0.0.1:1/x")
    assert "is unreachable" in line and "trials go on" in line


def _can_mount_tmpfs(folder) -> bool:
    probe = f"mount -t tmpfs -o size=64k tmpfs {folder}"
    return (
        subprocess.run(["unshare", "-rm", "sh", "-c", probe], capture_output=True).returncode == 0
    )


@pytest.mark.slow
def test_a_full_disk_under_the_tracking_store_is_one_warning(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("unshare") is None or not _can_mount_tmpfs(disk):
        pytest.skip("no unshare, or no user namespaces to mount a small tmpfs in")
    # A disk with room for MLflow's empty database and a few pages more: full mid-search.
    empty = tmp_path / "empty.db"
    mlflow_client(f"sqlite:///{empty}").search_experiments()
    size_kb = empty.stat().st_size // 1024 + 56
    mount = f'mount -t tmpfs -o size={size_kb}k tmpfs {disk} && exec "$@"'
    wrap = ("unshare", "-rm", "sh", "-c", mount, "sh")
    line = _search_quietly_failing_to_track(tmp_path, f"sqlite:///{disk}/mlflow.db", wrap)
    assert "cannot be written" in line and "disk is full" in line
