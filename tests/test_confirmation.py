"""The long confirmation (``--confirm-steps``) and schedule-aware trials
(``--trial-schedule``), issue 21 items 3 and 4.

The late-failure task here is planted: a layer whose activations grow with every step of
ordinary training (an uncapped margin loss, Adam's steady steps), so that fp16 holds for a
40-step trial and overflows before 200 steps, while fp32 trains on."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
import torch
from torch import nn

import autoprec
from autoprec.cli import main
from autoprec.devices import get_backend
from autoprec.errors import AutoprecError
from autoprec.policy import Policy
from autoprec.study._records import TrialRecord, record_of
from autoprec.study._studies import finished
from autoprec.study.confirm import CONFIRMATION_ROLE, KIND_TAG, confirmation_order
from autoprec.study.confirmation import Confirmation, ConfirmationCheck
from autoprec.study.summary import best_record
from autoprec.study.summary_schema import Summary
from autoprec.tracking import KEY_TAG, ROLE_TAG, load_best_policy, mlflow_client
from autoprec.trials.schedule import (
    CompressedScheduler,
    for_trials,
    learn_lr_shape,
    real_task,
    schedule_warning,
)
from autoprec.trials.training import Budget, TrialResult, run_trial
from tests.contract_tasks import make_tiny_task

TRIAL_STEPS = 40
CONFIRM_STEPS = 5 * TRIAL_STEPS
SPACE = """\
name: late
accuracy_tolerance: 0.02
dtypes: [fp32, fp16]
groups:
  - {name: grow, patterns: [grow]}
  - {name: head, patterns: [head]}
loss_scale:
  modes: [dynamic]
  init_scale_log2: [16, 16]
  growth_interval: [2000, 2000]
  hysteresis: [1, 1]
  growth_factor: [2.0]
  backoff_factor: [0.5]
  min_scale: [0.0]
"""


class Growing(nn.Module):
    """``grow`` on raw inputs in the hundreds; what follows sees its output scaled down."""

    def __init__(self) -> None:
        super().__init__()
        self.grow = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.grow(x)) / 1e4)


def margin_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean logit minus the right one: never saturates, so the weights keep growing."""
    right = outputs.gather(1, targets[:, None])[:, 0]
    return (outputs.mean(dim=1) - right).mean()


def late_failure_task(name: str = "late-planted") -> autoprec.Task:
    generator = torch.Generator().manual_seed(1)
    centers = torch.randn(4, 16, generator=generator) * 2.0
    labels = torch.randint(0, 4, (512,), generator=generator)
    inputs = (centers[labels] + torch.randn(512, 16, generator=generator)) * 100.0

    def train_data(seed: int):
        order_generator = torch.Generator().manual_seed(seed)
        while True:
            order = torch.randperm(384, generator=order_generator)
            for i in range(0, 384, 64):
                yield inputs[order[i : i + 64]], labels[order[i : i + 64]]

    return autoprec.Task(
        name,
        Growing,
        train_data,
        lambda: [(inputs[384:], labels[384:])],
        margin_loss,
        optimizer=lambda params: torch.optim.Adam(params, lr=0.1),
    )


def test_the_planted_task_fails_late_in_fp16_only():
    """The premise: uniform fp16 trains like fp32 for a trial, and not for 5x as long."""
    task, backend = late_failure_task(), get_backend("cpu")
    fp16 = Policy.uniform("fp16")
    short = run_trial(task, fp16, backend, Budget(steps=TRIAL_STEPS))
    long = run_trial(task, fp16, backend, Budget(steps=CONFIRM_STEPS))
    fp32 = run_trial(task, Policy.uniform("fp32"), backend, Budget(steps=CONFIRM_STEPS))
    assert short.state == "complete" and short.nonfinite_steps == 0
    assert long.nonfinite_steps > 0
    assert fp32.state == "complete" and fp32.nonfinite_steps == 0


