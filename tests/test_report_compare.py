"""What a new user meets after a search, run as the user types it: the compare page (one fp32
row per study, the chosen policy marked, step time and latency in columns of their own), a
mistyped --study answered with the closest name, and a training study exported to cann.
One small training search and one small serving search serve every assertion."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
import torch

from autoprec.cli import main
from autoprec.study._summary_file import read_summary

pytestmark = pytest.mark.slow  # two real searches: about a minute on two busy cores

TASK = f"{Path(__file__).with_name('contract_tasks.py')}:make_tiny_task"
COMMON = ["--task", TASK, "--trials", "2", "--steps", "12", "--device", "cpu", "--no-progress"]


@pytest.fixture(scope="module")
def studies(tmp_path_factory):
    """A training study and a serving study of the same task, searched through the CLI."""
    folder = tmp_path_factory.mktemp("compare")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        assert main(["search", *COMMON, "--study", "train", "--confirm-top", "0"]) == 0
        assert main(["search", *COMMON, "--study", "serve", "--mode", "serving"]) == 0
    return folder


def _run(folder: Path, capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        capsys.readouterr()
        status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def _table(page: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The compare page's table: its header, and each row's class and cells (as text)."""
    header = re.findall(r"<th>(.*?)</th>", page)
    rows = []
    for row_class, body in re.findall(r'<tr class="(.*?)">(.*?)</tr>', page):
        cells = [
            html.unescape(re.sub(r"<.*?>", "", c)) for c in re.findall(r"<td>(.*?)</td>", body)
        ]
        if cells:
            rows.append((row_class, cells))
    return [html.unescape(h) for h in header], rows


def test_compare_lists_fp32_once_marks_the_chosen_and_splits_the_times(studies, capsys):
    status, out, _ = _run(studies, capsys, "compare", "--study", "train", "--study", "serve")
    assert status == 0
    page = (studies / out.strip()).read_text()  # the path printed, under runs/
    header, rows = _table(page)
    assert "step time ms" in header and "latency ms" in header
    assert "time ms" not in header
    step, latency = header.index("step time ms"), header.index("latency ms")
    for study in ("train", "serve"):
        summary = read_summary(studies / "runs" / study / "summary.json", study)
        own = [(c, cells) for c, cells in rows if cells[0].split(" (")[0] == study]
        labels = [cells[header.index("policy")] for _, cells in own]
        assert labels.count("fp32 baseline") == 1, labels
        chosen_fp32 = summary.best.key == summary.baseline.key
        assert len(own) == (1 if chosen_fp32 else 2)
        marked = [cells for c, cells in own if cells[header.index("chosen")]]
        assert [c for c, _ in own if c == "best"] == ["best"]  # one marked row per study
        assert len(marked) == 1
        assert marked[0][header.index("policy")] == summary.best.label
        for _, cells in own:  # each study's time in its own column, the other one empty
            timed, empty = (step, latency) if study == "train" else (latency, step)
            assert cells[timed] not in ("", "-") and cells[empty] == ""
            assert float(cells[timed]) == pytest.approx(
                summary.time_ms(summary.entry(_key(cells[header.index("policy")]))), abs=1e-3
            )


def _key(label: str) -> str:
    return "baseline" if label == "fp32 baseline" else label.split()[1]


@pytest.mark.parametrize(
    ("argv", "closest"),
    [
        (["report", "--study", "trian"], "train"),
        (["export", "--study", "serv"], "serve"),
        (["compare", "--study", "train", "--study", "srve"], "serve"),
        (["best", "--study", "trainn"], "train"),
    ],
)
def test_a_mistyped_study_is_answered_with_the_closest_name(studies, capsys, argv, closest):
    before = sorted(p.name for p in (studies / "runs").iterdir())
    status, out, err = _run(studies, capsys, *argv)
    assert status == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert f"did you mean {closest!r}?" in err
    assert sorted(p.name for p in (studies / "runs").iterdir()) == before


def test_an_unknown_study_far_from_any_lists_those_there_are(studies, capsys):
    status, _, err = _run(studies, capsys, "report", "--study", "zzzz")
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert "its studies: 'serve', 'train'" in err


def test_a_training_study_exports_to_cann_with_the_trained_weights_it_names(studies, capsys):
    pytest.importorskip("onnx")
    status, _, err = _run(studies, capsys, "export", "--study", "train", "--format", "cann")
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert "a training search keeps no weights" in err and "--checkpoint PATH" in err
    assert not (studies / "runs/train/export-cann").exists()
    from tests.contract_tasks import make_tiny_task

    weights = studies / "trained.pt"
    torch.save(make_tiny_task().model().state_dict(), weights)
    status, out, err = _run(
        studies,
        capsys,
        "export",
        "--study",
        "train",
        "--format",
        "cann",
        "--checkpoint",
        str(weights),
    )
    assert status == 0, err
    written = {Path(line).name for line in out.split()}
    assert {"model.onnx", "keep_dtype.cfg", "atc_command.sh"} <= written
