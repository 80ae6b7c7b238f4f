"""A policy's optimizer states from bitsandbytes (``optimizer: {library: bitsandbytes}``):
the YAML, the kinds it refuses, the builder against a hand-built bitsandbytes optimizer
with the same overrides, bit for bit, a resume, and the state's bytes as bitsandbytes
stores them above and below its 4,096-element minimum for 8-bit states.

What ran is bitsandbytes' CPU code (``bitsandbytes/backends/cpu``); its CUDA kernels never
ran here."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from autoprec.devices import EstimatedMemoryMeter
from autoprec.errors import PolicyError
from autoprec.optim.state import OptimizerStates, StateGroup, optimizer_state_nbytes
from autoprec.policy import Policy

bnb = pytest.importorskip("bitsandbytes")

EMBEDDINGS_FP32 = OptimizerStates(
    "8bit",
    groups=(StateGroup(types=("Embedding",), state="fp32", name="embeddings"),),
    library="bitsandbytes",
)
BLOCK = 256  # bitsandbytes' block for 8-bit blockwise states
QMAP_BYTES = 2 * 256 * 4  # its two code maps (signed, unsigned), one per optimizer


def make_model() -> nn.Module:
    """An embedding of 4,096 elements (8-bit by size, fp32 by the override), a Linear
    weight of 8,320 (8-bit, its last block partial) and two tensors under 4,096."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(64, 64), nn.Linear(64, 130), nn.ReLU(), nn.Linear(130, 8))


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, 64, (16,), generator=generator),
            torch.randint(0, 8, (16,), generator=generator),
        )
        for _ in range(count)
    ]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data: list) -> None:
    for x, y in data:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def hand_built(model: nn.Module, **hyperparameters) -> torch.optim.Optimizer:
    """bitsandbytes' recipe as its documentation writes it: 8-bit AdamW, the embedding's
    weight overridden to 32 bits."""
    manager = bnb.optim.GlobalOptimManager.get_instance()
    # Its overrides are keyed by id(param): an earlier test's freed parameter may have
    # left one on an id a parameter here now has (the hazard policy.optimizer avoids by
    # setting every parameter's bits). A user starting afresh starts from none.
    manager.initialize()
    manager.override_config(model[0].weight, "optim_bits", 32)
    return bnb.optim.AdamW8bit(model.parameters(), **hyperparameters)


def state_dtypes(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[torch.dtype]:
    return [optimizer.state[p]["state1"].dtype for p in model.parameters()]


def assert_identical(a: nn.Module, b: nn.Module) -> None:
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert x.dtype == y.dtype
        assert torch.equal(x, y)


# -- plain data -------------------------------------------------------------------------


def test_the_library_round_trips_and_old_yaml_is_unchanged():
    policy = Policy(optimizer_states=EMBEDDINGS_FP32, name="bnb")
    text = policy.to_yaml()
    assert "library: bitsandbytes" in text
    assert Policy.from_yaml(text) == policy
    torchao = Policy(optimizer_states=OptimizerStates("8bit"))
    assert "library" not in torchao.to_yaml()  # the default is not written
    assert Policy.from_yaml(torchao.to_yaml()).optimizer_states.library == "torchao"
    # Identities hash the section's repr: a torchao section's is what it was before.
    assert "library" not in repr(torchao.optimizer_states)
    # Another library's 8-bit states are another measurement.
    model = make_model()
    bnb_8bit = Policy(optimizer_states=OptimizerStates("8bit", library="bitsandbytes"))
    assert bnb_8bit.identity(model) != torchao.identity(model)
    # bitsandbytes' fp32 states are its own 32-bit step, not the user's optimizer.
    assert not OptimizerStates(library="bitsandbytes").all_fp32(model)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"library": "apex"}, r"optimizer.library: unknown library 'apex'"),
        ({"library": "bitsandbytes", "state": "4bit"}, r"optimizer.state: bitsandbytes"),
        (
            {
                "library": "bitsandbytes",
                "groups": [{"types": ["Linear"], "state": "fp8-bf16"}],
            },
            r"optimizer.groups\[0\].state: bitsandbytes implements fp32 and 8bit states",
        ),
        ({"library": "bitsandbytes", "master": "bf16"}, r"optimizer.master: bitsandbytes"),
    ],
)
def test_kinds_bitsandbytes_does_not_implement_are_refused_in_one_line(section, message):
    with pytest.raises(PolicyError, match=message) as caught:
        Policy.from_dict({"default": "fp32", "optimizer": section}, "p.yaml")
    assert "\n" not in str(caught.value)