@pytest.fixture(scope="module")
def confirmed_search(tmp_path_factory):
    """A search on the late-failure task that chooses uniform fp16 (least memory) from its
    40-step trials, confirmed at 200 steps."""
    folder = tmp_path_factory.mktemp("confirm")
    (folder / "late.yaml").write_text(SPACE)
    settings = dict(
        trials=3,
        steps=TRIAL_STEPS,
        confirm_steps=CONFIRM_STEPS,
        study="late",
        device="cpu",
        prefer="memory",
        sampler="random",
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        result = autoprec.search(late_failure_task(), folder / "late.yaml", **settings)
        again = autoprec.search(late_failure_task(), folder / "late.yaml", **settings)
    return folder, result, again


def _grow_dtype(entry_policy: dict) -> str:
    return Policy.from_dict(entry_policy).resolve(Growing(), "cpu")["grow"]


def test_the_confirmation_replaces_a_choice_that_fails_late(confirmed_search):
    """The short trials chose a policy that runs part of the model in fp16 (within the
    choice's memory tie, the one with the most headroom); it fails at 200 steps on a
    non-finite loss, which the result names, and the next candidate that holds keeps
    ``grow`` out of fp16, is confirmed and becomes the best."""
    folder, result, _ = confirmed_search
    summary = result.typed
    confirmation = summary.confirmation
    assert confirmation is not None and confirmation.steps == CONFIRM_STEPS
    first, *_ = confirmation.checks
    chosen = summary.entry(confirmation.chosen_before)
    assert (
        first.key == chosen.number
        and "fp16" in Policy.from_dict(chosen.policy).resolve(Growing(), "cpu").values()
    )
    assert not first.held and first.reason and "past the tolerance" not in first.reason
    for failed in confirmation.failed:
        assert failed.steps_run <= CONFIRM_STEPS and failed.reason
    held = confirmation.checks[-1]
    assert held.held and confirmation.held == held.key == summary.best.number
    assert len(confirmation.failed) == len(confirmation.checks) - 1
    assert _grow_dtype(summary.best.policy) != "fp16"
    assert next(r for r in summary.best.layers if r.name == "grow").dtype != "fp16"
    saved = autoprec.load_policy(folder / result.best_policy_path)
    assert saved.to_dict() == summary.best.policy
    assert any(line.startswith("confirmation at 200 steps:") for line in confirmation.lines())


def test_the_order_of_candidates_is_the_choices(confirmed_search):
    """Each candidate after the first is what the choice picks from those left."""
    _, result, _ = confirmed_search
    summary = result.typed
    keys = [c.key for c in summary.confirmation.checks]
    entries = [e for e in summary.trials if e.feasible]
    for position, key in enumerate(keys[1:], start=1):
        tried = {str(k) for k in keys[:position]}
        left = [e for e in entries if e.key not in tried]
        if left and key != "baseline":
            best = min(left, key=lambda e: (e.peak_memory_mb, summary.time_ms(e), -e.accuracy))
            assert best.key == str(key)


def test_confirmation_runs_are_tagged_children_and_best_is_the_confirmed(confirmed_search):
    folder, result, _ = confirmed_search
    uri = f"sqlite:///{folder}/runs/mlflow.db"
    client = mlflow_client(uri)
    experiment = client.get_experiment_by_name("late")
    runs = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`{ROLE_TAG}` = '{CONFIRMATION_ROLE}'"
    )
    parent = result.typed.mlflow_parent_run_id
    keys = {r.data.tags[KEY_TAG] for r in runs}
    trained = [c for c in result.typed.confirmation.checks if not c.is_baseline]
    assert keys == {f"confirm-{CONFIRM_STEPS}-baseline"} | {
        f"confirm-{CONFIRM_STEPS}-{c.key}" for c in trained
    }
    for run in runs:
        assert run.data.tags["mlflow.parentRunId"] == parent
        assert run.data.tags[KIND_TAG] == CONFIRMATION_ROLE
        assert run.data.metrics["steps_run"] <= CONFIRM_STEPS
    held = {r.data.tags["confirms"]: r.data.tags["held"] for r in runs}
    for check in trained:
        assert held[str(check.key)] == str(check.held).lower()
        assert check.mlflow_run_id is not None
    assert load_best_policy("late", uri).to_dict() == result.typed.best.policy


def test_a_continued_study_reuses_its_long_runs(confirmed_search):
    _, result, again = confirmed_search
    first, second = result.typed.confirmation, again.typed.confirmation
    assert second.fp32_reused and not first.fp32_reused
    assert all(c.reused for c in second.checks if not c.is_baseline)
    assert [(c.key, c.held, c.reason) for c in second.checks] == [
        (c.key, c.held, c.reason) for c in first.checks
    ]
    assert again.typed.best.number == result.typed.best.number


