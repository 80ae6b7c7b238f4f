"""No write follows a link, a failed write is one line, and no secret of a URL is shown.

A runs folder may be shared: whoever can write into it can plant a symbolic link at a name
the next command writes. Every command here runs with a link planted at every name it
writes, and the link's target must be unchanged afterwards; the command either wrote its
file in place of the link or refused in one line. A read-only or full disk is a real one
(a tmpfs mounted for the test where the test may mount, RLIMIT_FSIZE otherwise).
Two small searches (training and serving) serve every assertion that needs a study; they
run with secrets in their store URLs, which must appear nowhere: not on the console, not in
any file under runs/, not in the MLflow or Optuna databases.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from autoprec import Policy, Rule
from autoprec._util.files import atomic_file, open_log, write_atomic
from autoprec.errors import WriteError, redact
from autoprec.exports import ExportError, export_policy
from autoprec.tasks import load_task

FAKES = "tests.distributed_fakes"

VICTIM_TEXT = "a file of the user's, which no command may change\n"
# Secrets in the query forms a local sqlite store accepts (it ignores unknown arguments);
# the user-info forms, which SQLite URLs cannot hold, are tested on the error lines.
STORAGE = "sqlite:///runs/optuna.db?api_key=SECRETAPIKEY&x=1&sig=SECRETSIG"
TRACKING = "sqlite:///runs/mlflow.db?password=SECRETPASSWORD"
SECRETS = ("SECRETAPIKEY", "SECRETSIG", "SECRETPASSWORD", "SECRETTOKEN", "SECRETUSERPASS")
SEARCH = ["search", "--no-progress", "--trials", "2", "--steps", "5", "--device", "cpu"]
SEARCH += ["--storage", STORAGE, "--tracking-uri", TRACKING]
REPORT_FILES = ("report.html", "front_step_time.png", "front_memory.png", "dtype_map.png")
REPORT_FILES += ("headroom.png",)
SERVING_REPORT = ("report.html", "front_latency.png", "front_memory.png", "dtype_map.png")
SERVING_REPORT += ("latency_by_batch.png",)
STUDY_FILES = ("summary.json", "best_policy.yaml", "profile.json")


def _cli(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """An autoprec command as a user runs it, its console output captured."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run(
        [sys.executable, "-m", "autoprec.cli", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )


