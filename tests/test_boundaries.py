"""Region boundaries: any mix of fp32, fp16 and bf16 runs, and hooks see what ran."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch import nn

import autoprec
from autoprec import Policy, Rule
from autoprec.devices import autocast_behaviour, get_backend
from autoprec.errors import PolicyError
from autoprec.numerics.observe import watch_task
from autoprec.precision.hooks import PrecisionHooks
from autoprec.precision.plan import boundaries
from autoprec.serving.conversion import CastInputs, ServingPrecision, convert
from autoprec.trials.training import Budget, run_trial
from tests.boundary_tasks import (
    boundary_task,
    conv_task,
    held_out_transformers,
    random_mixed_policies,
    recurrent_task,
    token_batch,
)
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


class Block(nn.Module):
    """A residual block: its glue (the add) runs between its children."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.relu(self.fc(x)))


def test_the_largest_same_dtype_subtrees_are_the_boundaries():
    model = nn.Sequential(nn.Linear(4, 8), Block(), Block(), nn.Linear(8, 3))
    dtypes = {"0": "fp16", "1.fc": "fp16", "1.proj": "fp16", "2.fc": "bf16", "2.proj": "fp32"}
    found = boundaries(model, {**dtypes, "3": "fp16"})
    # Block 1 is one subtree (all fp16); block 2 mixes, so its children are.
    assert [(s.name, s.dtype) for s in found.subtrees] == [
        ("0", "fp16"),
        ("1", "fp16"),
        ("2.fc", "bf16"),
        ("2.proj", "fp32"),
        ("3", "fp16"),
    ]
    assert found.uniform is None and found.single_dtype("1") == "fp16"
    uniform = boundaries(model, dict.fromkeys(dtypes, "bf16"))
    assert uniform.uniform == "bf16" and uniform.subtrees == ()


def test_a_container_its_parent_never_calls_is_looked_through():
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    found = boundaries(Stack(), {"layers.0": "fp16", "layers.1": "fp16"})
    assert found.uniform == "fp16"
    mixed = boundaries(Stack(), {"layers.0": "fp16", "layers.1": "bf16"})
    # Not "layers": a ModuleList's forward never runs, so no cast on it would.
    assert [s.name for s in mixed.subtrees] == ["layers.0", "layers.1"]


def test_training_regions_and_serving_casts_sit_on_the_same_subtrees():
    """One algorithm: the modules that training gives a region of their own are the
    subtrees, in another dtype than the outer region, where serving casts."""
    model = nn.Sequential(nn.Linear(4, 8), Block(), Block(), nn.Linear(8, 3))
    policy = Policy(
        rules=(Rule("bf16", patterns=("2.fc",)), Rule("fp32", patterns=("2.proj", "3"))),
        default="fp16",
    )
    plan = policy.plan(model, "cpu")
    served = convert(model, policy.resolve_served(model), "cpu")
    casting = {
        name
        for name, module in served.named_modules()
        if name and any(isinstance(h, CastInputs) for h in module._forward_pre_hooks.values())
    }
    subtrees = boundaries(model, policy.resolve_served(model)).subtrees
    assert casting == {s.name for s in subtrees} == {"0", "1", "2.fc", "2.proj", "3"}
    assert {r.name for r in plan.regions} == {
        s.name for s in subtrees if s.dtype != plan.outer_dtype
    }
    assert plan.outer_dtype == "fp16"
    # Both run, and each serves its layers in the dtypes the policy says.
    x = torch.randn(2, 4)
    with policy.apply(model, "cpu").autocast():
        assert model(x).shape == served(x).shape == (2, 3)
    assert served(x).dtype == torch.float32


