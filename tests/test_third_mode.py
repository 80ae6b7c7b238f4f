"""A third mode of search is one new module: a `Trials` class (here a trivial one that
scores a policy by how much of the model it sends below fp32, and trains nothing) and a
`Mode` naming it, registered in `autoprec.trials.MODES`. The search loop, the session,
the records and the tracker run it unchanged, and what it leaves behind is written; its
studies are reported (in the base mode's view, its time named as its results name it),
exported and compared as the CLI does it. Where it names what a rank runs
(`Mode.rank_trial`), its trials are launched as ranks too."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import mlflow
import pytest

import autoprec
import autoprec.trials
from autoprec.cli import main
from autoprec.devices import get_backend
from autoprec.distributed.launch import LaunchPlan, settle_parallel
from autoprec.errors import AutoprecError
from autoprec.policy import Policy, load_policy
from autoprec.report import front_table
from autoprec.study._summary_file import read_summary
from autoprec.trials import Mode
from autoprec.trials.base import Choice, Feasibility, Measured, TrialState
from autoprec.trials.launched import LaunchedTrials

REPO = Path(__file__).resolve().parents[1]


@dataclass
class CountedResult(Measured):
    """What a counting trial found: its "time" falls with the share of low-precision layers."""

    state: TrialState
    reason: str | None = None
    accuracy: float | None = None
    peak_memory_mb: float | None = None
    peak_memory_is_estimate: bool = True
    counted_time_ms: float | None = None
    low_share: float = 0.0
    run_time_s: float = 0.0

    METRICS = ("accuracy", "peak_memory_mb", "counted_time_ms", "low_share")
    TIME_METRIC = "counted_time_ms"
    TIME_LABEL = "count"
    MODE = "counting"


class CountingTrials:
    """Trials that count: a policy's time and memory fall with its share of leaves below
    fp32, its accuracy stays fp32's."""

    mode: ClassVar[str] = "counting"
    objectives: ClassVar[tuple[str, str, str]] = ("accuracy", "peak_memory_mb", "counted_time_ms")
    result_type: ClassVar[type] = CountedResult
    baseline_verb: ClassVar[str] = "count"

    def __init__(self, task, model, backend, study: str | None = None) -> None:
        self.task, self.model, self.backend, self.study = task, model, backend, study

    @classmethod
    def of(cls, config, task, model, backend, budget) -> CountingTrials:
        return cls(task, model, backend, config.study)

    @property
    def settings(self) -> dict[str, Any]:
        return {"mode": self.mode}

    def fit(self, space, profile):
        return space.fit(self.model, profile, self.backend)

    def choice(self, space) -> Choice:
        return Choice(Feasibility(0.0), "speed", self.study or f"{self.task.name}-counted")

    def load(self, out_dir: Path, may_train: bool, on_training) -> None:
        pass

    def profile(self, seed: int):
        from autoprec.profile.sensitivity import profile_task

        return profile_task(self.task, self.backend, seed=seed, steps=0, model=self.model)

    def warm_up(self, space, limit_s: float) -> None:
        pass

    def judged_against(self, baseline, early_stopping: bool) -> CountingTrials:
        return self

    def measure(self, policy: Policy) -> CountedResult:
        dtypes = list(policy.resolve(self.model, self.backend).values())
        share = sum(d != "fp32" for d in dtypes) / len(dtypes)
        return CountedResult(
            TrialState.COMPLETE,
            accuracy=0.5,
            peak_memory_mb=100.0 * (1 - share / 2),
            counted_time_ms=10.0 * (1 - share / 2),
            low_share=share,
        )

    def failed(self, reason: str) -> CountedResult:
        return CountedResult(TrialState.FAILED, reason)

    def retime(self, policies: list[Policy]) -> list[float]:
        return [self.measure(p).counted_time_ms for p in policies]

    def layer_table(self, policy: Policy, model) -> list[dict[str, Any]]:
        return []

    def summary_settings(self) -> dict[str, Any]:
        return {"checkpoint": None}

    def summary_part(self, feasibility) -> dict[str, Any] | None:
        return None  # the summary has no part of this mode's own

    def leave_behind(self, policy, out_dir: Path, task_spec, publish) -> dict[str, Any] | None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "counted.txt").write_text(policy.to_yaml())
        return None


class Counting(Mode):
    """The counting mode: its name and its trials; everything else the base's defaults."""

    name = "counting"
    trials = f"{__name__}:CountingTrials"


@pytest.fixture
def counting(monkeypatch):
    """The counting mode registered, as its module would register it."""
    monkeypatch.setitem(autoprec.trials.MODES, "counting", Counting())


def test_a_third_mode_is_one_module(in_tmp, tiny_task, counting):
    result = autoprec.search(
        tiny_task, mode="counting", trials=3, device="cpu", sampler="random", confirm_top=2
    )
    summary = result.summary
    assert summary["mode"] == "counting" and summary["study"] == "tiny-counted"
    assert len(summary["trials"]) == 3
    left = in_tmp / "runs" / "tiny-counted" / "counted.txt"
    assert left.read_text() == result.best_policy.to_yaml()
    measured = [summary["baseline"], *summary["trials"]]
    assert all(e["state"] == "complete" and "counted_time_ms" in e["metrics"] for e in measured)
    best = summary["best"]
    fastest = min(e["metrics"]["counted_time_ms"] for e in measured)
    assert best["metrics"]["counted_time_ms"] == fastest
    assert summary["baseline"]["metrics"]["low_share"] == 0.0
    client = mlflow.MlflowClient(f"sqlite:///{in_tmp / 'runs' / 'mlflow.db'}")
    run = client.get_run(best["mlflow_run_id"])
    assert run.data.metrics["counted_time_ms"] == fastest


