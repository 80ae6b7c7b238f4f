"""``autoprec search --guard``: the search answers with the chosen policy plus the guard's
settings, and leaves to the user's guarded run what it would otherwise have trained longer
or confirmed (issue "From the search").

Real searches with small budgets on zoo tasks, ``--prefer memory`` so that low precision
wins on a CPU: zoo-attention-logit-growth at 100 steps, whose fp16 trials the forecast
cannot tell (unguarded, they are extended); zoo-my-task, healthy; zoo-exp-growth, fragile."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

import autoprec
from autoprec.cli import main
from autoprec.guard.precision import GuardedPrecision
from autoprec.tasks import load_task

SMALL = ["--device", "cpu", "--no-progress", "--prefer", "memory"]
ATTENTION = ["--task", "zoo-attention-logit-growth", "--trials", "3", "--steps", "100", *SMALL]


def _search(folder: Path, study: str, *argv: str) -> tuple[int, str, str]:
    """``autoprec search`` with its stores and outputs in ``folder``: exit status, stdout,
    stderr."""
    stores = [
        "--storage",
        f"sqlite:///{folder}/optuna.db",
        "--tracking-uri",
        f"sqlite:///{folder}/mlflow.db",
        "--runs-dir",
        str(folder / "runs"),
        "--study",
        study,
    ]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["search", *stores, *argv])
    return status, out.getvalue(), err.getvalue()


def _summary(folder: Path, study: str) -> dict[str, Any]:
    return json.loads((folder / "runs" / study / "summary.json").read_text())


def _forecasts(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Every trial's forecast as summary.json keeps it (the baseline's too)."""
    entries = [summary["baseline"], *summary["trials"]]
    return [(e.get("telemetry") or {}).get("forecast") or {} for e in entries]


def _attention(tmp_path_factory, study: str, *extra: str) -> dict[str, Any]:
    """The small search on zoo-attention-logit-growth, in a folder of its own."""
    folder = tmp_path_factory.mktemp(study)
    status, out, err = _search(folder, study, *ATTENTION, *extra)
    assert status == 0, err
    return {"folder": folder, "out": out, "summary": _summary(folder, study)}


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict[str, Any]:
    """Unguarded: the trials the forecast cannot tell are trained on (the long half)."""
    return _attention(tmp_path_factory, "plain")


@pytest.fixture(scope="module")
def guarded(tmp_path_factory) -> dict[str, Any]:
    return _attention(tmp_path_factory, "guarded", "--guard")


# The unguarded search is slow for what it adds here: that a trial the forecast cannot tell
# is extended is tested in the everyday set on real trials (test_forecast_models.py); here it
# shows only that these settings are ones where it happens.
@pytest.mark.slow
def test_unguarded_the_forecast_extends_a_trial_it_cannot_tell(plain):
    """The settings are ones where extension happens: without --guard, at least one trial
    trained past its 100 steps."""
    extended = [f["extended_steps"] for f in _forecasts(plain["summary"]) if f]
    assert max(extended) > 0
    assert plain["summary"]["settings"]["guard"] is False


def test_guarded_no_trial_is_extended_and_the_unclear_ones_name_the_watched_layers(guarded):
    summary = guarded["summary"]
    forecasts = [f for f in _forecasts(summary) if f]
    assert forecasts and all(f["extended_steps"] == 0 for f in forecasts)
    unclear = [e for e in summary["trials"] if (e.get("telemetry") or {}).get("cannot_tell")]
    assert unclear, "no trial the forecast cannot tell: the guard's path was not taken"
    for entry in unclear:
        assert entry["state"] == "complete"
        reason = entry["reason"]
        assert reason.startswith("feasible under the guard, which watches ")
        layers = entry["telemetry"]["forecast"]["layers"]  # the least headroom first
        watched = [f"{h['layer']} ({h['dtype']})" for h in layers if h["outcome"] == "cannot tell"]
        assert watched and all(layer in reason for layer in watched)
        assert "attn.scores (fp16)" in reason
        assert entry["telemetry"]["cannot_tell"].endswith(reason)  # the forecast's path
    assert summary["settings"]["guard"] is True
    assert "guard: on" in guarded["out"]
    assert "your guarded run is the confirmation" in guarded["out"]


def test_a_guarded_study_continued_unguarded_is_refused_in_one_line(guarded):
    status, _, err = _search(guarded["folder"], "guarded", *ATTENTION)
    assert status == 2
    assert err.count("\n") == 1 and "guard=True, not None (--guard)" in err


