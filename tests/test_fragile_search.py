"""Searches on tasks where plain fp16 fails: the shipped fragile tasks, and held-out
ones written here only against the Task contract and searched in the generic space.

Each search must end with a feasible best policy that runs at least half of the
parameters in fp16 or bf16, while the uniform fp16 anchors are pruned or infeasible
with a reason naming overflow or underflow."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import autoprec
from autoprec.tasks import load_task


def attention_overflow_task() -> autoprec.Task:
    """Held out: attention logits without the 1/sqrt(d) factor on large inputs pass
    65504 in the q @ k^T product. Its head (an MLP) holds most of the parameters, so that
    the attention kept in fp32 and the rest in fp16 or bf16 runs more than half of them in
    low precision: whether bf16 attention itself holds on logits of ~1e5 depends on the
    CPU's bf16 kernels (it trailed fp32 by 2-5 points at 40 steps on one with AMX)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(640, 6, 16, generator=g) * 200.0
    direction = torch.randn(16, generator=g)
    y = ((x.mean(dim=1) @ direction) > 0).long()

    class Attention(nn.Module):
        def __init__(self, width: int = 32):
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))

        def forward(self, h):
            scores = self.q(h) @ self.k(h).transpose(1, 2)  # no scaling: the classic slip
            return torch.softmax(scores.float(), dim=-1).to(h.dtype) @ self.v(h)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(16, 32)
            self.attn = Attention()
            self.out = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 2))

        def forward(self, tokens):
            return self.out(self.attn(self.embed(tokens)).mean(dim=1))

    def train_data(seed):
        gen = torch.Generator().manual_seed(seed)
        while True:
            order = torch.randperm(512, generator=gen)
            for i in range(0, 512, 64):
                yield x[order[i : i + 64]], y[order[i : i + 64]]

    return autoprec.Task(
        "held-out-attention", Net, train_data, lambda: [(x[512:], y[512:])], F.cross_entropy
    )


def tiny_loss_cnn_task() -> autoprec.Task:
    """Held out: a small CNN whose loss is normalised by a huge count (1e-7), trained
    with Adam: its gradients sit under fp16's smallest subnormal."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(600, 1, 8, 8, generator=g)
    y = (x[:, 0, :4].sum(dim=(1, 2)) > x[:, 0, 4:].sum(dim=(1, 2))).long()

    def model():
        return nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 2)
        )

    def train_data(seed):
        gen = torch.Generator().manual_seed(seed)
        while True:
            order = torch.randperm(500, generator=gen)
            for i in range(0, 500, 50):
                yield x[order[i : i + 50]], y[order[i : i + 50]]

    return autoprec.Task(
        "held-out-tiny-loss",
        model,
        train_data,
        lambda: [(x[500:], y[500:])],
        loss=lambda out, target: F.cross_entropy(out, target) * 1e-7,
        optimizer=lambda params: torch.optim.Adam(params, lr=3e-3, eps=1e-20),
    )


CASES = [
    ("digits-overflow", None, "overflow"),
    ("digits-underflow", None, "underflow"),
    (attention_overflow_task, "default", "overflow"),
    (tiny_loss_cnn_task, "default", "underflow"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("task", "space", "mechanism"),
    CASES,
    ids=["overflow", "underflow", "held-out-attention", "held-out-cnn"],
)
def test_search_finds_a_low_precision_policy_where_fp16_fails(in_tmp, task, space, mechanism):
    task = load_task(task) if isinstance(task, str) else task()
    result = autoprec.search(
        task, space, trials=8, steps=40, device="cpu", prefer="memory", study="fragile"
    )
    summary = result.summary
    best = summary["best"]
    assert best["feasible"]
    assert best["metrics"]["low_precision_share"] >= 0.5
    anchors = {t["anchor"]: t for t in summary["trials"] if t["anchor"]}
    noscale = anchors["uniform-fp16-noscale"]
    assert noscale["state"] == "pruned" or not noscale["feasible"]
    assert noscale["reason"] and noscale["reason"].startswith(f"{mechanism}:")
    if mechanism == "overflow":  # no loss scale helps a forward overflow
        scaled = anchors["uniform-fp16"]
        assert scaled["state"] == "pruned" and scaled["reason"].startswith("overflow:")
    assert summary["trials"][0]["telemetry"]["observed_steps"] >= 1
