"""The ``fp8`` export: torchtitan's filter_fqns, torchao's module_filter_fn and accelerate's
AORecipeKwargs each convert exactly the policy's fp8 layers, on the tools' own code where it
is installed (torchao, accelerate) and on torchtitan's documented rule where it is not; a
policy without fp8 layers is refused in one line; no layer name runs as code."""

from __future__ import annotations

import glob
import importlib.util
import json
import runpy
import shlex
import subprocess
import sys
import warnings
from collections import OrderedDict
from pathlib import Path

import pytest
import tomllib
from torch import nn

from autoprec import Policy, Rule
from autoprec.cli import main
from autoprec.errors import PolicyError
from autoprec.exports import ExportError, ExportWarning, export_policy
from autoprec.policy import Quantization
from autoprec.tasks import load_task

torchao_float8 = pytest.importorskip("torchao.float8")

BERT = "bert.encoder.layer"
# tiny-bert's layers the policy below puts in fp8; other names there hold theirs as parts
# ("output.dense" is the tail of "attention.output.dense").
BERT_FP8 = {
    f"{BERT}.0.attention.self.query",
    f"{BERT}.0.attention.output.dense",
    f"{BERT}.0.intermediate.dense",
    f"{BERT}.1.attention.output.dense",
    f"{BERT}.1.intermediate.dense",
}
BERT_POLICY = Policy(
    rules=(
        Rule(
            "fp8",
            patterns=("*.attention.output.dense", "*.intermediate.dense", f"{BERT}.0.*.query"),
        ),
    ),
    default="bf16",
    quantization=Quantization(fp8="rowwise"),
    name="bert-fp8",
)
COMMAND_LINE = "# Command line (v0.2): "


def bert() -> nn.Module:
    return load_task("tiny-bert").model()


def export(policy: Policy, folder: Path, model: nn.Module) -> dict[str, Path]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)  # an exact export approximates nothing
        paths = export_policy(policy, "fp8", folder, model=model)
    return {path.name: path for path in paths}


def converted(model: nn.Module) -> set[str]:
    return {
        name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"
    }


def torchtitan_converts(model: nn.Module, filter_fqns: list[str]) -> set[str]:
    """torchtitan's rule, as its source states it (torchtitan/components/quantization/utils.py,
    ``module_filter_fn``, v0.1.0 to v0.2.2): an nn.Linear whose weight's dimensions are both
    multiples of 16 converts unless ``any(filter_fqn in fqn for filter_fqn in filter_fqns)``."""
    return {
        fqn
        for fqn, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and module.weight.shape[0] % 16 == 0
        and module.weight.shape[1] % 16 == 0
        and not any(entry in fqn for entry in filter_fqns)
    }


def torchtitan_settings(path: Path) -> dict:
    return tomllib.loads(path.read_text())["quantize"]["linear"]["float8"]


def command_line_filter(path: Path) -> list[str]:
    line = next(line for line in path.read_text().splitlines() if line.startswith(COMMAND_LINE))
    flags = dict(flag.split("=", 1) for flag in shlex.split(line[len(COMMAND_LINE) :]))
    return flags["--quantize.linear.float8.filter_fqns"].split(",")


def test_torchao_snippet_converts_exactly_the_policys_layers(tmp_path):
    files = export(BERT_POLICY, tmp_path, bert())
    snippet = runpy.run_path(str(files["float8_torchao.py"]))
    model = bert()
    assert snippet["convert"](model) is model
    assert converted(model) == BERT_FP8
    assert snippet["RECIPE"] == "rowwise"
    model(**load_task("tiny-bert").batch(next(iter(load_task("tiny-bert").val_data()))).kwargs)


def test_torchtitan_filter_converts_exactly_the_policys_layers(tmp_path):
    model = bert()
    files = export(BERT_POLICY, tmp_path, model)
    settings = torchtitan_settings(files["float8_torchtitan.toml"])
    assert settings["recipe_name"] == "rowwise"
    assert settings["enable_fsdp_float8_all_gather"] is False  # torchtitan asserts it with a recipe
    entries = settings["filter_fqns"]
    assert torchtitan_converts(model, entries) == BERT_FP8
    kept = torchtitan_converts(model, []) - BERT_FP8
    assert len(entries) < len(kept)  # entries exclude several layers each where they can
    assert command_line_filter(files["float8_torchtitan.toml"]) == entries


