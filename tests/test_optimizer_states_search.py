"""A real search over optimizer states per group: trials build their optimizer through
``policy.optimizer`` and the CPU estimate counts the states as torchao stores them."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from torch import nn
from torch.nn import functional as F

import autoprec

pytest.importorskip("torchao.optim")

SPACE = {
    "name": "states",
    "accuracy_tolerance": 0.05,
    "dtypes": ["fp32"],
    "groups": [{"name": "all", "patterns": ["*"]}],
    "optimizer_states": {
        "states": ["fp32", "8bit"],
        "groups": [
            {"name": "embeddings", "types": ["Embedding"]},
            {"name": "rest", "patterns": ["*"]},
        ],
    },
}


def token_task() -> autoprec.Task:
    """A token's class from its embedding: 64 tokens, 4 classes."""
    generator = torch.Generator().manual_seed(2)
    classes = torch.randint(0, 4, (64,), generator=generator)

    def model() -> nn.Module:
        return nn.Sequential(nn.Embedding(64, 64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def train_data(seed: int):
        g = torch.Generator().manual_seed(seed)
        while True:
            tokens = torch.randint(0, 64, (32,), generator=g)
            yield tokens, classes[tokens]

    def val_data():
        tokens = torch.arange(64)
        return [(tokens, classes[tokens])]

    return autoprec.Task(
        "tokens",
        model,
        train_data,
        val_data,
        F.cross_entropy,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
    )


@pytest.mark.slow
def test_a_search_measures_optimizer_states_per_group(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    space_file = tmp_path / "states.yaml"
    space_file.write_text(yaml.safe_dump(SPACE))
    result = autoprec.search(
        token_task(), space=str(space_file), trials=4, steps=40, study="states", device="cpu"
    )
    summary = json.loads((tmp_path / "runs/states/summary.json").read_text())
    assert summary == json.loads(json.dumps(result.summary))
    trials = {t["anchor"]: t for t in summary["trials"] if t.get("anchor")}
    assert "states-8bit-embeddings-fp32" in trials  # all-fp32 states: the baseline
    recipe = trials["states-8bit-embeddings-fp32"]
    assert recipe["policy"]["optimizer"]["groups"][1]["state"] == "8bit"
    assert recipe["params"]["state.rest"] == "8bit"
    # Only the first Linear weight (4,096 elements) is quantised: its two moments as torchao
    # stores them (1-byte codes, an fp32 scale per block of 256, a 256-entry fp32 code map
    # each) instead of 2 x 4 bytes an element; the layers and activations are alike.
    eight_bytes = 2 * (64 * 64 + 4 * (64 * 64 // 256) + 4 * 256)
    saved_mb = (2 * 4 * 64 * 64 - eight_bytes) / 2**20
    fp32 = summary["baseline"]["metrics"]
    eight = recipe["metrics"]
    assert fp32["peak_memory_mb"] - eight["peak_memory_mb"] == pytest.approx(saved_mb, rel=1e-9)
    assert fp32["optimizer_state_mb"] - eight["optimizer_state_mb"] == pytest.approx(
        saved_mb, rel=1e-9
    )
    best = autoprec.load_policy(tmp_path / "runs/states/best_policy.yaml")
    assert best.to_dict() == summary["best"]["policy"]
