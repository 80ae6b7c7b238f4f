"""Compiled trials (``--compile``): a trial trains under torch.compile whatever its policy,
with the same losses as eager, its graph breaks counted and its compile time kept apart
from its step time; every trial records the device's compute capability; and figures
measured with ``--emulate fp8`` say so in the console table, summary.json and the report.

Compiling on the CPU is slow (about 20 s for the first small model in a process), so the
tests that compile use the tiniest model and budget and are marked slow.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from torch import nn
from torch.nn import functional as F

import autoprec
from autoprec import Policy, Rule
from autoprec.cli import _build_parser, main
from autoprec.devices import get_backend
from autoprec.errors import AutoprecError, TaskError
from autoprec.policy import Quantization
from autoprec.precision.emulation import emulated_label
from autoprec.report import render_report
from autoprec.study import SearchConfig
from autoprec.study.summary_schema import Summary
from autoprec.trials.compiled import Compilation
from autoprec.trials.training import (
    Budget,
    TrainingTrials,
    run_trial,
    time_policies_side_by_side,
)
from tests.cpu_fp8 import trains_fp8

HERE = Path(__file__).resolve()
BUDGET = Budget(steps=6, warmup_steps=2)
CPU = get_backend("cpu")
EMULATED = get_backend("cpu", emulate="fp8")
MIXED = Policy(rules=(Rule("fp32", patterns=("head",), name="head"),), default="bf16")
# A bf16 island in fp32: its outputs are cast up by a forward hook kept last.
ISLAND = Policy(rules=(Rule("bf16", patterns=("fc1",), name="fc1"),), default="fp32")
FP16_SCALED = Policy.from_dict(
    {
        "default": "fp16",
        "rules": [{"name": "head", "patterns": ["head"], "dtype": "fp32"}],
        "loss_scale": {"mode": "dynamic", "init_scale": 1024},
    }
)
FP8 = Policy(
    rules=(Rule("fp8", patterns=("fc1",), name="fc1"),),
    default="bf16",
    quantization=Quantization(fp8="tensorwise"),
)
SPACE = {
    "name": "tiny-compiled",
    "accuracy_tolerance": 1.0,
    "dtypes": ["fp32", "bf16"],
    "groups": [{"name": "fc1", "patterns": ["fc1"]}, {"name": "head", "patterns": ["head"]}],
}


class Printing(nn.Module):
    """Prints in its forward: a graph break Dynamo cannot trace through."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print("", end="")
        return x


def blobs_task(name: str = "blobs", broken: bool = False, compile: bool = False) -> autoprec.Task:
    """Four Gaussian blobs in 32 dimensions and a 2-layer MLP whose Linear dimensions are
    multiples of 16 (fp8's); ``broken`` puts a graph break between the layers."""
    generator = torch.Generator().manual_seed(1)
    centers = torch.randn(4, 32, generator=generator) * 2.0
    labels = torch.randint(0, 4, (256,), generator=generator)
    inputs = centers[labels] + torch.randn(256, 32, generator=generator)

    def model() -> nn.Module:
        layers = OrderedDict(fc1=nn.Linear(32, 32), act=nn.ReLU())
        if broken:
            layers["show"] = Printing()
        layers["head"] = nn.Linear(32, 16)
        return nn.Sequential(layers)

    def train_data(seed: int):
        order = torch.Generator().manual_seed(seed)
        while True:
            shuffled = torch.randperm(192, generator=order)
            for start in range(0, 192, 32):
                index = shuffled[start : start + 32]
                yield inputs[index], labels[index]

    def val_data():
        return [(inputs[192:], labels[192:])]

    return autoprec.Task(name, model, train_data, val_data, F.cross_entropy, compile=compile)


def compiled_blobs() -> autoprec.Task:
    """The task as the command line names it (``tests/test_compiled.py:compiled_blobs``)."""
    return blobs_task("compiled-blobs")


def fp8_blobs() -> autoprec.Task:
    return blobs_task("fp8-blobs")


# -- asking for it ------------------------------------------------------------------------


def test_compile_is_an_option_of_search_with_a_useful_help_line():
    parser = _build_parser()
    assert parser.parse_args(["search", "--compile"]).compile is True
    assert parser.parse_args(["search"]).compile is False
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    search = commands.choices["search"]
    (option,) = (a for a in search._actions if "--compile" in a.option_strings)
    assert "torch.compile" in option.help and "graph breaks" in option.help
    assert "compile time" in option.help and "step time" in option.help
    assert "--compile" in search.format_help()