@pytest.mark.slow
def test_an_unguarded_study_continued_guarded_is_refused_in_one_line(plain):
    status, _, err = _search(plain["folder"], "plain", *ATTENTION, "--guard")
    assert status == 2
    assert err.count("\n") == 1 and "guard=None, not True (--guard)" in err


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("healthy")
    argv = ["--task", "zoo-my-task", "--trials", "2", "--steps", "60", "--train-steps", "600"]
    status, out, err = _search(folder, "mine", *argv, *SMALL, "--guard")
    assert status == 0, err
    return {"folder": folder, "out": out, "summary": _summary(folder, "mine")}


def test_guard_writes_a_policy_whose_apply_runs_guarded(healthy):
    path = healthy["folder"] / "runs" / "mine" / "best_policy.yaml"
    assert "guard:" in path.read_text()
    policy = autoprec.load_policy(path)
    assert policy.guard == autoprec.Guard()  # the defaults: the CPU runs bf16 and fp32
    assert healthy["summary"]["best"]["policy"]["default"] != "fp32" or any(
        rule["dtype"] != "fp32" for rule in healthy["summary"]["best"]["policy"]["rules"]
    ), "fp32 won: the guard has nothing to watch"
    model = load_task("zoo-my-task").model()
    prec = policy.apply(model, device="cpu")
    assert isinstance(prec, GuardedPrecision)
    assert isinstance(policy.apply(model, device="cpu", guard=False), autoprec.Precision)


def test_guard_with_train_steps_skips_the_confirmation(healthy):
    assert healthy["summary"].get("confirmation") is None
    assert "confirmation at" not in healthy["out"]
    assert healthy["summary"]["settings"]["train_steps_asked"] == 600
    assert all(f["extended_steps"] == 0 for f in _forecasts(healthy["summary"]) if f)


def test_guard_confirms_when_confirm_steps_asks(tmp_path):
    argv = ["--task", "zoo-exp-growth", "--trials", "2", "--steps", "60", "--train-steps", "600"]
    argv += [*SMALL, "--guard", "--confirm-steps", "90"]
    status, out, err = _search(tmp_path, "fragile", *argv)
    assert status == 0, err
    summary = _summary(tmp_path, "fragile")
    assert summary["confirmation"]["steps"] == 90
    assert "confirmation at 90 steps" in out
    assert "guard: on (best_policy.yaml's guard: section); confirmed at 90 steps as asked" in out
    assert "guard:" in (tmp_path / "runs" / "fragile" / "best_policy.yaml").read_text()


def test_guard_with_serving_is_refused_in_one_line(tmp_path):
    status, _, err = _search(tmp_path, "refused", "--guard", "--mode", "serving")
    assert status == 2
    assert err.count("\n") == 1 and "--guard: only with --mode training" in err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "optuna.db").exists()


def test_a_guard_in_a_config_file_is_a_switch(tmp_path):
    """Declared once: the config file's section ``longer`` has it, as true or false."""
    config = tmp_path / "search.yaml"
    config.write_text("longer:\n  guard: yes please\n")
    status, _, err = _search(tmp_path, "refused", "--config", str(config))
    assert status == 2
    assert err.count("\n") == 1 and "longer.guard: expected true or false" in err
    config.write_text("longer:\n  guard: true\n")
    status, out, err = _search(tmp_path, "printed", "--config", str(config), "--print-config")
    assert status == 0, err
    assert "guard: true" in out


def test_a_guard_that_is_no_switch_is_refused():
    with pytest.raises(autoprec.errors.AutoprecError, match="--guard: expected True or False"):
        autoprec.SearchConfig(guard="yes")


def test_help_says_what_guard_does(capsys):
    with pytest.raises(SystemExit):
        main(["search", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--guard your run will be guarded (best_policy.yaml gets a guard: section" in text


def test_an_old_summary_reads_as_unguarded():
    """Summaries written before --guard have no ``guard`` setting: read as unguarded, and
    the console's closing lines say nothing of a guard."""
    from autoprec.report.headroom import guard_line
    from autoprec.study.summary_schema import Summary

    data = json.loads((Path(__file__).parent / "data/summary_v0_training.json").read_text())
    assert "guard" not in data.get("settings", {})
    summary = Summary.from_json(data)
    assert summary.settings.guard is False and guard_line(summary) is None