class Victims:
    """Files and folders of the user's, outside runs/, that planted links point to."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.count = 0

    def existing(self) -> Path:
        self.count += 1
        path = self.folder / f"kept-{self.count}.txt"
        path.write_text(VICTIM_TEXT)
        return path

    def absent(self) -> Path:
        """A name no file has yet: a write through the link would create it."""
        self.count += 1
        return self.folder / f"absent-{self.count}"

    def plant(self, link: Path, existing: bool = True) -> Path:
        link.parent.mkdir(parents=True, exist_ok=True)
        target = self.existing() if existing else self.absent()
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        link.symlink_to(target)
        return target

    def check(self) -> None:
        """Every victim as it was: no file created, none changed."""
        for path in sorted(self.folder.iterdir()):
            assert path.name.startswith("kept-"), f"{path} was created through a link"
            if path.is_dir():
                assert list(path.iterdir()) == [], f"{path}: written into through a link"
                continue
            assert path.read_text() == VICTIM_TEXT, f"{path} was written through a link"


def _replaced(link: Path) -> None:
    """The command wrote its file in place of the link."""
    assert link.is_file() and not link.is_symlink(), link


def _no_secret(text: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret} in {where}"


def _no_secret_under(folder: Path) -> None:
    """No secret in the bytes of any file: the databases, artifacts, summaries, logs."""
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            for secret in SECRETS:
                assert secret.encode() not in data, f"{secret} in {path}"


@pytest.fixture(scope="module")
def studies(tmp_path_factory):
    """A training and a serving study, searched with a link planted at every file the
    search writes in the study's folder (dangling: a write through one creates its
    target) and secrets in both store URLs."""
    root = tmp_path_factory.mktemp("writes")
    victims = Victims(root / "victims")
    planted = {}
    for study in ("trained", "served"):
        names = [*STUDY_FILES, "fp32.pt"] if study == "served" else STUDY_FILES
        for name in names:
            planted[study, name] = victims.plant(root / "runs" / study / name, existing=False)
    # The served model's MLflow folder, planted as a link to a folder of the user's.
    (root / "victims" / "kept-folder").mkdir()
    (root / "runs" / "served" / "mlflow_model").symlink_to(root / "victims" / "kept-folder")
    trained = _cli(root, *SEARCH, "--task", "digits-mlp", "--study", "trained")
    assert trained.returncode == 0, trained.stderr[-3000:]
    served = _cli(
        root, *SEARCH, "--task", "digits-mlp", "--study", "served", "--mode", "serving",
        "--scenario", "batch", "--batch-sizes", "1,16", "--confirm-top", "0",
    )  # fmt: skip
    assert served.returncode == 0, served.stderr[-3000:]
    return root, victims, {"trained": trained, "served": served}


@pytest.mark.slow
def test_a_search_writes_its_files_in_place_of_planted_links(studies):
    root, victims, _ = studies
    for study in ("trained", "served"):
        for name in STUDY_FILES:
            _replaced(root / "runs" / study / name)
    _replaced(root / "runs" / "served" / "fp32.pt")
    model = root / "runs" / "served" / "mlflow_model"
    assert model.is_dir() and not model.is_symlink() and (model / "MLmodel").is_file()
    assert list((root / "victims" / "kept-folder").iterdir()) == []
    summary = json.loads((root / "runs" / "trained" / "summary.json").read_text())
    assert summary["study"] == "trained"
    victims.check()


@pytest.mark.slow
def test_report_and_compare_write_in_place_of_planted_links(studies):
    root, victims, _ = studies
    links = [root / "runs" / "trained" / name for name in REPORT_FILES]
    links += [root / "runs" / "served" / name for name in SERVING_REPORT]
    links += [root / "runs" / "compare-trained-served.html"]
    links += [root / "runs" / "compare-trained-served-fronts.png"]
    for link in links:
        victims.plant(link)
    written = {"runs/compare-trained-served-fronts.png"}
    for study in ("trained", "served"):
        done = _cli(root, "report", "--study", study)
        assert done.returncode == 0, done.stderr[-2000:]
        _no_secret(done.stdout + done.stderr, f"report --study {study}")
        written.update(done.stdout.split())
    compared = _cli(root, "compare", "--study", "trained", "--study", "served")
    assert compared.returncode == 0, compared.stderr[-2000:]
    written.update(compared.stdout.split())
    assert len(written) >= 11, written  # both reports' pages and plots, the comparison
    for link in links:
        if str(link.relative_to(root)) in written:
            _replaced(link)
        else:  # a plot the study has no data for (headroom): not written, link untouched
            assert link.is_symlink(), link
    victims.check()


@pytest.mark.slow
def test_no_secret_on_the_console_in_runs_or_in_the_stores(studies):
    """The query forms went through two real searches, a report, a compare and a best;
    the user-info forms through the error lines of commands given unreachable stores."""
    root, _, done = studies
    for name, run in done.items():
        _no_secret(run.stdout + run.stderr, f"search {name}")
    compare, took = done["trained"].stdout.splitlines()[-2:]
    assert (
        compare == "compare:     autoprec ui --tracking-uri sqlite:///runs/mlflow.db?password=***"
    )
    assert took.startswith("took: "), took
    best = _cli(root, "best", "--study", "trained", "--tracking-uri", TRACKING)
    assert best.returncode == 0, best.stderr[-2000:]
    _no_secret(best.stdout + best.stderr, "best")
    unreachable = [
        ("best", "--study", "trained", "--tracking-uri", "http://SECRETTOKEN@127.0.0.1:9"),
        (
            "best",
            "--study",
            "trained",
            "--tracking-uri",
            "http://127.0.0.1:9/?api_key=SECRETAPIKEY",
        ),
        ("report", "--study", "trained", "--tracking-uri", "http://SECRETTOKEN@127.0.0.1:9/"),
        ("search", "--storage", "postgresql://u:SECRETUSERPASS@127.0.0.1:9/db", "--trials", "1"),
        ("search", "--storage", "postgresql://SECRETTOKEN@127.0.0.1:9/db?sig=SECRETSIG"),
    ]
    for args in unreachable:
        failed = _cli(root, *args)
        assert failed.returncode == 2, (args, failed.stderr[-2000:])
        assert "Traceback" not in failed.stderr, failed.stderr[-2000:]
        _no_secret(failed.stdout + failed.stderr, " ".join(args))
    _no_secret_under(root / "runs")


@pytest.mark.slow
def test_every_export_format_refuses_or_writes_in_place_of_planted_links(studies, tmp_path):
    root, victims, _ = studies
    task = load_task("digits-mlp")
    model, batch = task.model().eval(), task.batch(next(iter(task.val_data())))
    training = Policy(rules=(Rule("fp32", patterns=("head", "classifier")),), default="fp16")
    serving = Policy(rules=(Rule("fp32", patterns=("head",)),), default="int8")
    fp8 = Policy(rules=(Rule("fp32", patterns=("head", "classifier")),), default="fp8")
    bert = load_task("tiny-bert").model()
    formats = [
        ("yaml", training, {}),
        ("torch-npu", training, {"model": model}),
        ("cann", training, {"model": model, "example": batch}),
        ("transformers", training, {"model": bert}),
        ("fp8", fp8, {"model": bert}),
        ("model", serving, {"model": model, "example": batch, "int8": "torchao-dynamic"}),
        ("torchao", serving, {"model": model}),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fmt, policy, given in formats:
            folder = tmp_path / fmt
            written = export_policy(policy, fmt, folder, **given)  # learn its names
            names = [p.name for p in written]
            shutil.rmtree(folder)
            # The record and its old partial name: dangling links, written in place of.
            record = victims.plant(folder / ".autoprec-export.json", existing=False)
            partial = victims.plant(folder / ".autoprec-export.json.partial")
            assert record.parent == victims.folder
            again = export_policy(policy, fmt, folder, **given)
            assert sorted(p.name for p in again) == sorted(names)
            _replaced(folder / ".autoprec-export.json")
            for path in again:
                _replaced(path)
            assert (folder / ".autoprec-export.json.partial").resolve() == partial
            # A link at a name the export writes: refused before anything is written.
            for name in names:
                (folder / name).unlink()
                victims.plant(folder / name)
            with pytest.raises(ExportError, match="not a file an export wrote"):
                export_policy(policy, fmt, folder, **given)
            victims.check()
    # The CLI's own exports of the two studies, with links at the record's names.
    for study, fmt in (("trained", "yaml"), ("served", "model")):
        folder = root / "runs" / study / f"export-{fmt}"
        victims.plant(folder / ".autoprec-export.json", existing=False)
        victims.plant(folder / ".autoprec-export.json.partial")
        done = _cli(root, "export", "--study", study, "--format", fmt)
        assert done.returncode == 0, done.stderr[-2000:]
        _replaced(folder / ".autoprec-export.json")
    victims.check()
    # torchao: refused where the chosen policy serves no layer in int8, leaving no folder.
    done = _cli(root, "export", "--study", "served", "--format", "torchao")
    folder = root / "runs" / "served" / "export-torchao"
    if done.returncode == 0:
        _replaced(folder / ".autoprec-export.json")
    else:
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert not folder.exists()


@pytest.mark.slow
def test_a_launch_writes_its_spec_and_log_in_place_of_planted_links(tmp_path):
    from autoprec.distributed.launch import launch

    victims = Victims(tmp_path / "victims")
    folder = tmp_path / "runs" / "s" / "launches" / "1-0"
    for name in ("spec.json", "launch.log", "result.json"):
        victims.plant(folder / name)
    outcome = launch({"fake": "ok"}, 2, folder, 120.0, module=FAKES)
    assert outcome.exit_code == 0, outcome.log_path.read_text()[-2000:]
    assert json.loads((folder / "spec.json").read_text()) == {"fake": "ok"}
    for name in ("spec.json", "launch.log"):
        _replaced(folder / name)
    victims.check()


def test_a_planted_link_is_replaced_never_written_through(tmp_path):
    victims = Victims(tmp_path / "victims")
    runs = tmp_path / "runs"
    kept, absent = victims.plant(runs / "s" / "a.json"), victims.plant(runs / "s" / "b.json", False)
    write_atomic(runs / "s" / "a.json", "new", within=runs)
    with atomic_file(runs / "s" / "b.json", within=runs) as out:
        out.write(b"bytes")
    assert (runs / "s" / "a.json").read_text() == "new" and not absent.exists()
    assert kept.read_text() == VICTIM_TEXT
    victims.plant(runs / "s" / "new.log")
    with open_log(runs / "s" / "new.log") as log:  # a fresh log: created, then renamed
        log.write(b"line\n")
    _replaced(runs / "s" / "new.log")
    victims.plant(runs / "s" / "appended.log")
    with pytest.raises(WriteError, match=r"appended.log: cannot write \(a symbolic link"):
        open_log(runs / "s" / "appended.log", append=True)
    assert sorted(p.name for p in (runs / "s").iterdir()) == [
        "a.json", "appended.log", "b.json", "new.log",
    ]  # fmt: skip
    victims.check()


def test_a_study_folder_that_is_a_link_is_refused_below_the_runs_folder(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "s").symlink_to(elsewhere)
    with pytest.raises(WriteError, match=r"runs/s: a symbolic link under .*runs; autoprec"):
        write_atomic(runs / "s" / "summary.json", "{}", within=runs)
    with pytest.raises(WriteError, match="a symbolic link"):
        write_atomic(runs / "s" / "deeper" / "x.png", b"", within=runs)
    assert list(elsewhere.iterdir()) == []
    # The runs folder itself, and a folder the user names, may be links (their choice).
    linked_runs = tmp_path / "linked-runs"
    linked_runs.symlink_to(elsewhere)
    write_atomic(linked_runs / "t" / "summary.json", "{}", within=linked_runs)
    assert (elsewhere / "t" / "summary.json").read_text() == "{}"


# -- a read-only or full disk: one line, exit 2, the old file intact -------------------------


@contextlib.contextmanager
def _tmpfs(folder: Path, size_kb: int):
    """A real small file system at ``folder`` (root may mount one); skipped elsewhere."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(folder)],
        capture_output=True,
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root): no real full disk to test on")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_full_disk_is_a_write_error_naming_the_file_and_the_old_file_stays(tmp_path):
    with _tmpfs(tmp_path / "small", 64) as disk:
        write_atomic(disk / "summary.json", "old")
        with pytest.raises(WriteError, match=r"summary.json: cannot write \(No space left"):
            write_atomic(disk / "summary.json", b"x" * 200_000)
        assert (disk / "summary.json").read_text() == "old"
        assert sorted(p.name for p in disk.iterdir()) == ["summary.json"]  # no partial left


