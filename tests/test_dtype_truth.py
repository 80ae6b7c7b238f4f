"""Dtypes that are true on every device: what `Policy.resolve` says a layer runs in is
what it runs in. On the CPU this is checked by running policies and reading every
layer's output dtype with forward hooks; the CUDA and Ascend tables, written from
torch's per-device autocast lists, are checked as tables."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import zlib
from collections import OrderedDict

import pytest
import torch
from torch import nn

from autoprec import Policy, Rule
from autoprec._util.structures import tensors
from autoprec.devices import (
    DTYPES,
    FIXED_FP32,
    FOLLOWS_INPUT,
    autocast_behaviour,
    table_behaviour,
)
from autoprec.precision.plan import low_precision_share, parameterised_leaves
from autoprec.profile.autogroups import _family
from autoprec.space import load_space, searched_leaves
from autoprec.tasks import load_task
from autoprec.tasks.base import Batch
from tests.boundary_tasks import (
    held_out_transformers,
    low_policies,
    random_mixed_policies,
    token_batch,
)
from tests.contract_tasks import make_tiny_task

try:
    import transformers  # noqa: F401

    _HAS_TRANSFORMERS = True
except ImportError:  # the held-out families need it
    _HAS_TRANSFORMERS = False

TASKS = [
    "digits-mlp",
    "digits-cnn",
    "digits-overflow",
    "digits-resnet",
    "tiny-gpt2",
    "tiny-bert",
    "tiny-llama",
    "tiny-t5",
]


def _task(name):
    if name.startswith("tiny-"):
        pytest.importorskip("transformers")
    return load_task(name)


def _seed(task_name: str) -> int:
    """The random policies' seed: the same in every process (``hash`` of a string changes
    with PYTHONHASHSEED, so a failure could not be run again)."""
    return zlib.crc32(task_name.encode()) % 1000


def _policies(model, low, seed):
    """Uniform, half-and-half and random per-leaf policies in fp32 and ``low``."""
    leaves = [name for name, _ in parameterised_leaves(model)]
    rng = random.Random(seed)
    yield Policy.uniform(low)
    yield Policy(rules=(Rule(low, patterns=tuple(leaves[: len(leaves) // 2])),))
    for _ in range(3):
        chosen = tuple(n for n in leaves if rng.random() < 0.5)
        rules = (Rule(low, patterns=chosen),) if chosen else ()
        yield Policy(rules=rules, default="fp32" if rng.random() < 0.5 else low)


def _actual_dtypes(model, policy, batch):
    """Each leaf with parameters that ran: the dtype of its (first floating) output."""
    seen = {}
    handles = []
    for name, module in parameterised_leaves(model):

        def hook(module, args, output, name=name):
            tensors = [output] if isinstance(output, torch.Tensor) else list(output)
            floating = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if floating:
                seen.setdefault(name, floating[0].dtype)

        handles.append(module.register_forward_hook(hook))
    prec = policy.apply(model, "cpu")
    try:
        with torch.no_grad(), prec.autocast():
            batch.run(model)
    finally:
        prec.remove()
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("low", ["bf16", "fp16"])
@pytest.mark.parametrize("task_name", TASKS)
def test_every_leaf_runs_in_the_dtype_resolve_reports_on_the_cpu(task_name, low):
    task = _task(task_name)
    torch.manual_seed(0)
    model = task.model().eval()
    batch = task.batch(next(iter(task.train_data(0))))
    for index, policy in enumerate(_policies(model, low, seed=_seed(task_name))):
        resolved = policy.resolve(model, "cpu", example=batch)
        actual = _actual_dtypes(model, policy, batch)
        assert actual, "no leaf ran"
        wrong = {
            name: (resolved[name], str(dtype))
            for name, dtype in actual.items()
            if DTYPES[resolved[name]] != dtype
        }
        assert not wrong, f"policy {index}: resolve() disagrees with the run: {wrong}"


@pytest.mark.parametrize(
    "task_name",
    [n if n.startswith("digits") else pytest.param(n, marks=pytest.mark.slow) for n in TASKS],
)
def test_mixed_fp16_and_bf16_policies_run_as_resolve_reports_on_the_built_in_tasks(task_name):
    """Policies that put fp16 and bf16 layers side by side (and a few fp32 ones): what
    resolve says, watched on one batch, is what every leaf's hooks see."""
    task = _task(task_name)
    torch.manual_seed(0)
    model = task.model().eval()
    batch = task.batch(next(iter(task.train_data(0))))
    for policy in random_mixed_policies(model, 3, seed=_seed(task_name)):
        resolved = policy.resolve(model, "cpu", example=batch)
        actual = _actual_dtypes(model, policy, batch)
        assert actual, "no leaf ran"
        wrong = {
            name: (resolved[name], str(dtype))
            for name, dtype in actual.items()
            if DTYPES[resolved[name]] != dtype
        }
        assert not wrong, f"{policy.name}: resolve() disagrees with the run: {wrong}"


