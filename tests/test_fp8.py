"""fp8 Linear layers in training (torchao's float8, emulated on the CPU): a policy's fp8
layers train as torchao's own conversion trains them, come off again, resolve as fp8, and
what cannot run is refused in one line before anything trains."""

from __future__ import annotations

import subprocess
import sys
from collections import OrderedDict

import pytest
import torch
import yaml
from torch import nn

import autoprec
from autoprec import Policy, Rule, load_policy
from autoprec.devices import get_backend
from autoprec.errors import DeviceError, PolicyError, SpaceError
from autoprec.formats.fp8 import FP8_RECIPES
from autoprec.policy import Quantization
from autoprec.space import SearchSpace
from tests.cpu_fp8 import trains_fp8

torchao_float8 = pytest.importorskip("torchao.float8")
STEPS = 6
FP8_LAYERS = ("fc1", "block.fc")


def mlp() -> nn.Module:
    """Linear dimensions all multiples of 16 (torch._scaled_mm's), a norm and a block."""
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(32, 64),
            act=nn.ReLU(),
            block=nn.Sequential(OrderedDict(fc=nn.Linear(64, 64), act=nn.ReLU())),
            head=nn.Linear(64, 16),
        )
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(32, 32, generator=generator), torch.randint(0, 16, (32,), generator=generator))
        for _ in range(STEPS)
    ]


def fp8_policy(recipe: str, rest: str = "bf16") -> Policy:
    return Policy(
        rules=(Rule("fp8", patterns=FP8_LAYERS, name="fp8"),),
        default=rest,
        quantization=Quantization(fp8=recipe),
        name=f"fp8-{recipe}",
    )