def test_a_file_size_limit_is_a_write_error_too(tmp_path):
    """RLIMIT_FSIZE (any user may set it): the write fails with EFBIG."""
    code = f"""
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
from autoprec._util.files import write_atomic
from autoprec.errors import WriteError
try:
    write_atomic({str(tmp_path / "big.bin")!r}, b"x" * 100_000)
except WriteError as error:
    print(error)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == f"{tmp_path / 'big.bin'}: cannot write (File too large)"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("disk", ["read-only", "full"])
def test_report_on_a_read_only_or_full_runs_folder_is_one_line_and_exit_2(studies, tmp_path, disk):
    root, _, _ = studies
    summary = (root / "runs" / "trained" / "summary.json").read_bytes()
    size_kb = 16 + len(summary) // 1024 + 8  # the summary fits; the report's PNGs do not
    with _tmpfs(tmp_path / "runs", size_kb) as runs:
        (runs / "trained").mkdir()
        (runs / "trained" / "summary.json").write_bytes(summary)
        if disk == "read-only":
            subprocess.run(["mount", "-o", "remount,ro", str(runs)], check=True)
        done = _cli(tmp_path, "report", "--study", "trained", "--runs-dir", str(runs))
        reason = "Read-only file system" if disk == "read-only" else "No space left on device"
        assert done.returncode == 2, done.stderr[-2000:]
        assert done.stderr.count("\n") == 1 and reason in done.stderr, done.stderr
        assert done.stderr.startswith("autoprec report: error: ")


# -- redaction ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        ("http://SECRETTOKEN@mlflow.example:5000", "SECRETTOKEN"),
        ("https://ghp_SECRETTOKEN@host/path?x=1", "ghp_SECRETTOKEN"),
        ("https://a@SECRETTOKEN@host/", "SECRETTOKEN"),
        ("http://h/?api_key=SECRETAPIKEY", "SECRETAPIKEY"),
        ("http://h/?apikey=SECRETAPIKEY&x=1", "SECRETAPIKEY"),
        ("http://h/?key=SECRETAPIKEY", "SECRETAPIKEY"),
        ("http://h/?x=1&sig=SECRETSIG", "SECRETSIG"),
        ("https://s3/x?X-Amz-Signature=SECRETSIG&X-Amz-Credential=SECRETCRED", "SECRETSIG"),
        ("https://s3/x?X-Amz-Signature=SECRETSIG&X-Amz-Credential=SECRETCRED", "SECRETCRED"),
        ("http://h/?access_key=SECRETAK", "SECRETAK"),
        ("http://h/?auth=SECRETAUTH", "SECRETAUTH"),
        ("http://h/#access_token=SECRETTOKEN", "SECRETTOKEN"),
    ],
)
def test_redact_hides_tokens_and_keys(url, secret):
    for text in (url, f"--tracking-uri {url!r}: cannot connect", f"a {url} and sqlite:///x.db"):
        shown = redact(text)
        assert secret not in shown, shown
        assert "***" in shown
    assert redact(redact(url)) == redact(url)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:SECRETUSERPASS@h/db",
        "http://SECRETTOKEN@h:5000",
        "sqlite:///runs/mlflow.db?password=SECRETPASSWORD",
        "sqlite:///runs/optuna.db?api_key=SECRETAPIKEY",
        "sqlite:///runs/optuna.db?x=1&sig=SECRETSIG",
    ],
)
def test_the_settings_written_down_hold_no_secret(url):
    """summary.json's settings and the MLflow parent run's params are the public ones."""
    from autoprec.study.config import SearchConfig

    storage = STORAGE if url.startswith("http") else url  # Optuna's: a database URL
    public = SearchConfig(storage=storage, tracking_uri=url).public()
    _no_secret(json.dumps(public), url)


# -- what export runs ------------------------------------------------------------------------

MARKED_TASK = """
from pathlib import Path

