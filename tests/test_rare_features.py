"""The built-in fragile optimizer-state task: a real search keeps ``inputs``' states
high, the rest in 8 bits, and finds uniform 8-bit states infeasible, naming the group."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pytest
import torch

import autoprec
from autoprec.numerics.state_health import rank_state_groups
from autoprec.report import render_report
from autoprec.study.summary_schema import Summary
from autoprec.tasks import load_task
from autoprec.tracking import mlflow_client

pytest.importorskip("torchao.optim")

SHIPPED = Path(__file__).resolve().parents[1] / "search_spaces" / "rare-features.yaml"
TOLERANCE = 0.02  # its accuracy_tolerance


def test_rare_features_trains_in_fp32_and_its_inputs_take_8bit_states():
    task = load_task("rare-features")
    torch.manual_seed(0)
    model = task.model()
    assert model.inputs.weight.numel() >= 4096  # torchao quantises states from 4,096 on
    optimizer = task.optimizer(model.parameters())
    batches = task.train_data(0)
    for _ in range(200):
        x, y = next(batches)
        loss = task.loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        scores = [task.metric(model(x), y) for x, y in task.val_data()]
    assert min(scores) > 0.99


@pytest.mark.slow
def test_a_search_keeps_the_rare_features_states_high(tmp_path, monkeypatch):
    """The guided search ranks ``inputs`` first from the baseline's own states, so three
    trials find the choice: uniform 8-bit (the anchor and the seed), ``inputs`` kept in
    fp32, then in bf16. The uniform trial's reason, summary, MLflow run and report name
    the group and the mechanism."""
    monkeypatch.chdir(tmp_path)
    autoprec.search(
        "rare-features",
        space=str(SHIPPED),
        trials=3,  # the anchor (every group 8-bit), the bisection's probe, the refinement
        steps=200,
        study="rare",
        device="cpu",
        prefer="memory",
    )
    summary = json.loads((tmp_path / "runs/rare/summary.json").read_text())
    baseline = summary["baseline"]["metrics"]
    by_anchor = {t["anchor"]: t for t in summary["trials"] if t.get("anchor")}
    uniform = by_anchor["states-8bit-embeddings-fp32"]  # no Embedding: every group in 8 bits
    assert (uniform["params"]["state.inputs"], uniform["params"]["state.rest"]) == ("8bit", "8bit")
    assert not uniform["feasible"]
    if uniform["state"] == "pruned":  # stopped early: its loss ran away from fp32's
        assert "loss trails the fp32 baseline" in uniform["reason"]
    else:
        assert uniform["metrics"]["accuracy"] < baseline["accuracy"] - TOLERANCE
    assert "optimizer state of group inputs: inputs.weight" in uniform["reason"]
    assert "lr * exp_avg / eps" in uniform["reason"]

    # The ranking: what 8 bits lose on the fp32 baseline's states, inputs first.
    typed = Summary.from_json(summary)
    losses = {(x.group, x.kind): x for x in typed.baseline.state_loss}
    assert losses["inputs", "8bit"].collapsed_share > 0.0
    assert losses["rest", "8bit"].collapsed_share == 0.0
    assert rank_state_groups(typed.baseline.state_loss, "8bit", ["inputs", "rest"])[0] == "inputs"
    guided = [(t["guided"], t["params"]) for t in summary["trials"] if t.get("guided")]
    assert [phase for phase, _ in guided] == ["bisect", "refine"]
    assert [(p["state.inputs"], p["state.rest"]) for _, p in guided] == [
        ("fp32", "8bit"),
        ("bf16", "8bit"),
    ]

    # The reason per group: in summary.json (typed), MLflow and the report.
    health = {g.group: g for g in typed.entry(uniform["number"]).state_health}
    assert health["inputs"].state == "8bit"
    assert health["inputs"].collapsed_share > 0.0
    assert "underflow" in health["inputs"].mechanisms
    assert health["inputs"].reason is not None
    assert health["inputs"].reason.startswith("optimizer state of group inputs: inputs.weight")
    client = mlflow_client("sqlite:///runs/mlflow.db")
    run = client.get_run(uniform["mlflow_run_id"])
    assert run.data.tags["state_reason.inputs"] == health["inputs"].reason
    assert run.data.metrics["state_health.inputs.collapsed_share"] == pytest.approx(
        health["inputs"].collapsed_share
    )
    fp32_run = client.get_run(summary["baseline"]["mlflow_run_id"])
    assert fp32_run.data.metrics["state_loss.inputs.8bit.collapsed_share"] == pytest.approx(
        losses["inputs", "8bit"].collapsed_share
    )
    page = next(p for p in render_report(summary, tmp_path / "report") if p.suffix == ".html")
    text = page.read_text()
    assert "Optimizer state health per group" in text
    assert "what each kind loses" in text
    assert html.escape(health["inputs"].reason) in text

    best = summary["best"]
    assert best["params"]["state.inputs"] in ("fp32", "bf16")
    assert best["params"]["state.rest"] == "8bit"
    assert best["metrics"]["accuracy"] >= baseline["accuracy"] - TOLERANCE
    # Within 10% of all-8-bit where inputs in bf16 held (here: 0.596 MB against 0.566).
    # With oneDNN held to AVX2 that trial's hidden.weight collapsed too (accuracy 0.52),
    # and inputs in fp32 (0.663 MB) is the answer: the choice follows what was measured.
    refined = next(t for t in summary["trials"] if t.get("guided") == "refine")
    if refined["feasible"]:
        assert best["number"] == refined["number"]
        assert (
            best["metrics"]["optimizer_state_mb"] <= 1.10 * uniform["metrics"]["optimizer_state_mb"]
        )
    policy = autoprec.load_policy(tmp_path / "runs/rare/best_policy.yaml")
    assert policy.to_dict() == best["policy"]