def train_with_policy(policy: Policy, model: nn.Module) -> list[float]:
    """The loop of docs/fp8.md, as written there."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prec = policy.apply(model, device="cpu", emulate="fp8")
    losses = []
    for x, y in batches():
        optimizer.zero_grad()
        with prec.autocast():
            out = model(x)
        loss = nn.functional.cross_entropy(out.float(), y)
        prec.backward(loss)
        prec.step(optimizer)
        losses.append(loss.item())
    prec.remove()
    return losses


def train_with_torchao(recipe: str, model: nn.Module) -> list[float]:
    """torchao's own way: convert with a filter of the same layers, one bf16 autocast."""
    torchao_float8.convert_to_float8_training(
        model,
        config=torchao_float8.Float8LinearConfig.from_recipe_name(recipe),
        module_filter_fn=lambda module, fqn: fqn in FP8_LAYERS,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = nn.functional.cross_entropy(out.float(), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@trains_fp8
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_layers_train_as_torchao_trains_them(recipe):
    """fp8 layers with the rest in bf16: one bf16 region, no region of autoprec's own, so
    the losses and the weights are torchao's under torch.autocast(bf16), bit for bit."""
    ours, theirs = mlp(), mlp()
    losses = train_with_policy(fp8_policy(recipe), ours)
    reference = train_with_torchao(recipe, theirs)
    assert losses == reference
    pairs = zip(ours.parameters(), theirs.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    # fp8 trains differently from bf16 alone: the conversion did something
    assert losses != train_with_policy(Policy.uniform("bf16"), mlp())


@trains_fp8
def test_remove_puts_the_same_linear_layers_and_parameters_back():
    model = mlp()
    before = dict(model.named_modules())
    parameters = list(model.parameters())
    keys = list(model.state_dict())
    seen = []
    before["fc1"].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    prec = fp8_policy("tensorwise").apply(model, emulate="fp8")
    assert type(model.fc1).__name__ == "Float8Linear"
    assert type(model.block.fc).__name__ == "Float8Linear"
    assert type(model.head) is nn.Linear
    assert list(model.parameters()) == parameters  # the same objects, trainable
    assert list(model.state_dict()) == keys  # checkpoints read as before
    assert all(p.requires_grad for p in model.parameters())
    with prec.autocast():
        model(torch.randn(4, 32))
    assert seen == [torch.bfloat16]  # the user's hook ran on fp8 fc1, in the bf16 region
    prec.remove()
    assert all(model.get_submodule(n) is m for n, m in before.items() if n)
    assert type(model.fc1) is nn.Linear and type(model.block.fc) is nn.Linear
    assert all(a is b for a, b in zip(model.parameters(), parameters, strict=True))


@trains_fp8
def test_resolve_says_fp8_for_the_fp8_layers():
    policy = fp8_policy("rowwise")
    expected = {"fc1": "fp8", "block.fc": "fp8", "head": "bf16"}
    model = mlp()
    assert policy.resolve(model, "cpu") == expected
    prec = policy.apply(model, emulate="fp8")
    assert policy.resolve(model, "cpu") == expected  # on the converted model too
    example = (torch.randn(4, 32), torch.zeros(4, dtype=torch.long))
    prec.remove()
    assert policy.resolve(model, get_backend("cpu", emulate="fp8"), example=example) == expected
    assert policy.low_precision_share(model, "cpu") == 1.0


def test_fp8_default_leaves_what_cannot_be_fp8_in_bf16():
    model = nn.Sequential(OrderedDict(fc=nn.Linear(32, 64), norm=nn.LayerNorm(64)))
    resolved = Policy.uniform("fp8").resolve(model, "cpu")
    assert resolved == {"fc": "fp8", "norm": "bf16"}


def test_yaml_round_trip(tmp_path):
    policy = fp8_policy("rowwise")
    loaded = load_policy(policy.save(tmp_path / "policy.yaml"))
    assert loaded == policy
    assert loaded.fp8_recipe == "rowwise"
    assert "fp8: rowwise" in policy.to_yaml()
    assert Policy.from_yaml("rules: []\n").fp8_recipe == "tensorwise"  # torchao's default


def test_recipes_are_torchaos():
    assert tuple(r.value for r in torchao_float8.Float8LinearRecipeName) == FP8_RECIPES


def _one_line(error: pytest.ExceptionInfo[Exception]) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_a_bad_recipe_is_one_line():
    unknown = r"quantization\.fp8: unknown fp8 recipe 'blockwise'"
    with pytest.raises(PolicyError, match=unknown) as e:
        Policy.from_yaml("quantization: {fp8: blockwise}\n", "p.yaml")
    assert _one_line(e).startswith("p.yaml: ")
    with pytest.raises(PolicyError, match=r"quantization\.fp8: expected a recipe name"):
        Policy.from_yaml("quantization: {fp8: 3}\n")


@pytest.mark.parametrize(
    ("model", "layer", "reason"),
    [
        (nn.Sequential(OrderedDict(fc=nn.Linear(30, 64))), "fc (Linear)", "multiples of 16"),
        (nn.Sequential(OrderedDict(fc=nn.LayerNorm(64))), "fc (LayerNorm)", "not an nn.Linear"),
    ],
)
def test_a_layer_fp8_cannot_take_is_refused_by_name(model, layer, reason):
    policy = Policy(rules=(Rule("fp8", patterns=("fc",)),))
    with pytest.raises(PolicyError, match=reason) as e:
        policy.plan(model, "cpu")
    assert _one_line(e).startswith(f"{layer}: cannot be fp8: ")


@trains_fp8
def test_a_recipe_that_fails_under_autocast_is_refused_before_training():
    """rowwise_with_gw_hp fails inside a bf16 region on the CPU (torch 2.13, torchao 0.18):
    refused with the reason; in fp32 surroundings it runs."""
    gw_hp = "rowwise_with_gw_hp"
    with pytest.raises(PolicyError, match="cannot run fc1 inside a bf16 region on cpu") as e:
        fp8_policy(gw_hp).apply(mlp(), emulate="fp8")
    _one_line(e)
    # The table is right: torchao itself fails there ...
    with pytest.raises(RuntimeError, match="same dtype"):
        train_with_torchao(gw_hp, mlp())
    # ... and trains with the rest in fp32
    losses = train_with_policy(fp8_policy(gw_hp, rest="fp32"), mlp())
    assert all(torch.isfinite(torch.tensor(losses)))


@trains_fp8
def test_fp8_on_the_cpu_needs_the_opt_in():
    with pytest.raises(PolicyError, match="dtype fp8: fp8 on the CPU is emulated") as e:
        fp8_policy("tensorwise").apply(mlp(), device="cpu")
    assert "--emulate fp8" in _one_line(e)
    assert not get_backend("cpu").supports("fp8")
    assert get_backend("cpu", emulate="fp8").supports("fp8")
    assert get_backend("cpu", emulate=["fp8"]).emulated() == ("fp8",)
    with pytest.raises(DeviceError, match="only fp8, mxfp8, mxfp4, nvfp4 can be emulated"):
        get_backend("cpu", emulate="int4")


SPACE = """
name: fp8-tiny
fp8_recipes: [tensorwise, rowwise, rowwise_with_gw_hp]
groups:
  - {name: fc1, patterns: [fc1], dtypes: [bf16, fp8]}
  - {name: norm, types: [LayerNorm], dtypes: [fp32, bf16]}
  - {name: head, patterns: [head], dtypes: [bf16, fp8]}
"""


def _space(text: str = SPACE) -> SearchSpace:
    return SearchSpace.from_dict(yaml.safe_load(text), "fp8.yaml")


@trains_fp8
def test_the_space_offers_fp8_only_where_it_runs(tiny_task):
    """The tiny task's head (32 -> 4) cannot be fp8; fc1 (16 -> 32) can. A recipe that fails
    inside the bf16 regions the space also offers is left out."""
    model = tiny_task.model()
    fitted = _space().fit(model, device=get_backend("cpu", emulate="fp8"))
    dtypes = {g.name: g.dtypes for g in fitted.groups}
    assert dtypes == {"fc1": ("bf16", "fp8"), "norm": ("fp32", "bf16"), "head": ("bf16",)}
    assert fitted.fp8_recipes == ("tensorwise", "rowwise")
    params = {"dtype.fc1": "fp8", "dtype.norm": "bf16", "dtype.head": "bf16"}
    policy = fitted.policy({**params, "fp8.recipe": "rowwise"})
    assert policy.fp8_recipe == "rowwise"
    assert policy.resolve(model, "cpu") == {"fc1": "fp8", "norm": "bf16", "head": "bf16"}
    assert fitted.policy({**params, "dtype.fc1": "bf16"}).quantization.fp8 is None
    assert "fp8.recipe" in fitted.flat_params(policy)


@trains_fp8
def test_the_space_refuses_fp8_where_it_cannot_run(tiny_task):
    model = tiny_task.model()
    with pytest.raises(SpaceError, match="fp8 on the CPU is emulated") as e:
        _space().fit(model, device="cpu")
    assert _one_line(e).startswith("fp8.yaml: dtypes: ")
    only_fp8 = SPACE.replace("dtypes: [bf16, fp8]}\n", "dtypes: [fp8]}\n")
    with pytest.raises(SpaceError, match=r"group 'head': offers only fp8, but head \(Linear\)"):
        _space(only_fp8).fit(model, device=get_backend("cpu", emulate="fp8"))
    with pytest.raises(SpaceError, match="fp8_recipes: unknown fp8 recipe 'blockwise'"):
        _space(SPACE.replace("rowwise_with_gw_hp", "blockwise"))


@trains_fp8
@pytest.mark.slow
def test_a_search_with_fp8_on_the_cpu_says_emulated(tiny_task, in_tmp):
    space = _space()
    with pytest.raises(SpaceError, match="--emulate fp8"):
        autoprec.search(tiny_task, space, trials=2, steps=4, device="cpu", study="no")
    result = autoprec.search(
        tiny_task, space, trials=4, steps=4, device="cpu", emulate=("fp8",), sampler="random"
    )
    summary = result.summary
    assert summary["settings"]["emulated"] == "fp8"
    policies = [Policy.from_dict(t["policy"]) for t in summary["trials"]]
    assert any(p.names_fp8 for p in policies), [p.to_dict() for p in policies]


@trains_fp8
def test_lightning_trains_an_fp8_layer_as_bf16_mixed_with_torchao(tmp_path):
    """PolicyPrecision with one fp8 layer and the rest bf16 trains as Lightning's own
    ``bf16-mixed`` on the same model converted by torchao, and hands the Linear back."""
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from autoprec.integrations.lightning import PolicyPrecision

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x).float(), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(module: Net, **kwargs) -> list[float]:
        x, y = (torch.cat(parts) for parts in zip(*batches(), strict=True))
        pl.Trainer(
            max_steps=STEPS,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
            **kwargs,
        ).fit(module, DataLoader(TensorDataset(x, y), batch_size=32))
        return module.losses

    policy = Policy(rules=(Rule("fp8", patterns=("net.block.fc",)),), default="bf16")
    ours = Net()
    losses = fit(ours, plugins=[PolicyPrecision(policy, emulate=("fp8",))])
    theirs = Net()
    torchao_float8.convert_to_float8_training(
        theirs.net, module_filter_fn=lambda module, fqn: fqn == "block.fc"
    )
    assert losses == fit(theirs, precision="bf16-mixed")
    assert type(ours.net.block.fc) is nn.Linear  # taken off at the end of fit


@trains_fp8
def test_applying_fp8_prints_no_torchao_import_noise():
    code = """
import torch
from torch import nn
from autoprec import Policy, Rule
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
prec = Policy(rules=(Rule("fp8", patterns=("0",)),), default="bf16").apply(model, emulate="fp8")
with prec.autocast():
    print(model(torch.randn(2, 16)).shape)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "torch.Size([2, 16])"
    assert not any(word in done.stderr for word in ("Failed to load", "_pytree")), done.stderr
