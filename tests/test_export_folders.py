"""No export overwrites a file it did not write: not the study's fp32.pt (the user's safety
net), not a user's file of the same name; its own earlier output it replaces.

The study here is the files a serving search leaves and export reads (summary.json,
best_policy.yaml, fp32.pt as the search saves it); the exports are real.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from autoprec import Policy, Rule
from autoprec.cli import main
from autoprec.exports import ExportError, export_policy
from autoprec.tasks import load_task

TASK = "digits-mlp"
POLICY = Policy(rules=(Rule("fp32", patterns=("head",)),), default="bf16")


@pytest.fixture
def study(tmp_path, monkeypatch):
    """``runs/s``: a serving study of digits-mlp, its fp32 weights saved as a search does."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "runs" / "s"
    folder.mkdir(parents=True)
    settings = {"task_spec": TASK, "checkpoint": None, "device": "cpu", "int8": "dynamic"}
    (folder / "summary.json").write_text(json.dumps({"mode": "serving", "settings": settings}))
    POLICY.save(folder / "best_policy.yaml")
    torch.manual_seed(0)
    torch.save(load_task(TASK).model().state_dict(), folder / "fp32.pt")
    return folder


def listing(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize("other_weights", [False, True], ids=["study-weights", "--checkpoint"])
def test_export_into_the_study_folder_leaves_fp32_pt_alone(study, capsys, other_weights):
    before = listing(study)
    args = ["export", "--study", "s", "--out", str(study)]
    if other_weights:
        torch.manual_seed(1)
        torch.save(load_task(TASK).model().state_dict(), study.parent / "other.pt")
        args += ["--checkpoint", str(study.parent / "other.pt")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fp32.pt: exists and was not written by an export" in err
    assert listing(study) == before  # byte for byte, and nothing added


def test_an_export_refuses_a_folder_with_a_users_file_of_its_names(study, capsys):
    out = study.parent.parent / "served"
    out.mkdir()
    (out / "load_model.py").write_text("# the user's own loader\n")
    (out / "notes.txt").write_text("mine\n")
    before = listing(out)
    assert main(["export", "--study", "s", "--out", str(out)]) == 2
    assert "load_model.py: exists and was not written by an export" in capsys.readouterr().err
    assert listing(out) == before


def test_an_export_replaces_its_own_output_and_nothing_changed_since(study, capsys):
    out = study.parent.parent / "served"
    (out).mkdir()
    (out / "notes.txt").write_text("mine\n")  # other names are left alone
    assert main(["export", "--study", "s", "--out", str(out)]) == 0
    first = listing(out)
    assert {"fp32.pt", "load_model.py", "policy.yaml", "notes.txt"} <= set(first)
    assert main(["export", "--study", "s", "--out", str(out)]) == 0  # again: its own files
    assert set(listing(out)) == set(first) and listing(out)["notes.txt"] == b"mine\n"
    capsys.readouterr()
    with (out / "load_model.py").open("a") as edited:
        edited.write("# the user's change\n")
    edited_text = (out / "load_model.py").read_text()
    assert main(["export", "--study", "s", "--out", str(out)]) == 2
    assert "load_model.py: changed since an export wrote it" in capsys.readouterr().err
    assert (out / "load_model.py").read_text() == edited_text


def test_a_re_export_removes_its_own_files_it_no_longer_writes(tmp_path):
    task = load_task(TASK)
    model, batch = task.model().eval(), task.batch(next(iter(task.val_data())))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = export_policy(POLICY, "model", tmp_path, model=model, example=batch)
        assert "program.pt2" in {p.name for p in first}
        # torch's dynamic int8 exports no program: the earlier one would not be its model.
        again = export_policy(Policy.uniform("int8"), "model", tmp_path, model, batch)
    assert "program.pt2" not in {p.name for p in again}
    assert not (tmp_path / "program.pt2").exists()
    (tmp_path / ".autoprec-export.json").write_text("[]")
    with pytest.raises(ExportError, match="not the record of an export"):
        export_policy(POLICY, "yaml", tmp_path)
