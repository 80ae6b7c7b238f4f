"""The model families people train, searched as they are: tiny-llama (RMSNorm, rotary,
SwiGLU, a tied head) and tiny-t5 (an encoder-decoder) train and serve without a trial that
crashes; T5's serving search writes its summary; int8 reaches Llama's block layers."""

from __future__ import annotations

import json

import pytest

import autoprec

pytestmark = [pytest.mark.slow]


@pytest.fixture(autouse=True)
def _here(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)


def _summary(study: str) -> dict:
    with open(f"runs/{study}/summary.json") as file:
        return json.load(file)


def _crashed(summary: dict) -> list[str]:
    """Reasons of trials that failed (an exception), not for a numeric reason."""
    return [t["reason"] for t in summary["trials"] if t["state"] == "failed"]


@pytest.mark.parametrize("task", ["tiny-llama", "tiny-t5"])
def test_a_training_search_has_no_trial_that_crashed(task):
    autoprec.search(task, trials=6, steps=12, study=task, device="cpu")
    summary = _summary(task)
    assert len(summary["trials"]) >= 6
    assert not _crashed(summary)


def test_the_t5_serving_search_writes_its_summary_and_policy():
    autoprec.search("tiny-t5", mode="inference", scenario="edge", trials=5, steps=20, study="t5")
    summary = _summary("t5")
    assert not _crashed(summary)
    assert summary["best"]["policy"]
    policy = autoprec.load_policy("runs/t5/best_policy.yaml")
    assert policy.resolve_inference(autoprec.tasks.load_task("tiny-t5").model())


def test_int8_reaches_the_linear_layers_inside_llamas_blocks():
    autoprec.search(
        "tiny-llama", mode="inference", scenario="edge", trials=5, steps=20, study="llama"
    )
    summary = _summary("llama")
    assert not _crashed(summary)
    block_int8 = [
        layer
        for trial in summary["trials"]
        for layer, dtype in _served_dtypes(trial).items()
        if dtype == "int8" and ".layers." in layer
    ]
    assert block_int8, "no trial served a block layer in int8"


def _served_dtypes(trial: dict) -> dict[str, str]:
    model = autoprec.tasks.load_task("tiny-llama").model()
    return autoprec.Policy.from_dict(trial["policy"]).resolve_inference(model)
