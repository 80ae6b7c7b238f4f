"""Region boundaries: any mix of fp32, fp16 and bf16 runs, and hooks see what ran."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch import nn

import autoprec
from autoprec import Policy, Rule
from autoprec.devices import autocast_behaviour
from tests.contract_tasks import make_lstm_task

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class Rotary(nn.Module):
    """Two projections joined by torch.cat, as rotary embeddings' rotate_half does."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.q(x), self.k(x)
        return self.out(torch.cat([q, -k], dim=-1))


@pytest.mark.parametrize(
    ("default", "k_dtype"),
    [(a, b) for a, b in itertools.product(DTYPES, DTYPES) if a != b],
)
def test_any_two_dtypes_beside_each_other_run_forward_and_backward(default, k_dtype):
    torch.manual_seed(0)
    model = Rotary()
    policy = Policy(rules=(Rule(k_dtype, patterns=("k",)),), default=default)
    seen = {}
    for name in ("q", "k", "out"):
        module = getattr(model, name)
        module.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out.dtype))
    prec = policy.apply(model, device="cpu")
    with prec.autocast():
        out = model(torch.randn(4, 8))
    prec.backward(out.float().sum())
    assert seen == {"q": DTYPES[default], "k": DTYPES[k_dtype], "out": DTYPES[default]}
    assert policy.resolve(model, "cpu") == {"q": default, "k": k_dtype, "out": default}


def test_llama_with_one_projection_in_the_other_low_dtype_trains():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    policy = Policy(rules=(Rule("bf16", patterns=("*k_proj",)),), default="fp16")
    prec = policy.apply(model, device="cpu")
    ids = torch.randint(0, 64, (2, 12))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with prec.autocast():
        loss = model(input_ids=ids, labels=ids).loss
    prec.backward(loss)
    assert prec.step(optimizer)
    assert torch.isfinite(loss)


def test_hooks_registered_after_apply_see_what_the_module_computed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3))
    prec = Policy(rules=(Rule("bf16", patterns=("1",)),), default="fp32").apply(model, "cpu")
    seen = []
    model[1].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    model[2].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    with prec.autocast():
        model(torch.randn(2, 8))
    assert seen == [torch.bfloat16, torch.float32]  # the hook, then what fp32 receives
    prec.remove()
    seen.clear()
    model(torch.randn(2, 8))
    assert seen == [torch.float32, torch.float32]


@pytest.mark.slow
def test_an_lstm_runs_in_every_low_dtype_the_space_offers_and_trials_do_not_crash(
    tmp_path, monkeypatch
):
    """On the CPU an LSTM under autocast fails on the fp32 input an embedding hands it;
    once watched, the plan casts its input (as the profile does), so every trial runs."""
    monkeypatch.chdir(tmp_path)
    task = make_lstm_task()
    result = autoprec.search(task, trials=6, steps=12, study="lstm", device="cpu")
    summary = json.loads((tmp_path / "runs/lstm/summary.json").read_text())
    assert autocast_behaviour("cpu", nn.LSTM(2, 2)) == "cast"
    tried = {t["policy"]["default"] for t in summary["trials"]} | {
        r["dtype"] for t in summary["trials"] for r in t["policy"].get("rules", [])
    }
    assert {"fp16", "bf16"} <= tried
    failed = [t for t in summary["trials"] if t["state"] == "failed"]
    assert not failed, [t["reason"] for t in failed]
    assert result.best_policy.resolve(task.model(), "cpu")  # the chosen policy applies