def test_the_summary_and_report_hold_the_confirmation(confirmed_search):
    folder, result, _ = confirmed_search
    data = result.summary
    assert Summary.from_json(data).confirmation == result.typed.confirmation
    assert main(["report", "--study", "late", "--runs-dir", str(folder / "runs")]) == 0
    page = (folder / "runs/late/report.html").read_text()
    assert f"Long confirmation: {CONFIRM_STEPS} steps" in page
    assert "non-finite" in page


def test_a_trial_length_confirmation_reuses_the_baseline(tmp_path, monkeypatch):
    """K equal to the trials' steps: fp32 is the study's own baseline, not trained again;
    a choice that holds is kept."""
    monkeypatch.chdir(tmp_path)
    result = autoprec.search(
        make_tiny_task(), trials=2, steps=12, confirm_steps=12, device="cpu", study="t"
    )
    confirmation = result.typed.confirmation
    assert confirmation.fp32_reused
    assert confirmation.held == result.typed.best.number == confirmation.chosen_before


# The optimizer's states held in fp32: --prefer memory would search them too, and this
# test is about the layers.
LATE_SPACE = (
    SPACE.replace("name: late", "name: late-overflow").replace(
        "{name: grow, patterns: [grow]}", "{name: body, patterns: [body]}"
    )
    + "optimizer_states:\n  groups:\n    - {name: all, patterns: ['*'], states: [fp32]}\n"
)


