"""A policy in PyTorch Lightning: PolicyPrecision in a Trainer (layers in their dtypes, the loss
going down, the loss scale in the checkpoint and back on resume, overflowing steps skipped,
clipping on true gradients), and PolicyFabricPrecision in a Fabric loop."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from autoprec import Policy
from autoprec.errors import PolicyError
from autoprec.tasks import load_task
from tests.contract_tasks import make_tiny_task

pl = pytest.importorskip(
    "lightning.pytorch", reason="the Lightning integration needs: pip install 'autoprec[lightning]'"
)
from lightning.fabric import Fabric  # noqa: E402

from autoprec.integrations.lightning import PolicyFabricPrecision, PolicyPrecision  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers:UserWarning",
    "ignore:.*GPU available but not used:UserWarning",
    "ignore:The dirpath has changed:UserWarning",  # resuming into another folder, on purpose
)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def mixed(loss_scale: dict) -> Policy:
    """The first layer in fp16, the second in bf16, the head in fp32."""
    return Policy.from_dict(
        {
            "name": "mixed",
            "default": "fp32",
            "rules": [
                {"patterns": ["net.0"], "dtype": "fp16"},
                {"patterns": ["net.2"], "dtype": "bf16"},
            ],
            "loss_scale": loss_scale,
        }
    )


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models step many times faster on one thread than on two shared, busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


DYNAMIC = {"mode": "dynamic", "init_scale": 1024.0, "growth_interval": 1}


def loader(batches: int = 8) -> DataLoader:
    """Random inputs labelled by a random linear rule: learnable in a few dozen steps."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32 * batches, 16, generator=generator)
    labels = (x @ torch.randn(16, 2, generator=generator)).argmax(1)
    return DataLoader(TensorDataset(x, labels), batch_size=32)


class MLP(pl.LightningModule):
    def __init__(self, optimizer: type[torch.optim.Optimizer] = torch.optim.Adam) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2)
        )
        self.optimizer = optimizer
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, labels = batch
        loss = F.cross_entropy(self(x).float(), labels)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return self.optimizer(self.parameters(), lr=1e-2)


def trainer(tmp_path, plugin, max_steps: int, **kwargs) -> pl.Trainer:
    """A quiet CPU Trainer with ``plugin`` (None: Lightning's own, as ``kwargs`` say)."""
    return pl.Trainer(
        plugins=[] if plugin is None else [plugin],
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=True,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kwargs,
    )


def record_dtypes(model: nn.Module, names: list[str]) -> dict[str, set[torch.dtype]]:
    """Forward hooks, registered before the policy is applied, that collect output dtypes."""
    seen: dict[str, set[torch.dtype]] = {name: set() for name in names}
    for name in names:
        model.get_submodule(name).register_forward_hook(
            lambda module, args, out, name=name: seen[name].add(out.dtype)
        )
    return seen


def test_mixed_policy_trains_and_its_loss_scale_survives_a_resume(tmp_path):
    policy = mixed(DYNAMIC)
    model = MLP()
    seen = record_dtypes(model, ["net.0", "net.2", "net.4"])
    plugin = PolicyPrecision(policy)
    first = trainer(tmp_path, plugin, max_steps=24)  # 3 epochs of 8 batches
    first.fit(model, loader())

    resolved = policy.resolve(model, "cpu")
    assert resolved == {"net.0": "fp16", "net.2": "bf16", "net.4": "fp32"}
    assert seen == {name: {DTYPES[dtype]} for name, dtype in resolved.items()}
    assert sum(model.losses[-4:]) < 0.6 * sum(model.losses[:4]), model.losses

    checkpoint = torch.load(first.checkpoint_callback.best_model_path, weights_only=False)
    saved = checkpoint["PolicyPrecision"]["loss_scaler"]
    assert saved["scale"] == plugin.loss_scale != DYNAMIC["init_scale"]

    scales = []

    class RecordScale(pl.Callback):
        def on_train_start(self, trainer, module):
            scales.append(trainer.precision_plugin.loss_scale)

    resumed = trainer(
        tmp_path / "resumed", PolicyPrecision(policy), max_steps=26, callbacks=[RecordScale()]
    )
    resumed.fit(MLP(), loader(), ckpt_path=first.checkpoint_callback.best_model_path)
    assert scales == [saved["scale"]]
    assert resumed.global_step == 26


def test_trainer_precision_flag_is_refused_beside_the_plugin():
    with pytest.raises(ValueError, match=r"Received both `precision=bf16-mixed`.*'mixed'"):
        pl.Trainer(precision="bf16-mixed", plugins=[PolicyPrecision(mixed(DYNAMIC))])


