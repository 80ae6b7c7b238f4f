"""Exports and the files they write run nobody's code.

A policy file can come from a shared runs directory or an MLflow artifact, so a name in it
is refused at load unless it is plainly a name; and an exporter given a policy that skipped
that check (built in Python) still quotes every value it writes into code, so executing
every generated file runs no payload. Generated code loads weights without unpickling.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from autoprec import Policy, Rule, load_policy
from autoprec.cli import main
from autoprec.errors import PolicyError
from autoprec.exports import ExportError, export_cann, export_policy
from autoprec.tasks import load_task
from tests import npu_standin
from tests.planted import plant

pytest.importorskip("torchao", reason="the torchao format needs torchao")

RUN = 'x""" ; __import__("os").system("touch PWNED") ; """'  # the payload of the report
SLOW = pytest.mark.slow  # each exports every format and runs its files: about 15 s
PAYLOADS = [
    pytest.param(RUN, id="triple-double", marks=SLOW),
    pytest.param("x''' ; __import__('os').system('touch PWNED') ; '''", id="single", marks=SLOW),
    pytest.param('x\n__import__("os").system("touch PWNED")\n#', id="newline", marks=SLOW),
    pytest.param("x $(touch PWNED) `touch PWNED` \n touch PWNED", id="shell", marks=SLOW),
]

# Runs every generated Python file as a user would (imported, from its folder), each in
# turn; errors after the header (no torch_npu model, no checkpoint) are expected.
EXECUTE_ALL = """
import os, runpy, sys
for path in sys.argv[1:]:
    compile(open(path).read(), path, "exec")  # valid Python: every value quoted
    os.chdir(os.path.dirname(path))
    try:
        runpy.run_path(path, run_name=os.path.basename(path)[:-3])
    except Exception as error:
        print(path, type(error).__name__)
"""


def write_every_format(policy_name: str, folder: Path) -> list[Path]:
    """Every format's files for a policy called ``policy_name`` (rules named so too),
    exported with the model and example each needs."""
    task = load_task("digits-mlp")
    model, batch = task.model().eval(), task.batch(next(iter(task.val_data())))
    training = Policy(
        rules=(Rule("fp32", patterns=("head", "classifier"), name=policy_name),),
        default="fp16",
        name=policy_name,
    )
    serving = Policy(
        rules=(Rule("fp32", patterns=("head", "classifier"), name=policy_name),),
        default="int8",
        name=policy_name,
    )
    bert = load_task("tiny-bert").model()
    paths = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fmt in ("yaml", "torch-npu", "cann"):
            paths += export_policy(training, fmt, folder / fmt, model=model, example=batch)
        paths += export_policy(training, "transformers", folder / "hf", model=bert)
        paths += export_policy(
            serving, "model", folder / "model", model, batch, int8="torchao-dynamic"
        )
        paths += export_policy(serving, "torchao", folder / "torchao", model=model)
        paths += export_cann(training, folder / "soc", model, batch, soc_version="Ascend910B3")
    return paths


@pytest.mark.parametrize("payload", PAYLOADS)
def test_no_generated_file_runs_a_name_that_skipped_the_check(tmp_path, payload):
    paths = write_every_format(payload, tmp_path)
    python = [str(p) for p in paths if p.suffix == ".py"]
    assert {Path(p).name for p in python} == {
        "npu_settings.py",
        "load_transformers.py",
        "load_model.py",
        "torchao_config.py",
    }
    done = subprocess.run(
        [sys.executable, "-c", EXECUTE_ALL, *python],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=npu_standin.subprocess_env(PYTHONWARNINGS="ignore"),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for script in (p for p in paths if p.suffix == ".sh"):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
        # No atc on PATH: the script stops there, after whatever its lines expand.
        subprocess.run(
            ["bash", str(script)],
            cwd=tmp_path,
            env={"PATH": "/usr/bin:/bin", "SOC_VERSION": "Ascend910B3"},
            capture_output=True,
        )
    assert list(tmp_path.rglob("PWNED")) == []
    for path in paths:
        if path.name == "policy.yaml":  # the name is data there, which load_policy refuses
            assert yaml.safe_load(path.read_text())["name"] == payload


def test_a_soc_version_a_shell_would_expand_is_refused(tmp_path):
    task = load_task("digits-mlp")
    batch = task.batch(next(iter(task.val_data())))
    with pytest.raises(ExportError, match="is not a chip name"):
        export_cann(
            Policy.uniform("fp16"), tmp_path, task.model(), batch, soc_version="$(touch PWNED)"
        )
    assert not (tmp_path / "atc_command.sh").exists()


@pytest.mark.parametrize("field", ["name", "rules[0].name"])
def test_a_policy_whose_name_is_not_a_name_is_refused_at_load(tmp_path, field):
    rule = {"patterns": ["head"], "dtype": "fp32"}
    data = {"name": RUN, "rules": [rule]} if field == "name" else {"rules": [{**rule, "name": RUN}]}
    path = tmp_path / "best_policy.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PolicyError, match="is not a safe name") as refused:
        load_policy(path)
    assert f"{path}: {field}: " in str(refused.value)
    long_name = {"name": "a" * 201}
    with pytest.raises(PolicyError, match=r"name: .* is not a safe name"):
        Policy.from_dict(long_name)


def test_the_names_the_search_gives_pass_the_check():
    for name in (
        "t007 fc1=bf16 fc2=fp32 head=fp32 scale=dynamic:65536.0",
        "uniform-fp16",
        "fp16-body-fp32-head",
        "h.0-1.attn",
        "risk.features",
        "found",
        "a" * 200,
    ):
        data = {"name": name, "rules": [{"name": name, "patterns": ["x"], "dtype": "fp32"}]}
        assert Policy.from_dict(data).name == name


def test_export_of_a_study_with_such_a_policy_is_one_line_and_exit_2(tmp_path, capsys):
    study = tmp_path / "runs" / "s"
    study.mkdir(parents=True)
    (study / "summary.json").write_text('{"mode": "training", "settings": {}}')
    (study / "best_policy.yaml").write_text(f"name: {RUN!r}\ndefault: fp16\n")
    code = main(["export", "--study", "s", "--runs-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "name: " in err and "not a safe name" in err
    assert sorted(p.name for p in study.iterdir()) == ["best_policy.yaml", "summary.json"]


def test_load_model_reads_the_weights_without_unpickling(tmp_path):
    task = load_task("digits-mlp")
    paths = export_policy(
        Policy.uniform("fp16"), "model", tmp_path, model=task.model(), task="digits-mlp"
    )
    loader = next(p for p in paths if p.name == "load_model.py")
    text = loader.read_text()
    assert text.count("torch.load(") == 1 and "weights_only=True" in text
    marker = tmp_path / "PWNED"
    plant(tmp_path / "fp32.pt", marker)
    code = f"import runpy; runpy.run_path({str(loader)!r})['rebuilt']()"
    env = npu_standin.subprocess_env()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode != 0 and "UnpicklingError" in done.stderr
    assert not marker.exists()
    torch.save(task.model().state_dict(), tmp_path / "fp32.pt")  # real weights load
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