def test_serving_hooks_have_the_shape_of_training_hooks():
    """Lightning-style hooks for both modes: a loop runs either without asking which."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    training = Policy.uniform("bf16").apply(model, "cpu")
    serving = ServingPrecision({"0": "bf16", "2": "bf16"}, get_backend("cpu"))
    x = torch.randn(2, 4)
    outputs = []
    for hooks in (training, serving):
        assert isinstance(hooks, PrecisionHooks)
        module = hooks.convert_module(model) if hooks is serving else model
        with hooks.forward_context():
            out = hooks.convert_output(module(hooks.convert_input(x)))
        outputs.append(out)
    assert all(out.dtype == torch.float32 for out in outputs)
    assert serving.convert_input(x).dtype == torch.bfloat16  # a uniform model's inputs
    assert model[0].weight.dtype == torch.float32  # serving converts a copy


def _watched_trials(task: autoprec.Task, policies: list[Policy]) -> dict[str, str]:
    """Each policy's trial of ``task`` after the task was watched, as a search runs it:
    ``complete``, ``refused: <reason>`` (the probe found a layer that cannot run in its
    dtype here) or ``crashed: <reason>``."""
    cpu = get_backend("cpu")
    watch_task(task, task.model(), cpu)
    outcomes = {}
    for policy in policies:
        try:
            result = run_trial(task, policy, cpu, Budget(steps=3, warmup_steps=1))
        except PolicyError as error:
            assert "cannot run in" in str(error) and "\n" not in str(error)
            outcomes[str(policy.name)] = f"refused: {error}"
            continue
        failed = result.state == "failed"
        outcomes[str(policy.name)] = f"crashed: {result.reason}" if failed else "complete"
    return outcomes


@pytest.mark.parametrize("make_task", [boundary_task, recurrent_task, conv_task])
def test_random_mixed_fp16_bf16_policies_train_without_a_crash(make_task):
    """Five random policies that put each layer in fp16 or bf16 (now and then fp32): custom
    modules that cat, stack, einsum and matmul their inputs, residual adds, several inputs
    and nested outputs; an LSTM and a GRU; convolutions with BatchNorm. Real training steps,
    no crash: before the border rule, 2 of 5 crashed in autocast's prioritize on the
    boundary model and 4 of 5 in oneDNN's LSTM."""
    task = make_task()
    outcomes = _watched_trials(task, random_mixed_policies(task.model(), 5, seed=11))
    crashed = {name: why for name, why in outcomes.items() if why.startswith("crashed")}
    assert not crashed
    assert "complete" in outcomes.values()


def _train_steps(model: nn.Module, policy: Policy, batch: dict, steps: int = 2) -> None:
    prec = policy.apply(model, "cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    try:
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            with prec.autocast():
                loss = model(**batch).loss
            prec.backward(loss)
            prec.step(optimizer)
    finally:
        prec.remove()


@pytest.mark.slow
def test_random_mixed_policies_train_every_held_out_transformer_without_a_crash():
    """Five random fp16/bf16 policies on each of ten transformers families, watched on one
    batch first as a search watches its task, each through two training steps."""
    pytest.importorskip("transformers")
    batch = token_batch()
    crashed = {}
    for family, make in held_out_transformers().items():
        torch.manual_seed(0)
        model = make()
        Policy.uniform("bf16").resolve(model, "cpu", example=batch)  # watches its layers
        for policy in random_mixed_policies(model, 5, seed=11):
            try:
                _train_steps(model, policy, batch)
            except Exception as error:  # what this test counts
                crashed[family, policy.name] = f"{type(error).__name__}: {error}"
    assert not crashed, crashed


@pytest.mark.parametrize("inner", ["cat", "stack", "attn", "res", "gated", "two"])
@pytest.mark.parametrize(("outer", "low"), [("bf16", "fp16"), ("fp16", "bf16"), ("fp32", "fp16")])
def test_a_custom_module_in_another_dtype_than_its_inputs_runs_forward_and_backward(
    inner, outer, low
):
    """One custom module (cat, stack, einsum and matmul, a residual add, a gated leaf, a
    module of several inputs and nested outputs) in ``low`` inside a model in ``outer``:
    its inputs arrive in ``outer`` and are cast at its border, so that autocast never meets
    fp16 beside bf16; what resolve says is what hooks see."""
    torch.manual_seed(0)
    task = boundary_task()
    model = task.model()
    policy = Policy(rules=(Rule(low, patterns=(inner,)),), default=outer)
    x, y = next(iter(task.train_data(0)))
    resolved = policy.resolve(model, "cpu", example=(x, y))
    seen = {}
    for name, module in model.named_modules():
        if name and next(module.children(), None) is None and list(module.parameters()):
            module.register_forward_hook(
                lambda m, a, out, name=name: (
                    None if name in seen else seen.update({name: out.dtype})
                )
            )
    prec = policy.apply(model, "cpu")
    with prec.autocast():
        loss = nn.functional.cross_entropy(model(x).float(), y)
    prec.backward(loss)
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert {n: DTYPES[d] for n, d in resolved.items()} == seen
    inside = [resolved[n] for n in resolved if n == inner or n.startswith(f"{inner}.")]
    # The gated leaf's fp32 parameters promote what it computes: fp32, watched so.
    assert inside == ["fp32"] if inner == "gated" else low in inside