def test_a_task_or_the_config_asks_for_compiled_trials():
    task = blobs_task()
    model = task.model()
    eager = TrainingTrials.of(SearchConfig(), task, model, CPU, BUDGET)
    assert not eager.compiled and eager.settings["compile"] is False  # part of the study
    by_config = TrainingTrials.of(SearchConfig(compile=True), task, model, CPU, BUDGET)
    by_task = TrainingTrials.of(SearchConfig(), blobs_task(compile=True), model, CPU, BUDGET)
    for trials in (by_config, by_task):
        assert trials.compiled and trials.settings["compile"] is True
        assert trials.judged_against(trials.failed("x"), True).compiled is True


def test_compile_refuses_what_it_cannot_do():
    with pytest.raises(AutoprecError, match="--compile: only with --mode training"):
        SearchConfig(compile=True, mode="serving")
    with pytest.raises(AutoprecError, match="--compile: expected True or False"):
        SearchConfig(compile="yes")
    with pytest.raises(TaskError, match="compile must be True or False"):
        blobs_task(compile="yes")


# -- the device's compute capability ------------------------------------------------------


def test_each_trial_records_the_device_compute_capability():
    result = run_trial(blobs_task(), MIXED, CPU, BUDGET)
    assert result.state == "complete" and not result.compiled
    assert result.compute_capability == CPU.compute_capability() == "none"
    assert result.run_params()["compute_capability"] == "none"
    assert result.entry_fields()["execution"]["compute_capability"] == "none"
    assert not {"graph_breaks", "compile_s"} & set(result.extra_metrics())  # eager: none
    again = type(result).from_dict(result.to_dict())  # as the study stores it
    assert again.compute_capability == "none"
    failed = TrainingTrials(
        task=blobs_task(), model=nn.Linear(2, 2), backend=CPU, budget=BUDGET
    ).failed("TrialTimeout")
    assert failed.run_params().keys() == result.run_params().keys()  # same MLflow params


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_records_its_capability_as_major_dot_minor():
    major, minor = torch.cuda.get_device_capability(0)
    assert get_backend("cuda").compute_capability() == f"{major}.{minor}"


# -- emulated figures are labelled ----------------------------------------------------------


@trains_fp8
def test_an_emulated_fp8_trial_says_so_and_the_label_has_one_wording():
    result = run_trial(blobs_task(), FP8, EMULATED, BUDGET)
    assert result.state == "complete", result.reason
    assert result.emulated == ["fp8"] and result.run_params()["emulated"] == "fp8"
    assert result.entry_fields()["execution"]["emulated"] == ["fp8"]
    # A policy without fp8 on the same device ran nothing emulated.
    assert run_trial(blobs_task(), MIXED, EMULATED, BUDGET).emulated == []
    label = emulated_label(["fp8"])
    assert label is not None and "emulated (CPU fp8)" in label and "not the device's" in label
    assert emulated_label([]) is None


@trains_fp8
@pytest.mark.slow
def test_an_emulated_search_labels_the_table_the_summary_and_the_report(in_tmp, capsys):
    space = in_tmp / "fp8-space.yaml"
    space.write_text(yaml.safe_dump({**SPACE, "dtypes": ["bf16", "fp8"]}))
    args = ["search", "--task", f"{HERE}:fp8_blobs", "--space", str(space), "--device", "cpu"]
    args += ["--emulate", "fp8", "--trials", "2", "--steps", "6", "--sampler", "random"]
    assert main([*args, "--confirm-top", "0", "--no-progress"]) == 0
    label = emulated_label(["fp8"])
    assert label in capsys.readouterr().out  # the console table's note
    summary = Summary.from_json(json.loads((in_tmp / "runs/fp8-blobs/summary.json").read_text()))
    assert summary.settings.emulated == ["fp8"]
    fp8_rows = [e for e in summary.trials if "fp8" in e.params.values()]
    assert fp8_rows and all(e.emulated == ["fp8"] for e in fp8_rows)
    assert summary.baseline.emulated == []  # fp32 ran on the CPU for real
    render_report(summary, in_tmp / "report")
    page = (in_tmp / "report" / "report.html").read_text()
    assert label.replace("'", "&#x27;") in page


# -- compiled trials --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy", [MIXED, ISLAND, FP16_SCALED, FP8], ids=["bf16-fp32", "island", "fp16", "fp8"]
)
def test_a_compiled_trial_trains_as_the_eager_one(policy):
    """Regions, their casts and hooks, the loss scaler and fp8 layers compile; the losses
    are the eager trial's within rounding (compiled kernels reorder float sums)."""
    eager = run_trial(blobs_task(), policy, EMULATED, BUDGET)
    compiled = run_trial(blobs_task(), policy, EMULATED, BUDGET, compiled=True)
    assert eager.state == compiled.state == "complete", compiled.reason
    assert all(torch.isfinite(torch.tensor(compiled.losses)))
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-2)
    assert compiled.accuracy == pytest.approx(eager.accuracy, abs=0.05)
    assert compiled.compiled and compiled.graph_breaks == 0
    assert isinstance(compiled.graph_breaks, int)
    # Compile time is apart: the steps that compiled are not in the step time.
    assert compiled.compile_s is not None and compiled.compile_s > 0
    assert compiled.step_time_ms is not None and compiled.step_time_ms < compiled.compile_s * 1e3
    execution = compiled.entry_fields()["execution"]
    assert execution["compiled"] is True and execution["compile_s"] == compiled.compile_s
    assert {"graph_breaks", "compile_s"} <= set(compiled.extra_metrics())