Path(__file__).with_name("IMPORTED").touch()  # what importing this module does

from autoprec.tasks import load_task


def task():
    return load_task("digits-mlp")
"""


@pytest.mark.slow
def test_export_imports_the_task_a_summary_names_except_for_yaml_or_another_task(studies, tmp_path):
    """As docs/security.md says: summary.json is data, but the task module it
    names is imported to build the model, for every format but yaml, unless --task names
    the task instead."""
    root, _, _ = studies
    (tmp_path / "marked_task.py").write_text(MARKED_TASK)
    marker = tmp_path / "IMPORTED"
    study = tmp_path / "runs" / "marked"
    shutil.copytree(root / "runs" / "trained", study, ignore=shutil.ignore_patterns("*.png"))
    summary = json.loads((study / "summary.json").read_text())
    summary["study"] = "marked"
    summary["settings"]["task_spec"] = f"{tmp_path / 'marked_task.py'}:task"
    (study / "summary.json").write_text(json.dumps(summary))
    done = _cli(tmp_path, "export", "--study", "marked", "--format", "yaml")
    assert done.returncode == 0, done.stderr[-2000:]
    assert not marker.exists()
    done = _cli(tmp_path, "export", "--study", "marked", "--format", "torch-npu", "--task",
                "digits-mlp", "--out", str(tmp_path / "named"))  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert not marker.exists()
    done = _cli(tmp_path, "export", "--study", "marked", "--format", "torch-npu")
    assert done.returncode == 0, done.stderr[-2000:]
    assert marker.exists()
    refused = _cli(tmp_path, "export", "--study", "marked", "--format", "fp8", "--device", "npu")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "Ascend 910 NPUs have no fp8 matmuls" in refused.stderr
    assert not (study / "export-fp8").exists()


def test_a_refused_export_leaves_no_folder_behind(tmp_path):
    task = load_task("digits-mlp")
    model = task.model()
    serving = Policy(rules=(Rule("fp32", patterns=("head",)),), default="int8")
    out = tmp_path / "export-model"
    with pytest.raises(Exception, match="cuda:99"):  # no such device: refused
        export_policy(serving, "model", out, model, device="cuda:99")
    assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "mine.txt").write_text("x")
    with pytest.raises(Exception, match="cuda:99"):
        export_policy(serving, "model", kept, model, device="cuda:99")
    assert sorted(p.name for p in kept.iterdir()) == ["mine.txt"]  # an existing folder stays


def test_fp8_export_for_the_npu_is_refused_in_one_line(tmp_path):
    fp8 = Policy(rules=(Rule("fp32", patterns=("head",)),), default="fp8")
    with pytest.raises(ExportError, match="format 'fp8': --device npu: fp8: Ascend 910"):
        export_policy(fp8, "fp8", tmp_path / "out", load_task("digits-mlp").model(), device="npu")
    assert not (tmp_path / "out").exists()


def test_outputs_recorded_before_a_token_was_redacted_still_continue():
    from autoprec.study._identity import StudyIdentity, refuse_other_storage

    url = "postgresql://autoprec@db.example/optuna"
    recorded = StudyIdentity(url, "id")  # as summary.json recorded it before
    refuse_other_storage("s", "runs/s", recorded, StudyIdentity.of(url, "id").storage)
    assert StudyIdentity.of(url, "id").storage == "postgresql://***@db.example/optuna"