def test_optimizers_bitsandbytes_cannot_follow_are_refused():
    policy = Policy(optimizer_states=EMBEDDINGS_FP32)
    with pytest.raises(PolicyError, match="SGD"):
        policy.optimizer(make_model(), torch.optim.SGD, lr=0.1)
    with pytest.raises(PolicyError, match="decays weights as AdamW"):
        policy.optimizer(make_model(), torch.optim.Adam, lr=0.1, weight_decay=0.1)
    with pytest.raises(PolicyError, match="amsgrad"):
        policy.optimizer(make_model(), torch.optim.AdamW, amsgrad=True)


def test_a_missing_bitsandbytes_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what a failed import gives
    with pytest.raises(PolicyError, match=r"bitsandbytes is not installed \(pip install"):
        Policy(optimizer_states=EMBEDDINGS_FP32).optimizer(make_model())


# -- against bitsandbytes itself --------------------------------------------------------


def test_the_policys_optimizer_is_bitsandbytes_with_the_same_overrides_bit_for_bit():
    data = batches(5)
    # Both models alive together: the manager keys overrides by id, which a freed
    # parameter's successor may reuse.
    direct, ours = make_model(), make_model()
    reference = hand_built(direct, lr=1e-2, weight_decay=0.05)
    optimizer = Policy(optimizer_states=EMBEDDINGS_FP32).optimizer(
        ours, torch.optim.AdamW, lr=1e-2, weight_decay=0.05
    )
    assert {type(part) for _, part in optimizer.parts} == {bnb.optim.AdamW8bit}
    train(direct, reference, data)
    train(ours, optimizer, data)
    assert_identical(direct, ours)
    f32, u8 = torch.float32, torch.uint8
    assert state_dtypes(reference, direct) == [f32, u8, f32, f32, f32]
    assert state_dtypes(optimizer, ours) == state_dtypes(reference, direct)
    for p, q in zip(direct.parameters(), ours.parameters(), strict=True):
        for key, value in reference.state[p].items():
            mine = optimizer.state[q][key]
            assert torch.equal(value, mine) if isinstance(value, torch.Tensor) else value == mine


def test_adam_without_weight_decay_is_bitsandbytes_adam8bit():
    data = batches(3)
    direct, ours = make_model(), make_model()
    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.initialize()  # no stale override (see hand_built)
    manager.override_config(direct[0].weight, "optim_bits", 32)
    reference = bnb.optim.Adam8bit(direct.parameters(), lr=3e-3)
    optimizer = Policy(optimizer_states=EMBEDDINGS_FP32).optimizer(
        ours, lambda params: torch.optim.Adam(params, lr=3e-3)
    )
    assert {type(part) for _, part in optimizer.parts} == {bnb.optim.Adam8bit}
    train(direct, reference, data)
    train(ours, optimizer, data)
    assert_identical(direct, ours)