@pytest.mark.slow
def test_a_graph_break_in_the_model_is_counted():
    result = run_trial(blobs_task(broken=True), MIXED, CPU, BUDGET, compiled=True)
    assert result.state == "complete", result.reason
    assert isinstance(result.graph_breaks, int) and result.graph_breaks > 0
    assert result.compile_s is not None and result.compile_s > 0


@pytest.mark.slow
def test_a_compilation_reports_the_reason_of_a_break():
    model = nn.Sequential(nn.Linear(16, 16), Printing())
    compilation = Compilation(model, True, lambda: 0.0)
    with compilation.step() as watch:
        compilation.forward_model()(torch.randn(2, 16)).sum().backward()
    assert watch.compiled
    report = compilation.report()
    assert report is not None and report.graph_breaks >= 1 and report.compiling_steps == 1
    assert any("print" in reason or "builtin" in reason for reason in report.break_reasons)
    with compilation.step() as again:  # compiled already: nothing compiles again
        compilation.forward_model()(torch.randn(2, 16)).sum().backward()
    assert not again.compiled
    assert Compilation(model, False, lambda: 0.0).report() is None


@pytest.mark.slow
def test_the_side_by_side_timing_of_a_compiled_search_runs_compiled():
    frames = torch._dynamo.utils.counters["frames"]
    before = frames["total"]
    times_ms = time_policies_side_by_side(
        blobs_task(), [Policy.uniform("fp32"), MIXED], CPU, BUDGET, rounds=1
    )
    assert frames["total"] == before  # eager: nothing compiled
    compiled_ms = time_policies_side_by_side(
        blobs_task(), [Policy.uniform("fp32"), MIXED], CPU, BUDGET, rounds=1, compiled=True
    )
    assert frames["total"] > before  # each candidate compiled in its warm-up
    assert len(times_ms) == len(compiled_ms) == 2 and all(ms > 0 for ms in compiled_ms)


@pytest.mark.slow
def test_a_compiled_search_records_breaks_compile_time_and_capability(in_tmp):
    space = in_tmp / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    args = ["search", "--task", f"{HERE}:compiled_blobs", "--space", str(space)]
    args += ["--device", "cpu", "--compile", "--trials", "2", "--steps", "6"]
    assert main([*args, "--sampler", "random", "--confirm-top", "1", "--no-progress"]) == 0
    data = json.loads((in_tmp / "runs/compiled-blobs/summary.json").read_text())
    summary = Summary.from_json(data)
    assert summary.settings.values["compile"] is True
    assert summary.step_times_confirmed  # re-timed side by side, compiled
    for entry in summary.entries:
        execution = entry.execution
        assert execution["compute_capability"] == "none" and execution["compiled"] is True
        assert isinstance(execution["graph_breaks"], int) and execution["graph_breaks"] >= 0
        assert execution["compile_s"] > 0
    client = MlflowClient(f"sqlite:///{in_tmp}/runs/mlflow.db")
    experiment = client.get_experiment_by_name("compiled-blobs")
    children = [
        r
        for r in client.search_runs([experiment.experiment_id])
        if r.data.tags.get("mlflow.parentRunId")
    ]
    assert len(children) == 3  # the baseline and two trials
    for child in children:
        assert child.data.params["compute_capability"] == "none"
        assert child.data.params["compiled"] == "true"
        assert child.data.metrics["graph_breaks"] >= 0 and child.data.metrics["compile_s"] > 0


def test_a_compiled_task_launched_as_ranks_records_the_eager_trials_it_runs(tiny_task):
    """Trials launched as several ranks run eager: a task asking for compiled trials
    records ``compile: False`` there (its settings, its failed results), as it did when
    launched trials were their own class."""
    task = dataclasses.replace(tiny_task, compile=True)
    budget = Budget(steps=3)
    backend = get_backend("cpu")
    one = TrainingTrials.of(SearchConfig(), task, task.model(), backend, budget)
    ranks = TrainingTrials.of(SearchConfig(nproc_per_trial=2), task, task.model(), backend, budget)
    assert one.settings["compile"] is True and ranks.settings["compile"] is False
    assert ranks.failed("why").compiled is False