def test_every_step_overflowing_is_skipped(tmp_path):
    model = MLP()
    before = copy.deepcopy(model.state_dict())
    plugin = PolicyPrecision(mixed({"mode": "static", "init_scale": 2.0**40}))
    run = trainer(tmp_path, plugin, max_steps=4)
    run.fit(model, loader())
    assert len(model.losses) == 4
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not run.optimizers[0].state  # Adam never stepped
    assert plugin.loss_scale == 2.0**40


def test_clipping_sees_unscaled_gradients(tmp_path):
    norms = []

    class RecordingSGD(torch.optim.SGD):
        def step(self, closure=None):
            grads = [p.grad for group in self.param_groups for p in group["params"]]
            norms.append(float(torch.nn.utils.get_total_norm(grads)))
            return super().step(closure)

    plugin = PolicyPrecision(mixed({"mode": "static", "init_scale": 2.0**12}))
    run = trainer(tmp_path, plugin, max_steps=3, gradient_clip_val=1e-3)
    run.fit(MLP(RecordingSGD), loader())
    assert len(norms) == 3
    assert norms == pytest.approx([1e-3] * 3, rel=1e-3)  # not 1e-3 / 2**12


def test_fabric_loop_runs_the_policy_and_keeps_the_scale(tmp_path):
    policy = mixed(DYNAMIC)
    net = MLP()
    seen = record_dtypes(net, ["net.0", "net.2", "net.4"])
    plugin = PolicyFabricPrecision(policy)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    losses = []
    for _ in range(3):
        for x, labels in loader():
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x).float(), labels)
            fabric.backward(loss)
            # Overflowing steps (the scale grows every step) are skipped: no error on them.
            fabric.clip_gradients(model, optimizer, max_norm=10.0, error_if_nonfinite=False)
            optimizer.step()
            losses.append(loss.item())
    assert seen == {"net.0": {torch.float16}, "net.2": {torch.bfloat16}, "net.4": {torch.float32}}
    assert sum(losses[-4:]) < 0.6 * sum(losses[:4]), losses
    assert plugin.loss_scale != DYNAMIC["init_scale"]
    # Outputs come back in fp32, as Fabric's MixedPrecision hands them.
    low = PolicyFabricPrecision(Policy.uniform("bf16"))
    bf16_model = Fabric(accelerator="cpu", devices=1, plugins=[low]).setup(MLP())
    assert bf16_model(next(iter(loader()))[0]).dtype == torch.float32
    low.teardown()

    fabric.save(tmp_path / "state.ckpt", {"model": model, "precision": plugin})
    again = PolicyFabricPrecision(policy)
    fabric.load(tmp_path / "state.ckpt", {"precision": again}, strict=False)
    assert again.state_dict() == plugin.state_dict()


# -- a LightningModule that holds the searched model -----------------------------------------

# What a search on digits-mlp writes: rules that name the task model's own layers.
DIGITS_POLICY = {
    "name": "digits-found",
    "default": "bf16",
    "rules": [
        {"name": "fc2", "patterns": ["fc2"], "dtype": "fp16"},
        {"name": "head", "patterns": ["head"], "dtype": "fp32"},
    ],
    "loss_scale": DYNAMIC,
}


def digits_loader(batches: int = 4) -> DataLoader:
    """The digits-mlp task's own first batches."""
    stream = iter(load_task("digits-mlp").train_data(0))
    x, labels = zip(*(next(stream) for _ in range(batches)), strict=True)
    return DataLoader(TensorDataset(torch.cat(x), torch.cat(labels)), batch_size=64)