def count_on_ranks(spec: dict[str, Any]) -> tuple[CountedResult, dict[str, Any]]:
    """The counting mode's rank trial: every rank counts itself; the time is how many did."""
    import torch
    import torch.distributed as dist

    ranks = torch.ones(1)
    dist.all_reduce(ranks)
    counted = CountedResult(TrialState.COMPLETE, accuracy=0.5, counted_time_ms=float(ranks))
    return counted, {"nproc": dist.get_world_size(), "policy": spec["policy"]["default"]}


class LaunchedCounting(Counting):
    """The counting mode, launchable: it names what each rank runs."""

    rank_trial = f"{__name__}:count_on_ranks"


def test_a_third_mode_is_launched_as_ranks_where_it_names_its_rank_trial(
    tmp_path, tiny_task, monkeypatch
):
    monkeypatch.setitem(autoprec.trials.MODES, "counting", Counting())
    with pytest.raises(AutoprecError, match=r"--nproc-per-trial 2: only with --mode training$"):
        settle_parallel(2, None, "counting", None, None)
    monkeypatch.setitem(autoprec.trials.MODES, "counting", LaunchedCounting())
    assert settle_parallel(2, None, "counting", None, None) == "ddp"
    plan = LaunchPlan(
        nproc=2,
        parallel="ddp",
        backend="gloo",
        group=["cpu", "cpu"],
        task_spec="unused",
        folder=tmp_path / "launches",
        limit_s=300.0,
        env={"PYTHONPATH": str(REPO)},  # the ranks import this module
        rank_trial=LaunchedCounting.rank_trial,
    )
    inner = CountingTrials(tiny_task, tiny_task.model(), get_backend("cpu"))
    trials = LaunchedTrials(inner, plan)
    result = trials.measure(Policy.uniform("bf16"))
    assert isinstance(result, CountedResult), result
    assert result.state == TrialState.COMPLETE and result.counted_time_ms == 2.0, result.reason
    assert not plan.folder.exists() or not any(plan.folder.iterdir())  # a launch that ran
    # Everything but the measurement is the wrapped trials'.
    assert (trials.mode, trials.result_type) == ("counting", CountedResult)
    assert trials.choice(None).study == "tiny-counted"
    assert trials.settings == {"mode": "counting", "backend": "gloo"}


def test_a_third_modes_studies_are_reported_exported_and_compared(
    in_tmp, tiny_task, counting, capsys
):
    for seed, study in ((0, None), (1, "tiny-counted-again")):
        autoprec.search(
            tiny_task,
            mode="counting",
            trials=2,
            seed=seed,
            study=study,
            device="cpu",
            sampler="random",
            confirm_top=0,
        )
    runs = in_tmp / "runs"
    capsys.readouterr()

    assert main(["report", "--study", "tiny-counted", "--runs-dir", str(runs)]) == 0
    written = [Path(line) for line in capsys.readouterr().out.split()]
    assert [p.name for p in written[:2]] == ["report.html", "front_counted_time.png"]
    page = written[0].read_text()
    assert "autoprec report: tiny-counted" in page
    summary = read_summary(runs / "tiny-counted" / "summary.json", "tiny-counted")
    assert summary.time_metric == "counted_time_ms"
    # The time is the counting results' own, named as they name it ("count").
    assert "<th>count ms</th>" in page and "their count times are those re-timings" in page
    for entry in summary.entries:
        assert f"<td>{entry.metrics['counted_time_ms']:.3f}</td>" in page
    assert front_table(summary).splitlines()[0].split()[3:5] == ["count", "ms"]

    exported = ["export", "--study", "tiny-counted", "--format", "yaml"]
    assert main([*exported, "--runs-dir", str(runs)]) == 0
    policy_file = next(p for p in map(Path, capsys.readouterr().out.split()) if p.suffix == ".yaml")
    best = load_policy(runs / "tiny-counted" / "best_policy.yaml")
    assert load_policy(policy_file).to_dict() == best.to_dict() == summary.best.policy

    studies = ["--study", "tiny-counted", "--study", "tiny-counted-again"]
    assert main(["compare", *studies, "--runs-dir", str(runs)]) == 0
    compared = Path(capsys.readouterr().out.strip()).read_text()
    assert "autoprec comparison: tiny-counted, tiny-counted-again" in compared
    assert "<th>count time ms</th>" in compared
    for study in ("tiny-counted", "tiny-counted-again"):
        assert f"<td>{study}</td>" in compared


def test_a_mode_writes_only_what_differs():
    """The base gives a default for everything but a mode's name and its trials (the
    issue's bound: at most 5 required members), and one registry holds every mode."""
    required = [name for name in Mode.__annotations__ if not hasattr(Mode, name)]
    assert required == ["name", "trials"]
    counting = Counting()
    assert (counting.settings, counting.trains, counting.export_formats) == (None, False, ("yaml",))
    assert set(autoprec.trials.MODES) == {"training", "serving"}
    assert autoprec.trials.mode_named("inference") is autoprec.trials.MODES["serving"]
    for mode in autoprec.trials.MODES.values():  # one name, as the trials and results say it
        trials = mode.trials_class()
        assert trials.mode == trials.result_type.MODE == mode.name