@pytest.mark.slow
def test_the_builtin_late_overflow_task_is_confirmed_at_five_times_the_trial(tmp_path, monkeypatch):
    """The built-in late-failure task: its 200-step trials choose uniform fp16 when the
    forecast only warns (by default the forecast already makes it infeasible,
    tests/test_forecast.py); at 1000 steps that fails, and the policy confirmed keeps the
    growing head out of fp16."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "late.yaml").write_text(LATE_SPACE)
    result = autoprec.search(
        "late-overflow",
        tmp_path / "late.yaml",
        trials=3,
        steps=200,
        confirm_steps=1000,
        forecast="warn",
        device="cpu",
        prefer="memory",
        sampler="random",
    )
    confirmation = result.typed.confirmation
    assert not confirmation.checks[0].held and "non-finite" in confirmation.checks[0].reason
    assert confirmation.held == result.typed.best.number
    head = next(r for r in result.typed.best.layers if r.name == "head")
    assert head.dtype != "fp16"


def _records() -> tuple[TrialRecord, list[TrialRecord]]:
    def record(number, time_ms, memory_mb, accuracy=0.9, feasible=True):
        result = TrialResult(
            "complete", accuracy=accuracy, step_time_ms=time_ms, peak_memory_mb=memory_mb
        )
        return TrialRecord(number, Policy.uniform("fp16"), result, 0.0, feasible)

    baseline = record("baseline", 10.0, 100.0)
    trials = [
        record(0, 5.0, 60.0),
        record(1, 4.0, 80.0),
        record(2, 3.0, 90.0, feasible=False),
        record(3, 12.0, 50.0),
    ]
    return baseline, trials


@pytest.mark.parametrize("prefer", ["speed", "memory", "balanced"])
def test_confirmation_order_follows_the_choice_and_ends_at_fp32(prefer):
    baseline, trials = _records()
    chosen = best_record(trials, baseline, prefer).number
    order = [r.number for r in confirmation_order(trials, baseline, prefer, chosen)]
    assert order[0] == chosen and order[-1] == "baseline" and 2 not in order
    for position in range(1, len(order)):  # each next is the choice among those left
        left = [t for t in trials if t.number not in order[:position]]
        assert best_record(left, baseline, prefer).number == order[position]


def test_config_refuses_a_short_or_serving_confirmation():
    with pytest.raises(AutoprecError, match="--confirm-steps"):
        autoprec.SearchConfig(steps=50, confirm_steps=20)
    with pytest.raises(AutoprecError, match="--confirm-steps"):
        autoprec.SearchConfig(mode="serving", confirm_steps=400)
    with pytest.raises(AutoprecError, match="--trial-schedule"):
        autoprec.SearchConfig(trial_schedule="squeezed")


def test_cli_refuses_a_bad_confirm_steps(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["search", "--steps", "50", "--confirm-steps", "10"]) == 2
    assert "--confirm-steps" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_confirmation_round_trips():
    check = ConfirmationCheck(3, "trial 3", False, "pruned", "overflow: non-finite loss", None)
    confirmation = Confirmation(400, [check], None, 0.9, reason="x")
    assert Confirmation.from_json(confirmation.to_json()) == confirmation
    assert "nothing confirmed (x)" in confirmation.lines()[0]


def test_a_summary_with_a_broken_confirmation_is_refused_in_one_line(confirmed_search, capsys):
    folder, _, _ = confirmed_search
    data = json.loads((folder / "runs/late/summary.json").read_text())
    data["confirmation"]["checks"][0]["held"] = "yes"
    broken = folder / "runs/broken"
    broken.mkdir()
    (broken / "summary.json").write_text(json.dumps(data))
    assert main(["report", "--study", "broken", "--runs-dir", str(folder / "runs")]) == 2
    assert "confirmation.checks[0].held" in capsys.readouterr().err


# -- schedule-aware trials -----------------------------------------------------------------


def _linear_warmup(optimizer, warmup=200, total=2000):
    from transformers import get_linear_schedule_with_warmup

    return get_linear_schedule_with_warmup(optimizer, warmup, total)


def _one_cycle(optimizer, total=2000):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, total_steps=total)


def _lrs_of(scheduler, optimizer, steps):
    """The learning rate (and SGD's momentum) each of ``steps`` steps trains with."""
    seen = []
    for _ in range(steps):
        group = optimizer.param_groups[0]
        seen.append((group["lr"], group.get("momentum"), group.get("betas")))
        optimizer.step()
        scheduler.step()
    return seen


@pytest.mark.parametrize("make", [_linear_warmup, _one_cycle])
@pytest.mark.parametrize("trial_steps", [200, 150])
def test_the_compressed_schedule_is_the_real_one_at_scaled_steps(make, trial_steps):
    """At trial step i the compressed schedule's learning rate (and OneCycleLR's momentum)
    is the real run's at step i * N // steps."""
    train_steps = 2000

    def optimizer():
        return torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.01, momentum=0.9)

    real_opt = optimizer()
    real = _lrs_of(make(real_opt), real_opt, train_steps)
    trial_opt = optimizer()
    compressed = CompressedScheduler(make(trial_opt), trial_steps, train_steps)
    trial = _lrs_of(compressed, trial_opt, trial_steps)
    assert trial == [real[i * train_steps // trial_steps] for i in range(trial_steps)]
    peak = max(lr for lr, _, _ in real)
    assert max(lr for lr, _, _ in trial) == pytest.approx(peak, rel=0.01)  # it is seen


def _warmup_task(warmup: int, total: int) -> autoprec.Task:
    task = make_tiny_task("warm")
    task.scheduler = lambda optimizer: _linear_warmup(optimizer, warmup, total)
    return task


def test_a_trial_inside_the_warmup_gets_one_warning_naming_the_share_seen():
    task = _warmup_task(warmup=400, total=2000)
    model = task.model()
    config = autoprec.SearchConfig(steps=100, device="cpu")  # N: 10x the trial's steps
    warning = schedule_warning(task, model, config)
    assert warning is not None and "25% of the warm-up" in warning
    assert "step 400 of the real run's 1000" in warning and "--trial-schedule compressed" in warning
    assert schedule_warning(task, model, autoprec.SearchConfig(steps=500)) is None
    compressed = autoprec.SearchConfig(steps=100, trial_schedule="compressed")
    assert schedule_warning(task, model, compressed) is None
    assert schedule_warning(make_tiny_task(), model, config) is None  # no scheduler


def test_a_search_warns_once_and_compressed_trials_run_the_real_shape(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    said: list[str] = []

    class Warnings(autoprec.Callbacks):
        def warning(self, message: str) -> None:
            said.append(message)

    task = _warmup_task(warmup=100, total=200)
    autoprec.search(task, trials=1, steps=10, device="cpu", study="w", callbacks=Warnings())
    assert len([w for w in said if "warm-up" in w]) == 1
    assert "10% of the warm-up" in said[0]

    config = autoprec.SearchConfig(steps=10, trial_schedule="compressed")
    trial_task = for_trials(task, task.model(), config)
    optimizer = trial_task.make_optimizer(task.model().parameters())
    scheduler = trial_task.make_scheduler(optimizer)
    assert isinstance(scheduler, CompressedScheduler) and scheduler.train_steps == 100
    assert real_task(trial_task).scheduler is task.scheduler
    shape = learn_lr_shape(task, task.model(), 100)
    assert shape.peak_step == 100 and shape.warmup_seen(10) == pytest.approx(0.1)
    result = autoprec.search(
        task, trials=1, steps=10, device="cpu", study="c", trial_schedule="compressed"
    )
    assert result.typed.settings.values["trial_schedule"] == "compressed"
    assert result.typed.settings.values["train_steps"] == 100


def test_cli_takes_both_flags(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    task = f"{Path(__file__).with_name('contract_tasks.py')}:make_tiny_task"
    argv = ["search", "--task", task, "--steps", "12", "--trials", "1", "--device", "cpu"]
    argv += ["--no-progress", "--sampler", "random"]
    argv += ["--confirm-steps", "24", "--trial-schedule", "compressed"]
    assert main(argv) == 0
    assert "confirmation at 24 steps:" in capsys.readouterr().out


# -- what the telemetry saw first, and bf16 before fp32 (issue 27 item 3) ------------------

UNDERFLOW_STEPS = 40
UNDERFLOW_CONFIRM = 5 * UNDERFLOW_STEPS
UNDERFLOW_SPACE = """\
name: underflow
accuracy_tolerance: 0.02
dtypes: [fp16, bf16]
groups:
  - {name: body, patterns: [embed, mix, head]}
loss_scale:
  modes: [none]
"""


@pytest.mark.slow
def test_a_late_underflow_is_named_as_a_flush_of_the_layer_that_flushed():
    """The premise and the reason: uniform fp16 (no loss scaling) trains like fp32 for a
    40-step trial and stops before 200 steps on a non-finite loss. What the telemetry saw
    first is the kernel's values flushing to zero, not the head whose output went
    non-finite after the division; bf16 and fp32 train the 200 steps."""
    from autoprec.precision.loss_scale import LossScale
    from tests.underflow_task import underflow_task

    task, backend = underflow_task(), get_backend("cpu")
    fp16 = Policy.uniform("fp16", LossScale())
    short = run_trial(task, fp16, backend, Budget(steps=UNDERFLOW_STEPS))
    assert short.state == "complete" and short.nonfinite_steps == 0
    long = run_trial(task, fp16, backend, Budget(steps=UNDERFLOW_CONFIRM))
    assert long.state == "pruned" and UNDERFLOW_STEPS < long.steps_run < UNDERFLOW_CONFIRM
    assert long.reason.startswith("underflow: flush to zero in kernel (fp16)"), long.reason
    assert "non-finite loss" in long.reason
    assert long.first_events[0]["mechanism"] == "flush to zero"
    assert long.first_events[0]["layer"] == "kernel"
    for dtype in ("bf16", "fp32"):
        held = run_trial(task, Policy.uniform(dtype), backend, Budget(steps=UNDERFLOW_CONFIRM))
        assert held.state == "complete" and held.nonfinite_steps == 0, dtype


@pytest.fixture(scope="module")
def underflow_search(tmp_path_factory):
    """The underflow task searched under --prefer memory from 40-step trials (uniform
    fp16 and uniform bf16 tie on memory), confirmed at 200 steps."""
    from tests.underflow_task import underflow_task

    folder = tmp_path_factory.mktemp("underflow")
    (folder / "underflow.yaml").write_text(UNDERFLOW_SPACE)
    settings = dict(
        trials=2,
        steps=UNDERFLOW_STEPS,
        confirm_steps=UNDERFLOW_CONFIRM,
        study="underflow",
        device="cpu",
        prefer="memory",
        sampler="random",
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        result = autoprec.search(underflow_task(), folder / "underflow.yaml", **settings)
    return folder, result


@pytest.mark.slow
def test_a_tie_on_memory_goes_to_bf16_which_holds_at_the_real_length(underflow_search):
    """The tie rule chooses uniform bf16 (the headroom) over uniform fp16, which would
    fail at 200 steps; the confirmation holds it, and fp32 is not the answer."""
    _, result = underflow_search
    summary = result.typed
    confirmation = summary.confirmation
    assert summary.best.params["dtype.body"] == "bf16"
    assert confirmation.held == summary.best.number != "baseline"
    assert confirmation.checks[-1].held and not confirmation.failed


@pytest.mark.slow
def test_after_a_failed_fp16_candidate_bf16_is_confirmed_before_fp32(underflow_search):
    """The choice the issue's other run made (uniform fp16, timing noise breaking the
    tie): its long run fails, the reason names the kernel's flush, and the next in the
    choice's order, uniform bf16, holds; fp32 is never reached."""
    from autoprec.study._records import TrialRecord, result_of
    from autoprec.study.confirm import first_seen
    from autoprec.trials.base import Feasibility
    from tests.underflow_task import underflow_task

    folder, result = underflow_search
    summary = result.typed
    fp16 = next(e for e in summary.trials if e.params["dtype.body"] == "fp16")
    study = optuna.load_study(study_name="underflow", storage=f"sqlite:///{folder}/runs/optuna.db")
    feasibility = Feasibility(summary.accuracy_tolerance)
    records = [record_of(t, feasibility, TrialResult) for t in finished(study)]
    baseline_result = result_of(study.user_attrs["baseline"]["result"], TrialResult)
    baseline = TrialRecord("baseline", Policy.uniform("fp32"), baseline_result, 0.0, True)
    order = confirmation_order(records, baseline, "memory", fp16.number)
    assert next(r.number for r in order) == fp16.number
    assert order[1].policy.to_dict() == summary.best.policy  # uniform bf16
    assert order[-1].number == "baseline"
    # Each in turn at the real length, as the confirmation trains them.
    task, backend = underflow_task(), get_backend("cpu")
    budget = Budget(steps=UNDERFLOW_CONFIRM)
    fp32 = run_trial(task, baseline.policy, backend, budget)
    failed = run_trial(task, order[0].policy, backend, budget)
    first = first_seen(failed, fp32)
    assert first is not None and (first.mechanism, first.layer) == ("flush to zero", "kernel")
    assert failed.reason.startswith("underflow: flush to zero in kernel")
    held = next(c for c in summary.confirmation.checks if c.held)
    assert held.key == order[1].number  # the search's own confirmation held it


# -- Ctrl-C during the long confirmation (issue 28) ----------------------------------------


@pytest.mark.slow
def test_ctrl_c_during_the_confirmation_exits_130_promptly_with_a_consistent_summary(tmp_path):
    """As a user meets it: ``autoprec search --confirm-steps`` in a terminal, Ctrl-C (a
    SIGINT to the process group) while a long run trains. The command says it was
    interrupted, exits 130 within the 120 s the issue allowed, and what it wrote agrees:
    summary.json's best is best_policy.yaml, the short trials' choice, its confirmation
    marked interrupted (``autoprec best`` reads finished searches only)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    task = f"{Path(__file__).with_name('contract_tasks.py')}:make_tiny_task"
    command = [sys.executable, "-m", "autoprec.cli", "search", "--task", task]
    command += ["--steps", "12", "--trials", "2", "--device", "cpu", "--sampler", "random"]
    command += ["--confirm-steps", "1000000", "--study", "cc", "--no-progress"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    err_path = tmp_path / "stderr.txt"
    with err_path.open("w") as err:
        process = subprocess.Popen(
            command,
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,  # its own process group, as a terminal's foreground job
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            deadline = time.monotonic() + 540
            while "confirming" not in err_path.read_text() and time.monotonic() < deadline:
                assert process.poll() is None, err_path.read_text()[-2000:]
                time.sleep(0.5)
            assert "confirming" in err_path.read_text()
            time.sleep(2)  # inside the long run
            os.killpg(process.pid, signal.SIGINT)
            interrupted_at = time.monotonic()
            _out, _ = process.communicate(timeout=120)
            exited_s = time.monotonic() - interrupted_at
            print(f"exited {exited_s:.1f} s after the SIGINT")
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    stderr = err_path.read_text()
    assert process.returncode == 130, stderr[-2000:]
    assert exited_s < 120
    assert "interrupted (Ctrl-C) during the confirmation" in stderr
    assert "autoprec search: interrupted; results so far in runs/cc/summary.json" in stderr
    data = json.loads((tmp_path / "runs/cc/summary.json").read_text())
    summary = Summary.from_json(data)
    assert summary.interrupted and summary.confirmation.interrupted
    assert summary.confirmation.held is None
    assert summary.best.number == summary.confirmation.chosen_before
    saved = autoprec.load_policy(tmp_path / "runs/cc/best_policy.yaml")
    assert saved.to_dict() == summary.best.policy