@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_a_fitted_space_offers_only_choices_that_change_something(low):
    # Every policy a space can suggest runs as resolve() says, and every group holds a
    # layer whose dtype the policy decides.
    task = make_tiny_task()
    model = task.model()
    space = load_space("default").fit(model)
    batch = task.batch(next(iter(task.train_data(0))))
    for dtype in ("fp32", low):
        for group in space.groups:
            params = {f"dtype.{g.name}": "fp32" for g in space.groups}
            params[f"dtype.{group.name}"] = dtype
            policy = space.policy(params)
            actual = _actual_dtypes(model, policy, batch)
            taken = [n for n, g in space.assignment(model).items() if g == group.name]
            assert taken and all(actual[n] == DTYPES[dtype] for n in taken)


def test_batchnorm_marked_low_inside_fp32_neighbours_really_runs_low():
    model = nn.Sequential(
        OrderedDict(
            conv=nn.Conv2d(1, 4, 3), bn=nn.BatchNorm2d(4), flat=nn.Flatten(), fc=nn.Linear(144, 2)
        )
    )
    policy = Policy(rules=(Rule("fp16", types=("BatchNorm2d",)),))
    assert policy.resolve(model)["bn"] == "fp16"
    assert policy.low_precision_share(model) == pytest.approx(8 / (40 + 8 + 290))

    class Direct:
        def run(self, module):
            return module(torch.randn(2, 1, 8, 8))

    actual = _actual_dtypes(model, policy, Direct())
    assert actual == {"conv": torch.float32, "bn": torch.float16, "fc": torch.float32}