def test_accelerate_recipe_kwargs_filter_exactly_the_policys_layers(tmp_path):
    """What ``Accelerator.prepare`` does with the handler: accelerate's own
    ``convert_model_to_fp8_ao`` with its config and module_filter_func."""
    pytest.importorskip("accelerate")
    from accelerate.utils import AORecipeKwargs
    from accelerate.utils.ao import convert_model_to_fp8_ao

    files = export(BERT_POLICY, tmp_path, bert())
    snippet = runpy.run_path(str(files["float8_accelerate.py"]))
    handler = snippet["recipe_kwargs"]()
    assert isinstance(handler, AORecipeKwargs)
    model = bert()
    chosen = {
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and handler.module_filter_func(module, name)
    }
    assert chosen == BERT_FP8
    convert_model_to_fp8_ao(
        model, config=handler.config, module_filter_func=handler.module_filter_func
    )
    assert converted(model) == BERT_FP8


PREPARE = """
import json, runpy, sys
from autoprec.tasks import load_task
snippet = runpy.run_path(sys.argv[1])
accelerator = snippet["make_accelerator"](cpu=True)
model = accelerator.prepare(load_task("tiny-bert").model())
names = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
print(json.dumps([accelerator.mixed_precision, names]))
"""


def test_accelerator_fp8_prepare_converts_exactly_the_policys_layers(tmp_path):
    """The whole Accelerator path, on the CPU (``cpu=True``), in a process of its own:
    accelerate's state is one per process and fp8 there would outlive the test."""
    pytest.importorskip("accelerate")
    files = export(BERT_POLICY, tmp_path, bert())
    run = subprocess.run(
        [sys.executable, "-c", PREPARE, str(files["float8_accelerate.py"])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    mixed_precision, names = json.loads(run.stdout.strip().splitlines()[-1])
    assert mixed_precision == "fp8" and set(names) == BERT_FP8


def named_mlp(names: list[str], width: int = 32) -> nn.Module:
    return nn.Sequential(OrderedDict((name, nn.Linear(width, width)) for name in names))


def test_a_name_inside_an_fp8_layers_name_keeps_that_layer_out_under_torchtitan(tmp_path):
    """``fc`` must not convert and is part of ``fc2``: torchtitan's substring rule cannot
    exclude one without the other, so fc2 trains in high precision there, with a note;
    torchao and accelerate take fc2 as the policy says."""
    layers = ["fc", "fc2", "proj", "out"]
    model = named_mlp(layers)
    policy = Policy(rules=(Rule("fp8", patterns=("fc2", "out")),), default="bf16")
    with pytest.warns(ExportWarning, match="'fc2'") as caught:
        paths = export_policy(policy, "fp8", tmp_path, model=model)
    assert len(caught) == 1
    files = {path.name: path for path in paths}
    text = files["float8_torchtitan.toml"].read_text()
    assert str(caught[0].message).split()[:4] == text.split("# NOTE: ", 1)[1].split()[:4]
    entries = torchtitan_settings(files["float8_torchtitan.toml"])["filter_fqns"]
    assert torchtitan_converts(model, entries) == {"out"}
    snippet = runpy.run_path(str(files["float8_torchao.py"]))
    assert converted(snippet["convert"](named_mlp(layers))) == {"fc2", "out"}


def test_other_layers_the_tool_runs_otherwise_are_named_in_a_note(tmp_path):
    """fp8 beside fp32 layers: accelerate runs them in bf16, and the note says which."""
    model = named_mlp(["a", "b", "c"])
    policy = Policy(
        rules=(Rule("fp8", patterns=("a",)), Rule("fp32", patterns=("c",))), default="bf16"
    )
    with pytest.warns(ExportWarning) as caught:
        paths = export_policy(policy, "fp8", tmp_path, model=model)
    messages = [str(warning.message) for warning in caught]
    assert any(m.startswith("accelerate") and "'c'=fp32" in m for m in messages)
    assert not any("'b'" in m for m in messages)  # b runs bf16, as every tool runs it
    accelerate = next(p for p in paths if p.name == "float8_accelerate.py").read_text()
    assert "# NOTE: accelerate" in accelerate


@pytest.mark.parametrize(
    ("policy", "error", "says"),
    [
        (Policy.uniform("bf16"), ExportError, "no layer in fp8"),
        (Policy(rules=(Rule("fp8", patterns=("head",)),)), PolicyError, "cannot be fp8"),
    ],
    ids=["no-fp8-rule", "fp8-rule-on-a-layer-fp8-cannot-take"],
)
def test_a_policy_without_fp8_layers_is_refused_in_one_line(tmp_path, policy, error, says):
    model = load_task("digits-mlp").model()  # head is 256x10: not a multiple of 16
    with pytest.raises(error, match=says) as refused:
        export_policy(policy, "fp8", tmp_path / "out", model=model)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


def study(tmp_path: Path, policy: Policy) -> Path:
    folder = tmp_path / "runs" / "s"
    folder.mkdir(parents=True)
    settings = {"task_spec": "digits-mlp", "checkpoint": None, "device": "cpu"}
    (folder / "summary.json").write_text(json.dumps({"mode": "training", "settings": settings}))
    policy.save(folder / "best_policy.yaml")
    return folder


def test_cli_exports_an_fp8_study_and_refuses_one_without_fp8(tmp_path, capsys):
    folder = study(tmp_path, Policy(rules=(Rule("fp8", patterns=("fc2",)),), default="bf16"))
    runs = str(tmp_path / "runs")
    assert main(["export", "--study", "s", "--format", "fp8", "--runs-dir", runs]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(Path(p).name for p in printed) == [
        "float8_accelerate.py",
        "float8_torchao.py",
        "float8_torchtitan.toml",
        "policy.yaml",
    ]
    model = load_task("digits-mlp").model()
    entries = torchtitan_settings(folder / "export-fp8" / "float8_torchtitan.toml")["filter_fqns"]
    assert torchtitan_converts(model, entries) == {"fc2"}

    Policy.uniform("bf16").save(folder / "best_policy.yaml")
    out = tmp_path / "none"
    code = main(
        ["export", "--study", "s", "--format", "fp8", "--runs-dir", runs, "--out", str(out)]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "does not apply" in err
    assert not out.exists()


# Module names hold no dots (torch refuses them), so the payloads call without one.
CALL = 'getattr(__import__("os"), "system")("touch PWNED")'
SLOW = pytest.mark.slow  # each converts a model and imports accelerate: a few seconds
HOSTILE = [
    pytest.param(f'x"""\n{CALL}\n"""', id="triple-double"),
    pytest.param(f"x'''\n{CALL}\n'''", id="triple-single", marks=SLOW),
    pytest.param("x $(touch PWNED) `touch PWNED` ; touch PWNED", id="shell"),
    pytest.param('x"]\n[evil]\nrun = "touch PWNED', id="toml", marks=SLOW),
]


@pytest.mark.parametrize("payload", HOSTILE)
def test_hostile_layer_and_policy_names_run_nothing(tmp_path, monkeypatch, payload):
    fp8_name, kept_name = payload + "-fp8", payload + "-kept"
    model = named_mlp([fp8_name, kept_name, "plain"])
    policy = Policy(
        rules=(Rule("fp8", patterns=(glob.escape(fp8_name), "plain")),),
        default="bf16",
        name=payload,
    )
    folder = tmp_path / "export"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)
        paths = export_policy(policy, "fp8", folder, model=model)
    files = {path.name: path for path in paths}
    monkeypatch.chdir(folder)  # where a payload's touch would leave its mark
    if importlib.util.find_spec("accelerate") is not None:
        runpy.run_path(str(files["float8_accelerate.py"]))
    snippet = runpy.run_path(str(files["float8_torchao.py"]))
    assert converted(snippet["convert"](named_mlp([fp8_name, kept_name, "plain"]))) == {
        fp8_name,
        "plain",
    }
    settings = tomllib.loads(files["float8_torchtitan.toml"].read_text())
    assert list(settings) == ["quantize"]  # nothing the names hold became a table or key
    entries = settings["quantize"]["linear"]["float8"]["filter_fqns"]
    assert torchtitan_converts(model, entries) == {fp8_name, "plain"}
    line = next(
        line
        for line in files["float8_torchtitan.toml"].read_text().splitlines()
        if line.startswith(COMMAND_LINE)
    )
    if "--quantize.linear.float8.filter_fqns=" in line:  # a printable name: quoted for bash
        assert command_line_filter(files["float8_torchtitan.toml"]) == entries
        subprocess.run(
            ["bash", "-c", f"printf '%s\\n' {line[len(COMMAND_LINE) :]}"],
            cwd=folder,
            check=True,
            capture_output=True,
        )
    assert not list(tmp_path.rglob("PWNED"))