def test_resume_from_a_checkpoint_equals_an_uninterrupted_run(tmp_path):
    data = batches(6)
    policy = Policy(optimizer_states=EMBEDDINGS_FP32)
    straight, first, resumed = make_model(), make_model(), make_model()
    train(straight, policy.optimizer(straight, torch.optim.AdamW, lr=1e-2), data)

    optimizer = policy.optimizer(first, torch.optim.AdamW, lr=1e-2)
    train(first, optimizer, data[:3])
    torch.save(
        {"model": first.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "c.pt"
    )
    checkpoint = torch.load(tmp_path / "c.pt", weights_only=True)
    resumed.load_state_dict(checkpoint["model"])
    optimizer = policy.optimizer(resumed, torch.optim.AdamW, lr=1e-2)
    optimizer.load_state_dict(checkpoint["optimizer"])
    train(resumed, optimizer, data[3:])
    assert_identical(straight, resumed)


# -- memory ------------------------------------------------------------------------------


@pytest.mark.parametrize("elements", [2560, 4095, 4096, 4097, 8192])
def test_state_bytes_above_and_below_the_8bit_minimum_are_counted_as_stored(elements):
    parameter = nn.Parameter(torch.randn(elements))
    optimizer = Policy(optimizer_states=OptimizerStates("8bit", library="bitsandbytes")).optimizer(
        nn.ParameterList([parameter])
    )
    parameter.grad = torch.randn(elements)
    optimizer.step()
    state = optimizer.state[parameter]
    if elements < 4096:  # bitsandbytes' min_8bit_size: two fp32 moments
        assert state["state1"].dtype == torch.float32
        expected = 2 * 4 * elements
    else:  # one byte a moment and element, an fp32 absmax a block of 256, the code maps
        assert state["state1"].dtype == torch.uint8
        blocks = -(-elements // BLOCK)
        expected = 2 * elements + 2 * 4 * blocks + QMAP_BYTES
    assert optimizer_state_nbytes(optimizer) == expected


def test_the_cpu_estimate_counts_bitsandbytes_states_as_stored():
    model = make_model()
    optimizer = Policy(optimizer_states=EMBEDDINGS_FP32).optimizer(model, lr=1e-2)
    train(model, optimizer, batches(1))
    embedding, weight = 64 * 64, 130 * 64
    small = sum(p.numel() for p in model.parameters()) - embedding - weight
    blocks = -(-weight // BLOCK)
    expected = 8 * (embedding + small) + 2 * weight + 2 * 4 * blocks + QMAP_BYTES
    assert optimizer_state_nbytes(optimizer) == expected
    meter = EstimatedMemoryMeter()
    meter.start(model)
    params_and_grads = sum(2 * p.nbytes for p in model.parameters())
    assert meter.peak_mb(model, optimizer) * 2**20 == pytest.approx(params_and_grads + expected)


def test_a_trials_optimizer_state_metric_is_bitsandbytes_bytes_as_stored():
    from autoprec.devices import get_backend
    from autoprec.tasks import Task
    from autoprec.trials.training import Budget, run_trial

    generator = torch.Generator().manual_seed(2)
    classes = torch.randint(0, 8, (64,), generator=generator)

    def train_data(seed: int):
        g = torch.Generator().manual_seed(seed)
        while True:
            tokens = torch.randint(0, 64, (16,), generator=g)
            yield tokens, classes[tokens]

    task = Task(
        "tokens",
        make_model,
        train_data,
        lambda: [(torch.arange(64), classes)],
        nn.functional.cross_entropy,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
    )
    policy = Policy(optimizer_states=EMBEDDINGS_FP32)
    result = run_trial(task, policy, get_backend("cpu"), Budget(steps=4, warmup_steps=1))
    assert result.state.name == "COMPLETE", result.reason
    embedding, weight = 64 * 64, 130 * 64
    small = 130 + 130 * 8 + 8
    stored = 8 * (embedding + small) + 2 * weight + 2 * 4 * -(-weight // BLOCK) + QMAP_BYTES
    assert result.optimizer_state_mb * 2**20 == pytest.approx(stored, rel=1e-12)


# -- the states' health -----------------------------------------------------------------


def test_state_health_reads_bitsandbytes_moments_and_names_a_collapse():
    """bitsandbytes keeps Adam's moments as ``state1``/``state2`` (8-bit codes, read back
    through its own blockwise dequantisation): healthy after training, and a second moment
    set to its zero code under a live first moment is a collapse, named."""
    from autoprec.numerics.state_health import state_health

    model = make_model()
    optimizer = Policy(optimizer_states=EMBEDDINGS_FP32).optimizer(model, lr=1e-3)
    train(model, optimizer, batches(4))
    health = {h.parameter: h for h in state_health(model, optimizer)}
    assert health["0.weight"].stored_as == "torch.float32"  # the override: 32 bits
    assert health["1.weight"].stored_as == "bitsandbytes 8-bit"
    assert all(h.reason() is None for h in health.values())
    state = optimizer.state[model[1].weight]
    zero_code = int(torch.nonzero(state["qmap2"] == 0)[0])
    live = state["state1"][0] != int(torch.argmin(state["qmap1"].abs()))  # nonzero exp_avg
    state["state2"][0][live] = zero_code  # row 0's second moment stored as 0
    collapsed = {h.parameter: h for h in state_health(model, optimizer)}["1.weight"]
    assert collapsed.collapsed_share == pytest.approx(int(live.sum()) / model[1].weight.numel())
    reason = collapsed.reason()
    assert reason is not None and "bitsandbytes 8-bit" in reason and "1.weight" in reason