class ListOfBlocks(nn.Module):
    """Blocks held in a ModuleList, which is never called itself: the model loops over it,
    as transformers models loop over their layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 64)
        self.blocks = nn.ModuleList([nn.Linear(64, 4), nn.Linear(4, 64)])
        self.head = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_blocks_in_a_module_list_run_in_their_own_dtype(low):
    # The blocks hold the fewest parameters, so the model's outer region is fp32 and the
    # blocks need a region of their own: on each block, since the list never runs.
    model = ListOfBlocks()
    policy = Policy(rules=(Rule(low, patterns=("blocks.*",)),))

    class Direct:
        def run(self, module):
            return module(torch.randn(2, 64))

    actual = _actual_dtypes(model, policy, Direct())
    expected = {"inp": torch.float32, "head": torch.float32}
    assert actual == {**expected, "blocks.0": DTYPES[low], "blocks.1": DTYPES[low]}
    inverse = Policy(rules=(Rule("fp32", patterns=("blocks.*",)),), default=low)
    assert _actual_dtypes(model, inverse, Direct()) == {
        "inp": DTYPES[low],
        "head": DTYPES[low],
        "blocks.0": torch.float32,
        "blocks.1": torch.float32,
    }


def test_autocast_tables_follow_torch_per_device_lists():
    # torch's aten/src/ATen/autocast_mode.cpp: CUDA (and torch_npu, which follows it) runs
    # layer_norm and group_norm in fp32; the CPU list has neither, nor batch_norm anywhere.
    for kind in ("cuda", "npu"):
        assert {"LayerNorm", "GroupNorm", "Embedding", "EmbeddingBag"} <= FIXED_FP32[kind]
        assert table_behaviour(kind, nn.LayerNorm(4)) == "fp32"
        assert table_behaviour(kind, nn.GroupNorm(2, 4)) == "fp32"
        assert table_behaviour(kind, nn.BatchNorm1d(4)) == "input"
        assert table_behaviour(kind, nn.InstanceNorm2d(4, affine=True)) == "input"
    assert FIXED_FP32["cpu"] == {"Embedding", "EmbeddingBag"}
    for module in (nn.LayerNorm(4), nn.GroupNorm(2, 4), nn.BatchNorm2d(4), nn.RMSNorm(4)):
        assert table_behaviour("cpu", module) == "input"
    for kind in ("cpu", "cuda", "npu"):
        assert table_behaviour(kind, nn.Embedding(4, 4)) == "fp32"
        for module in (nn.Linear(4, 4), nn.Conv2d(1, 1, 1), nn.LSTM(4, 4)):
            assert table_behaviour(kind, module) == "region"
        assert "_NormBase" in FOLLOWS_INPUT[kind]


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_the_cpu_table_is_what_cpu_autocast_does(low):
    """The CPU rows, checked by running them: a module that follows its input returns the
    input's dtype under autocast; a fixed-fp32 one returns fp32; the others the region's."""
    cases = [
        (nn.LayerNorm(8), torch.randn(4, 8)),
        (nn.GroupNorm(2, 4), torch.randn(2, 4, 5)),
        (nn.BatchNorm2d(3), torch.randn(2, 3, 4, 4)),
        (nn.RMSNorm(8), torch.randn(4, 8)),
        (nn.Linear(8, 8), torch.randn(4, 8)),
        (nn.Conv2d(3, 4, 3), torch.randn(2, 3, 8, 8)),
    ]
    for module, x in cases:
        behaviour = table_behaviour("cpu", module)
        for given in (torch.float32, low):
            with torch.autocast("cpu", dtype=low):
                out = module(x.to(given))
            expected = {"input": given, "region": low, "fp32": torch.float32}[behaviour]
            assert out.dtype == expected, (type(module).__name__, given)
    with torch.autocast("cpu", dtype=low):
        assert nn.Embedding(10, 4)(torch.tensor([1, 2])).dtype == torch.float32


_PRINT_SEED = "from tests.test_dtype_truth import _seed; print(_seed('digits-mlp'))"


def test_the_random_policies_are_the_same_in_every_process():
    seeds = {
        subprocess.run(
            [sys.executable, "-c", _PRINT_SEED],
            env={**os.environ, "PYTHONHASHSEED": str(hash_seed)},
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        ).stdout
        for hash_seed in (1, 2, 3)
    }
    assert len(seeds) == 1, seeds


class UpcastingNorm(nn.Module):
    """A norm of a user's own, as transformers' RMSNorms are: it computes in fp32 inside
    and returns fp32, whatever autocast or its input says."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Scaler(nn.Module):
    """A layer of a user's own that follows its input: a per-channel scale."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain.to(x.dtype)


def _custom_model(batch_norm: bool = False) -> nn.Module:
    """Layers of a user's own beside torch's; ``batch_norm``: a BatchNorm after the
    LayerNorm (inputs of shape (batch, 3, 16))."""
    layers = OrderedDict(
        fc1=nn.Linear(8, 16),
        norm=UpcastingNorm(16),
        scale=Scaler(16),
        fc2=nn.Linear(16, 16),
        ln=nn.LayerNorm(16),
    )
    if batch_norm:
        layers["bn"] = nn.BatchNorm1d(3)
    layers["head"] = nn.Linear(16, 3)
    return nn.Sequential(layers)


class _Example:
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def run(self, module):
        return module(self.x)


@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_modules_of_a_users_own_are_watched_not_guessed(low):
    torch.manual_seed(0)
    model = _custom_model()
    batch = (torch.randn(4, 8), torch.zeros(4, dtype=torch.long))
    example = _Example(batch[0])
    leaves = [name for name, _ in parameterised_leaves(model)]
    policies = [
        *_policies(model, low, seed=7),
        Policy(rules=(Rule(low, patterns=tuple(leaves)),)),  # every layer named
    ]
    for index, policy in enumerate(policies):
        resolved = policy.resolve(model, "cpu", example=batch)
        actual = _actual_dtypes(model, policy, example)
        assert {n: DTYPES[d] for n, d in resolved.items()} == actual, f"policy {index}"
    # Once watched, the upcasting norm is known to run in fp32 whatever a policy says, so
    # no space offers it a choice; the scale that follows its input is offered one.
    assert autocast_behaviour("cpu", model.norm) == "fp32"
    assert autocast_behaviour("cpu", model.scale) == "input"
    searched = [name for name, _ in searched_leaves(model, "cpu")]
    assert "norm" not in searched and "scale" in searched


def test_transformers_norms_are_fp32_and_grouped_as_norms_once_watched():
    pytest.importorskip("transformers")
    for name, norm_class in (("tiny-llama", "LlamaRMSNorm"), ("tiny-t5", "T5LayerNorm")):
        task = load_task(name)
        model = task.model()
        batch = next(iter(task.val_data()))
        resolved = Policy.uniform("bf16").resolve(model, "cpu", example=batch)
        norms = [n for n, m in model.named_modules() if type(m).__name__ == norm_class]
        assert norms and all(resolved[n] == "fp32" for n in norms)
        assert not any(n in dict(searched_leaves(model, "cpu")) for n in norms)
        assert _family(next(m for m in model.modules() if type(m).__name__ == norm_class)) == (
            "norms"
        )


def _trained_dtypes(model, policy, run):
    """What forward hooks registered before ``apply`` see in one training step (train
    mode, gradients on, forward and backward): each leaf with parameters that ran mapped
    to the dtype name of its first floating output."""
    names = {dtype: name for name, dtype in DTYPES.items()}
    seen = {}
    handles = []
    for name, module in parameterised_leaves(model):

        def hook(module, args, output, name=name):
            floating = [t for t in tensors(output) if t.is_floating_point()]
            if floating:
                seen.setdefault(name, names[floating[0].dtype])

        handles.append(module.register_forward_hook(hook))
    model.train()
    prec = policy.apply(model, "cpu")
    try:
        with prec.autocast():
            outputs = run(model)
        prec.backward(outputs.loss)
    finally:
        prec.remove()
        for handle in handles:
            handle.remove()
    model.zero_grad(set_to_none=True)
    return seen


# Two families run in the everyday suite; all ten (about 25 s each here) are slow.
_FAMILIES = [
    family if family in ("llama", "t5") else pytest.param(family, marks=pytest.mark.slow)
    for family in (sorted(held_out_transformers()) if _HAS_TRANSFORMERS else [])
]


@pytest.mark.parametrize("family", _FAMILIES)
def test_resolve_is_what_a_training_step_shows_on_held_out_transformers(family):
    """Ten transformers families no rule was written for (their own RMSNorms, T5's
    LayerNorm, fused QKV layers, Conv1D), under uniform bf16, uniform fp16 and mixed
    bf16/fp16 policies: ``resolve``, the layer table and the low-precision share, watched
    on one batch, say what hooks registered before ``apply`` see in a training step."""
    torch.manual_seed(0)
    model = held_out_transformers()[family]()
    batch = token_batch()
    run = lambda module: module(**batch)  # noqa: E731
    for policy in low_policies(model, seed=_seed(family)):
        resolved = policy.resolve(model, "cpu", example=batch)
        seen = _trained_dtypes(model, policy, run)
        assert seen and set(seen) <= set(resolved)  # T5's later blocks have no bias table
        wrong = {
            name: (resolved[name], dtype) for name, dtype in seen.items() if resolved[name] != dtype
        }
        assert not wrong, (
            f"{policy.name or policy.rules}: resolve() disagrees with training: {wrong}"
        )
        table = {
            row["name"]: row["dtype"] for row in policy.layer_table(model, "cpu", example=batch)
        }
        assert {name: table[name] for name in seen} == seen
        share = policy.low_precision_share(model, "cpu", example=batch)
        assert share == pytest.approx(low_precision_share(model, {**resolved, **seen}))


@pytest.fixture
def nothing_watched(monkeypatch):
    """No knowledge from earlier tests: nothing watched on a batch or probed in this
    process, as in a fresh one, so no example can have taught ``resolve`` a class."""
    from autoprec import devices

    for store in ("_LEARNED", "_FAILS", "_PROBED"):
        monkeypatch.setattr(devices, store, {})


def _builtin_or_held_out(family):
    """A family's model (seeded) and one of its real batches."""
    torch.manual_seed(0)
    if family.startswith("tiny-"):
        task = load_task(family)
        return task.model(), task.first_val_batch()
    return held_out_transformers()[family](), Batch.of(token_batch())


