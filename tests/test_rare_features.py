"""The built-in fragile optimizer-state task: a real search keeps ``inputs``' states
high, the rest in 8 bits, and finds uniform 8-bit states infeasible, naming the group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import autoprec
from autoprec.tasks import load_task

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
    monkeypatch.chdir(tmp_path)
    autoprec.search(
        "rare-features",
        space=str(SHIPPED),
        trials=8,  # the 6 combinations and the anchors
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

    best = summary["best"]
    assert best["params"]["state.inputs"] in ("fp32", "bf16")
    assert best["params"]["state.rest"] == "8bit"
    assert best["metrics"]["accuracy"] >= baseline["accuracy"] - TOLERANCE
    assert best["metrics"]["optimizer_state_mb"] <= 1.10 * uniform["metrics"]["optimizer_state_mb"]
    policy = autoprec.load_policy(tmp_path / "runs/rare/best_policy.yaml")
    assert policy.to_dict() == best["policy"]