class Classifier(pl.LightningModule):
    """A user's LightningModule around the searched model(s): ``self.net`` (and, with
    ``teacher``, a second copy of it, which makes the policy's place ambiguous)."""

    def __init__(self, teacher: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        task = load_task("digits-mlp")
        self.net = task.model()
        self.teacher = task.model() if teacher else None
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, labels = batch
        loss = F.cross_entropy(self.net(x).float(), labels)
        if self.teacher is not None:
            loss = loss + F.mse_loss(self.teacher(x).float(), self.net(x).float().detach())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def searched_dtypes(policy: Policy, prefix: str) -> dict[str, torch.dtype]:
    """The dtype of each layer of the task model as the policy resolves it there, named as
    it sits in the wrapper."""
    resolved = policy.resolve(load_task("digits-mlp").model(), "cpu")
    return {f"{prefix}.{name}": DTYPES[dtype] for name, dtype in resolved.items()}


def own_forwards(model: nn.Module) -> list[str]:
    """Modules whose forward is replaced (a region installed)."""
    return [name for name, module in model.named_modules() if "forward" in module.__dict__]


def test_policy_found_on_the_wrapped_task_model_trains_in_its_dtypes(tmp_path, caplog):
    policy = Policy.from_dict(DIGITS_POLICY)
    expected = searched_dtypes(policy, "net")
    assert set(expected.values()) == {torch.bfloat16, torch.float16, torch.float32}
    model = Classifier()
    seen = record_dtypes(model, list(expected))
    with caplog.at_level("WARNING", logger="autoprec"):
        trainer(tmp_path, PolicyPrecision(policy), max_steps=16).fit(model, digits_loader())
    assert seen == {name: {dtype} for name, dtype in expected.items()}
    assert sum(model.losses[-4:]) < 0.6 * sum(model.losses[:4]), model.losses
    lines = [r.getMessage() for r in caplog.records if r.name == "autoprec"]
    assert lines == [
        "autoprec: policy digits-found applied to submodule 'net' (Sequential, 5 layers)"
    ]
    assert own_forwards(model) == []  # the regions came off when fit ended


def test_two_fitting_submodules_ask_for_module_and_module_settles_it(tmp_path):
    policy = Policy.from_dict(DIGITS_POLICY)
    with pytest.raises(PolicyError, match=r"several submodules of Classifier \('net', 'teacher'\)"):
        trainer(tmp_path, PolicyPrecision(policy), max_steps=1).fit(
            Classifier(teacher=True), digits_loader()
        )

    model = Classifier(teacher=True)
    expected = searched_dtypes(policy, "teacher")
    teacher = record_dtypes(model, list(expected))
    student = record_dtypes(model, [name.replace("teacher.", "net.") for name in expected])
    plugin = PolicyPrecision(policy, module="teacher")
    trainer(tmp_path / "named", plugin, max_steps=2).fit(model, digits_loader())
    assert teacher == {name: {dtype} for name, dtype in expected.items()}
    assert all(dtypes == {torch.float32} for dtypes in student.values()), student


def test_fabric_applies_the_policy_to_the_wrapped_model_and_removes_it(tmp_path):
    policy = Policy.from_dict(DIGITS_POLICY)
    expected = searched_dtypes(policy, "net")
    wrapper = Classifier()
    seen = record_dtypes(wrapper, list(expected))
    plugin = PolicyFabricPrecision(policy)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, optimizer = fabric.setup(wrapper, torch.optim.Adam(wrapper.parameters(), lr=1e-2))
    for x, labels in digits_loader(batches=2):
        optimizer.zero_grad()
        fabric.backward(F.cross_entropy(model(x).float(), labels))
        optimizer.step()
    assert seen == {name: {dtype} for name, dtype in expected.items()}
    assert own_forwards(wrapper) == ["net", "net.fc1", "net.norm1", "net.norm2", "net.head"]
    plugin.teardown()
    assert own_forwards(wrapper) == []


class TinyTaskModule(pl.LightningModule):
    """The tiny task's model (tests/contract_tasks.py) held as ``self.net``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = make_tiny_task().model()

    def training_step(self, batch, batch_idx):
        x, labels = batch
        return F.cross_entropy(self.net(x).float(), labels)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def test_the_policies_of_a_real_search_land_on_the_searched_model_inside(tmp_path, finished):
    _, result = finished
    policies = [Policy.from_dict(trial["policy"]) for trial in result.summary["trials"]]
    policies = [policy for policy in policies if policy.rules] + [result.best_policy]
    assert len(policies) > 1  # the search wrote rules naming the task model's layers
    stream = make_tiny_task().train_data(0)
    x, labels = zip(*(next(stream) for _ in range(2)), strict=True)
    data = DataLoader(TensorDataset(torch.cat(x), torch.cat(labels)), batch_size=32)
    for i, policy in enumerate(policies):
        resolved = policy.resolve(make_tiny_task().model(), "cpu")
        model = TinyTaskModule()
        seen = record_dtypes(model, [f"net.{name}" for name in resolved])
        trainer(tmp_path / str(i), PolicyPrecision(policy), max_steps=2).fit(model, data)
        assert seen == {f"net.{name}": {DTYPES[dtype]} for name, dtype in resolved.items()}
        assert own_forwards(model) == []


class NormedMLP(MLP):
    """A pre-norm residual MLP: LayerNorm reads the fp32 stream (on the CPU, bf16-mixed runs
    it in fp32 there)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 64)
        self.norm = nn.LayerNorm(64)
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).float()
        return self.head(h + self.net(self.norm(h)).float())


def test_uniform_bf16_is_lightnings_bf16_mixed(tmp_path):
    """PolicyPrecision with uniform bf16 and Lightning's precision="bf16-mixed" on the same
    model and data: the same losses step by step and the same weights, bit for bit."""
    runs = []
    for plugin in (None, PolicyPrecision(Policy.uniform("bf16"))):
        module = NormedMLP()
        own = {"precision": "bf16-mixed"} if plugin is None else {}
        trainer(tmp_path, plugin, 12, **own).fit(module, loader())
        runs.append((module.losses, copy.deepcopy(module.state_dict())))
    (own_losses, own_weights), (losses, weights) = runs
    assert len(losses) == 12 and losses == own_losses
    for key, tensor in own_weights.items():
        torch.testing.assert_close(weights[key], tensor, rtol=0, atol=0)