_NO_EXAMPLE_FAMILIES = (
    ["tiny-gpt2", "tiny-bert", "tiny-llama", "tiny-t5", *sorted(held_out_transformers())]
    if _HAS_TRANSFORMERS
    else []
)


@pytest.mark.parametrize("hooks", ["forward", pytest.param("training", marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", _NO_EXAMPLE_FAMILIES)
def test_resolve_without_an_example_is_what_hooks_see(family, hooks, nothing_watched):
    """Without a batch, on the built-in transformers tasks and ten held-out families
    (their own RMSNorms that upcast inside, Gemma's that follows its input, LayerNorms
    reading an fp32 residual stream under plain autocast), under uniform bf16, uniform
    fp16 and mixed bf16/fp16 policies: ``resolve``, the layer table and the low-precision
    share say what hooks registered before ``apply`` see on a real batch (one forward
    without gradients; slow: a training step)."""
    model, batch = _builtin_or_held_out(family)
    names = {dtype: name for name, dtype in DTYPES.items()}
    for policy in low_policies(model, seed=_seed(family)):
        resolved = policy.resolve(model, "cpu")
        if hooks == "training":
            seen = _trained_dtypes(model, policy, batch.run)
        else:
            seen = {n: names[d] for n, d in _actual_dtypes(model, policy, batch).items()}
        assert seen and set(seen) <= set(resolved)
        wrong = {
            name: (resolved[name], dtype) for name, dtype in seen.items() if resolved[name] != dtype
        }
        assert not wrong, f"{policy.name or policy.rules}: resolve() disagrees with hooks: {wrong}"
        table = {row["name"]: row["dtype"] for row in policy.layer_table(model, "cpu")}
        assert table == resolved
        assert policy.low_precision_share(model, "cpu") == pytest.approx(
            low_precision_share(model, {**resolved, **seen})
        )


def test_layers_of_a_users_own_resolve_without_an_example(nothing_watched):
    """An upcasting norm, a scale that follows its input, a LayerNorm and a BatchNorm
    after it (both following their input): without a batch, resolve says what hooks see,
    and neither the probes nor the made-up forward change the model's state."""
    torch.manual_seed(0)
    model = _custom_model(batch_norm=True)
    model.train()
    example = _Example(torch.randn(5, 3, 8))
    leaves = [name for name, _ in parameterised_leaves(model)]
    for low in ("bf16", "fp16"):
        policies = [
            *_policies(model, low, seed=7),
            Policy(rules=(Rule(low, patterns=tuple(leaves)),)),
        ]
        for index, policy in enumerate(policies):
            state = {k: v.clone() for k, v in model.state_dict().items()}
            resolved = policy.resolve(model, "cpu")
            assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
            assert model.training
            actual = _actual_dtypes(model, policy, example)
            assert {n: DTYPES[d] for n, d in resolved.items()} == actual, (low, index)
    assert autocast_behaviour("cpu", model.norm) == "fp32"
    assert autocast_behaviour("cpu", model.scale) == "input"


class TwoInputs(nn.Module):
    """A layer of a user's own that takes two inputs: no input can be made for it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x + y).float() * self.weight


def test_a_layer_no_input_can_be_made_for_keeps_the_tables_word(nothing_watched):
    model = nn.Sequential(OrderedDict(fc=nn.Linear(4, 4), pair=TwoInputs()))
    assert Policy.uniform("bf16").resolve(model, "cpu") == {"fc": "bf16", "pair": "bf16"}
    assert autocast_behaviour("cpu", model.pair) == table_behaviour("cpu", model.pair)
