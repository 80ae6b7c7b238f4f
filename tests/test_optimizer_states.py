"""The policy's optimizer states per parameter group: YAML, the layer table, the builder
against torchao itself, checkpoints, and the memory count.

torchao's optimizers compile their step on first use (tens of seconds here); the tests
share one model shape so that the compiled steps are reused within the session."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoprec
from autoprec.devices import EstimatedMemoryMeter
from autoprec.errors import PolicyError
from autoprec.optim.optimizer import PolicyOptimizer
from autoprec.optim.state import OptimizerStates, StateGroup, optimizer_state_nbytes
from autoprec.policy import Policy

torchao_optim = pytest.importorskip("torchao.optim")

EMBEDDINGS_FP32 = OptimizerStates(
    "8bit", groups=(StateGroup(types=("Embedding",), state="fp32", name="embeddings"),)
)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(64, 64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


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
        nn.functional.cross_entropy(model(x).float(), y).backward()
        optimizer.step()


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype
        assert torch.equal(x, y)


# -- plain data -------------------------------------------------------------------------


def test_optimizer_section_round_trips_and_old_yaml_is_unchanged():
    policy = Policy(rules=(), optimizer_states=EMBEDDINGS_FP32, name="emb-fp32")
    text = policy.to_yaml()
    assert "optimizer:" in text and "state: 8bit" in text
    assert Policy.from_yaml(text) == policy
    old = "default: bf16\nrules: []\nloss_scale:\n  mode: none\n"
    assert "optimizer" not in Policy.from_yaml(old).to_yaml()
    assert Policy.from_yaml(old).optimizer_states.is_default
    # A policy with default states measures what it measured before the section existed.
    assert Policy.from_yaml(old).identity() == Policy(default="bf16").identity()
    assert policy.identity() != Policy(name="emb-fp32").identity()
    # States all fp32, however written, measure what no section measures.
    fp32_groups = OptimizerStates(groups=(StateGroup(types=("Embedding",), state="fp32"),))
    assert Policy(optimizer_states=fp32_groups).identity(make_model()) == Policy().identity(
        make_model()
    )


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"state": "int3"}, "optimizer.state"),
        ({"master": "fp16"}, "optimizer.master"),
        ({"groups": [{"types": ["Embedding"], "state": "2bit"}]}, "optimizer.groups[0].state"),
        ({"groups": [{"types": ["Embedding"]}]}, "optimizer.groups[0]"),
        ({"groups": [{"state": "fp32"}]}, "optimizer.groups[0]"),
        ({"moments": "fp8"}, "optimizer.moments"),
    ],
)
def test_bad_optimizer_section_names_the_field(section, field):
    with pytest.raises(PolicyError, match=field.replace("[", r"\[").replace("]", r"\]")):
        Policy.from_dict({"default": "fp32", "optimizer": section}, "p.yaml")


def test_layer_table_and_resolve_states_show_each_groups_state():
    policy = Policy(optimizer_states=EMBEDDINGS_FP32)
    model = make_model()
    table = {row["name"]: row for row in policy.layer_table(model)}
    assert table["0"]["state"] == "fp32"
    assert table["1"]["state"] == table["3"]["state"] == "8bit"
    states = policy.resolve_states(model)
    assert states["0.weight"].state == "fp32" and states["1.bias"].state == "8bit"
    assert "state" not in Policy().layer_table(model)[0]  # the table is as before


def test_a_group_matching_no_parameter_is_refused():
    states = OptimizerStates("8bit", groups=(StateGroup(types=("Conv2d",), state="fp32"),))
    with pytest.raises(PolicyError, match=r"optimizer.groups\[0\].*matches no trainable"):
        Policy(optimizer_states=states).optimizer(make_model())


def test_quantised_states_need_adam():
    policy = Policy(optimizer_states=OptimizerStates("8bit"))
    with pytest.raises(PolicyError, match="SGD"):
        policy.optimizer(make_model(), torch.optim.SGD, lr=0.1)


# -- against torchao itself ------------------------------------------------------------


def test_uniform_8bit_is_torchaos_adamw8bit_bit_for_bit():
    data = batches(4)
    direct = make_model()
    train(direct, torchao_optim.AdamW8bit(direct.parameters(), lr=1e-2), data)
    ours = make_model()
    optimizer = Policy(optimizer_states=OptimizerStates("8bit")).optimizer(
        ours, torch.optim.AdamW, lr=1e-2
    )
    assert [type(part) for _, part in optimizer.parts] == [torchao_optim.AdamW8bit]
    train(ours, optimizer, data)
    assert_identical(weights(direct), weights(ours))


def test_embeddings_in_fp32_are_torch_adamw_beside_torchao_8bit_bit_for_bit():
    """The bitsandbytes recipe, as a user writes it by hand with torch and torchao."""
    data = batches(4)
    by_hand = make_model()
    embedding = list(by_hand[0].parameters())
    rest = [p for p in by_hand.parameters() if all(p is not e for e in embedding)]
    fp32 = torch.optim.AdamW(embedding, lr=1e-2, weight_decay=0.0)
    eight = torchao_optim.AdamW8bit(rest, lr=1e-2, weight_decay=0.0)
    for x, y in data:
        fp32.zero_grad()
        eight.zero_grad()
        nn.functional.cross_entropy(by_hand(x), y).backward()
        fp32.step()
        eight.step()
    ours = make_model()
    optimizer = Policy(optimizer_states=EMBEDDINGS_FP32).optimizer(
        ours, torch.optim.AdamW, lr=1e-2, weight_decay=0.0
    )
    train(ours, optimizer, data)
    assert_identical(weights(by_hand), weights(ours))
    # Where torchao quantises (4096 elements and more), the state is its 8-bit subclass.
    assert type(optimizer.state[ours[1].weight]["exp_avg"]).__name__ == "OptimState8bit"
    assert optimizer.state[ours[0].weight]["exp_avg"].dtype == torch.float32
    assert optimizer.state[ours[3].weight]["exp_avg"].dtype == torch.float32  # 512 elements


def test_a_task_factory_gives_the_class_and_defaults():
    data = batches(2)
    direct = make_model()
    train(direct, torchao_optim.Adam8bit(direct.parameters(), lr=3e-3), data)
    ours = make_model()
    optimizer = Policy(optimizer_states=OptimizerStates("8bit")).optimizer(
        ours, lambda params: torch.optim.Adam(params, lr=3e-3)
    )
    assert type(optimizer.parts[0][1]) is torchao_optim.Adam8bit
    train(ours, optimizer, data)
    assert_identical(weights(direct), weights(ours))


def test_resume_from_a_checkpoint_equals_an_uninterrupted_run(tmp_path):
    data = batches(6)
    policy = Policy(optimizer_states=EMBEDDINGS_FP32)
    straight = make_model()
    train(straight, policy.optimizer(straight, torch.optim.AdamW, lr=1e-2), data)

    first = make_model()
    optimizer = policy.optimizer(first, torch.optim.AdamW, lr=1e-2)
    train(first, optimizer, data[:3])
    torch.save(
        {"model": first.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "c.pt"
    )
    checkpoint = torch.load(tmp_path / "c.pt", weights_only=True)
    resumed = make_model()
    resumed.load_state_dict(checkpoint["model"])
    optimizer = policy.optimizer(resumed, torch.optim.AdamW, lr=1e-2)
    optimizer.load_state_dict(checkpoint["optimizer"])
    train(resumed, optimizer, data[3:])
    assert_identical(weights(straight), weights(resumed))


def test_a_checkpoint_of_other_states_is_refused():
    model = make_model()
    eight = Policy(optimizer_states=OptimizerStates("8bit")).optimizer(model)
    other = Policy(optimizer_states=EMBEDDINGS_FP32).optimizer(make_model())
    with pytest.raises(PolicyError, match="saved for training states"):
        other.load_state_dict(eight.state_dict())


def test_a_scheduler_reaches_every_part():
    model = make_model()
    optimizer = Policy(optimizer_states=EMBEDDINGS_FP32).optimizer(model, lr=1e-2)
    assert isinstance(optimizer, PolicyOptimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    train(model, optimizer, batches(1))
    scheduler.step()
    lrs = [float(part.param_groups[0]["lr"]) for _, part in optimizer.parts]
    assert lrs == pytest.approx([5e-3, 5e-3], rel=1e-6)  # torchao keeps lr as an fp32 tensor


# -- memory ------------------------------------------------------------------------------


def test_the_cpu_estimate_counts_8bit_states_as_torchao_stores_them():
    model = make_model()
    optimizer = Policy(optimizer_states=OptimizerStates("8bit")).optimizer(model, lr=1e-2)
    train(model, optimizer, batches(1))
    stored = 0
    for state in optimizer.state.values():
        for value in state.values():
            if type(value).__name__ == "OptimState8bit":
                stored += sum(getattr(value, a).nbytes for a in ("codes", "scale", "qmap"))
            else:
                stored += value.nbytes
    assert optimizer_state_nbytes(optimizer) == stored
    # Embedding and first Linear weight quantised: 1 byte a moment and element, plus scales.
    assert stored < 4 * 2 * sum(p.numel() for p in model.parameters()) / 2
    meter = EstimatedMemoryMeter()
    meter.start(model)
    params_and_grads = sum(2 * p.nbytes for p in model.parameters())
    assert meter.peak_mb(model, optimizer) * 2**20 == pytest.approx(params_and_grads + stored)


@pytest.mark.slow
@pytest.mark.parametrize("state", ["4bit", "fp8", "bf16", "fp8-bf16"])
def test_every_state_kind_trains_and_is_counted(state):
    model = make_model()
    optimizer = Policy(optimizer_states=OptimizerStates(state)).optimizer(model, lr=1e-2)
    before = weights(model)
    train(model, optimizer, batches(2))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, weights(model), strict=True))
    fp32_bytes = 8 * sum(p.numel() for p in model.parameters())
    assert optimizer_state_nbytes(optimizer) < fp32_bytes


@pytest.mark.slow
def test_bf16_master_is_torchaos_stochastic_rounding_bit_for_bit():
    data = batches(3)
    direct = make_model().to(torch.bfloat16)
    torch.manual_seed(5)
    train(
        direct, torchao_optim._AdamW(direct.parameters(), lr=1e-2, bf16_stochastic_round=True), data
    )
    ours = make_model()
    policy = Policy(optimizer_states=OptimizerStates("bf16", "bf16"))
    optimizer = policy.optimizer(ours, torch.optim.AdamW, lr=1e-2)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    torch.manual_seed(5)
    train(ours, optimizer, data)
    assert_identical(weights(direct), weights(ours))
    # fp32 moments beside a bf16 master: the moments stay fp32.
    kept = make_model()
    optimizer = Policy(optimizer_states=OptimizerStates("fp32", "bf16")).optimizer(kept)
    train(kept, optimizer, data[:1])
    assert kept[1].weight.dtype == torch.bfloat16
    assert optimizer.state[kept[1].weight]["exp_avg"].dtype == torch.float32


def test_public_surface_keeps_policy_optimizer():
    assert callable(autoprec.Policy.optimizer)


# -- searched ----------------------------------------------------------------------------

STATE_SPACE = {
    "name": "states",
    "dtypes": ["fp32", "bf16"],
    "groups": [{"name": "all", "patterns": ["*"]}],
    "optimizer_states": {
        "states": ["fp32", "8bit", "4bit", "fp8-bf16"],
        "groups": [
            {"name": "embeddings", "types": ["Embedding"]},
            {"name": "rest", "patterns": ["*"]},
        ],
    },
}


def test_a_space_searches_states_per_group_beside_the_layer_dtypes():
    import optuna

    from autoprec.space import SearchSpace, policy_label

    space = SearchSpace.from_dict(STATE_SPACE, "states.yaml").fit(make_model())
    policy = space.suggest(
        optuna.trial.FixedTrial(
            {"dtype.all": "bf16", "state.embeddings": "fp32", "state.rest": "4bit"}
        )
    )
    states = policy.resolve_states(make_model())
    assert states["0.weight"].state == "fp32" and states["3.weight"].state == "4bit"
    assert policy.resolve(make_model())["1"] == "bf16"
    flat = space.flat_params(policy)
    assert flat["state.embeddings"] == "fp32" and flat["state.rest"] == "4bit"
    assert "state.rest=4bit" in policy_label(flat)
    assert Policy.from_yaml(policy.to_yaml()) == policy
    anchors = space.anchors()
    assert anchors["states-8bit-embeddings-fp32"]["state.embeddings"] == "fp32"
    assert anchors["states-8bit-embeddings-fp32"]["state.rest"] == "8bit"
    assert set(anchors["states-msamp-o2"].values()) >= {"fp8-bf16"}
    assert anchors["states-msamp-o2"]["dtype.all"] == "fp32"
    # All states in fp32 with fp32 layers is what the baseline measures.
    baseline = space.policy(space.uniform_params("fp32"))
    assert all(s.state == "fp32" for s in baseline.resolve_states(make_model()).values())
    # Without the section a space searches and fingerprints as before.
    plain = {k: v for k, v in STATE_SPACE.items() if k != "optimizer_states"}
    plain_space = SearchSpace.from_dict(plain, "plain.yaml").fit(make_model())
    assert plain_space.fingerprint() != space.fingerprint()
    assert plain_space.suggest(
        optuna.trial.FixedTrial({"dtype.all": "fp32"})
    ).optimizer_states.is_default


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"states": ["int2"]}, "optimizer_states.states"),
        ({"groups": [{"name": "e", "types": ["Conv2d"]}]}, r"optimizer_states.groups\[0\] \(e\)"),
        ({"groups": [{"name": "e"}]}, r"optimizer_states.groups\[0\]"),
        ({"moments": []}, "optimizer_states.moments"),
    ],
)
def test_bad_state_section_names_the_field(section, field):
    from autoprec.errors import SpaceError
    from autoprec.space import SearchSpace

    with pytest.raises(SpaceError, match=field):
        SearchSpace.from_dict({**STATE_SPACE, "optimizer_states": section}, "s.yaml").fit(
            make_model()
        )


# -- what quantised states lose --------------------------------------------------------


def test_a_rare_row_beside_frequent_ones_collapses_in_8bit_and_is_named():
    """A row whose one gradient is 1e-4 of its block's others: its exp_avg_sq (1e-8 of
    the block's largest) is below the 8-bit map's smallest code, its exp_avg is not, so
    the next updates are lr * exp_avg / eps. fp32 states keep it."""
    from autoprec.numerics.state_health import state_health

    def run(states: OptimizerStates) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = make_model()
        optimizer = Policy(optimizer_states=states).optimizer(model, lr=1e-2, weight_decay=0.0)
        for step in range(3):
            grad = torch.zeros(64, 64)
            grad[::4] = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))
            if step == 0:
                grad[1] = 1e-4
            for parameter in model.parameters():
                parameter.grad = torch.zeros_like(parameter)
            model[0].weight.grad = grad
            optimizer.step()
        return model, optimizer

    start = make_model()[0].weight[1].detach().clone()
    fp32_model, fp32_optimizer = run(OptimizerStates())
    eight_model, eight_optimizer = run(OptimizerStates("8bit"))
    assert (fp32_model[0].weight[1] - start).abs().max() < 0.05
    assert (eight_model[0].weight[1] - start).abs().max() > 10.0
    health = {h.parameter: h for h in state_health(eight_model, eight_optimizer)}
    # Entries of the rare row only (64 of the 4,096), not necessarily all: how many land
    # below the map's smallest code moves with the CPU's kernels (half of them where
    # oneDNN is held to AVX2).
    assert 0 < health["0.weight"].collapsed_share <= 64 / 4096
    reason = health["0.weight"].reason()
    assert reason is not None and "0.weight (Embedding, OptimState8bit" in reason
    assert all(h.reason() is None for h in state_health(fp32_model, fp32_optimizer))


@pytest.mark.skipif(torch.cuda.is_available(), reason="refuses only without CUDA")
def test_the_gpu_script_refuses_without_cuda_in_one_line():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_optimizer_states.py"
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 2
    assert done.stdout == ""
    lines = [line for line in done.stderr.splitlines() if "gpu_optimizer_states.py:" in line]
    assert lines == ["gpu_optimizer_states.py: needs a CUDA GPU (or --smoke on the CPU)"]


@pytest.mark.slow
@pytest.mark.parametrize(("state", "master"), [("bf16", "fp32"), ("fp32", "bf16")])
def test_moments_of_another_dtype_than_the_weight_resume_as_saved(tmp_path, state, master):
    """torch's load_state_dict casts plain state tensors to their parameter's dtype; fp32
    moments of a bf16 master (and bf16 moments of an fp32 one) must come back as saved."""
    data = batches(4)
    policy = Policy(optimizer_states=OptimizerStates(state, master))
    straight = make_model()
    torch.manual_seed(7)
    train(straight, policy.optimizer(straight, lr=1e-2), data)

    first = make_model()
    optimizer = policy.optimizer(first, lr=1e-2)
    torch.manual_seed(7)
    train(first, optimizer, data[:2])
    rng = torch.get_rng_state()
    torch.save(
        {"model": first.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "c.pt"
    )
    checkpoint = torch.load(tmp_path / "c.pt", weights_only=True)
    resumed = make_model()
    optimizer = policy.optimizer(resumed, lr=1e-2)
    resumed.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    moments = optimizer.state[resumed[1].weight]["exp_avg"]
    assert moments.dtype == (torch.bfloat16 if state == "bf16" else torch.float32)
    torch.set_rng_state(rng)  # stochastic rounding draws from torch's generator
    train(resumed, optimizer, data[2:])
    assert_identical(weights(straight), weights(resumed))


def test_lightning_configure_optimizers_from_the_policy_trains_as_a_plain_loop(tmp_path):
    """Lightning steps the policy's optimizer with its closure: the same weights as a loop."""
    pl = pytest.importorskip("lightning.pytorch")
    data = batches(3)
    policy = Policy(optimizer_states=EMBEDDINGS_FP32)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def training_step(self, batch, index):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return policy.optimizer(self.net, torch.optim.AdamW, lr=1e-2)

    module = Module()
    trainer = pl.Trainer(
        max_steps=len(data),
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    from torch.utils.data import DataLoader

    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=None))
    plain = make_model()
    train(plain, policy.optimizer(plain, torch.optim.AdamW, lr=1e-2), data)
    assert_identical(weights(plain), weights(module.net))


def test_group_of_names_the_first_group_that_takes_a_parameter():
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4))
    states = OptimizerStates(
        groups=(
            StateGroup(types=("Embedding",), state="fp32", name="embeddings"),
            StateGroup(patterns=("*",), state="8bit", name="rest"),
        )
    )
    assert states.group_of(model, "0.weight").name == "embeddings"
    assert states.group_of(model, "1.bias").name == "rest"
    assert OptimizerStates(groups=states.groups[:1]).group_of(model, "1.weight") is None
