"""Policies: YAML round trip, strict validation, resolution and the apply mechanism."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import yaml
from torch import nn

from autoprec import LossScale, Policy, Rule, load_policy
from autoprec.errors import PolicyError
from autoprec.policy import Quantization

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def mlp() -> nn.Module:
    return nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(8, 16),
            norm=nn.LayerNorm(16),
            act=nn.ReLU(),
            block=nn.Sequential(OrderedDict(fc=nn.Linear(16, 16), act=nn.ReLU())),
            head=nn.Linear(16, 3),
        )
    )


MIXED = Policy(
    rules=(
        Rule("fp32", types=("LayerNorm",), name="norms"),
        Rule("bf16", patterns=("block",), name="block"),
        Rule("fp32", patterns=("head",), name="head"),
    ),
    default="fp16",
    loss_scale=LossScale("dynamic", init_scale=1024.0, growth_interval=50, hysteresis=2),
    tf32=False,
    name="mixed",
)


def test_yaml_round_trip(tmp_path):
    path = MIXED.save(tmp_path / "policy.yaml")
    assert load_policy(path) == MIXED
    assert Policy.from_yaml(MIXED.to_yaml()).to_dict() == MIXED.to_dict()


def test_uniform_policy_round_trip_and_defaults():
    fp16 = Policy.uniform("fp16")
    assert fp16.loss_scale == LossScale("dynamic")  # torch's GradScaler defaults
    assert fp16.loss_scale.init_scale == 2.0**16
    assert fp16.loss_scale.growth_interval == 2000
    assert Policy.from_yaml(fp16.to_yaml()) == fp16
    assert Policy.uniform("bf16").loss_scale.mode == "none"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("default: fp4\n", "default: unknown dtype 'fp4'"),
        ("rules:\n- patterns: [fc1]\n  dtype: int4\n", "rules[0].dtype: unknown dtype 'int4'"),
        ("rules:\n- dtype: fp16\n", "rules[0]: needs patterns, types or both"),
        (
            "rules:\n- patterns: [fc1]\n  dtype: fp16\n  colour: red\n",
            "rules[0].colour: unknown field",
        ),
        ("loss_scale: {mode: sometimes}\n", "loss_scale.mode: unknown mode 'sometimes'"),
        ("loss_scale: {mode: dynamic, backoff_factor: 2.0}\n", "loss_scale.backoff_factor"),
        ("loss_scale: {mode: dynamic, growth_interval: 1.5}\n", "loss_scale.growth_interval"),
        ("switches: {tf32: maybe}\n", "switches.tf32"),
        ("precision: fp16\n", "precision: unknown field"),
        ("rules: [a, b\n", "not valid YAML"),
        ("- just\n- a list\n", "expected a mapping"),
        ("quantization: {int8: fastest}\n", "quantization.int8: unknown method 'fastest'"),
        ("quantization: {int4: dynamic}\n", "quantization.int4: unknown field"),
        ("quantization: {int8: 8}\n", "quantization.int8: expected a method name"),
        ("quantization: dynamic\n", "quantization: expected a mapping"),
    ],
)
def test_validation_names_the_field(text, message):
    with pytest.raises(PolicyError, match=r"^my\.yaml: ") as caught:
        Policy.from_yaml(text, "my.yaml")
    assert message in str(caught.value)


def test_a_serving_policy_records_its_int8_method_and_reads_it_back(tmp_path):
    served = Policy(
        rules=(Rule("fp32", patterns=("head",)),),
        default="int8",
        writes_loss_scale=False,
        quantization=Quantization(int8="torchao-dynamic"),
    )
    path = served.save(tmp_path / "served.yaml")
    assert yaml.safe_load(path.read_text())["quantization"] == {"int8": "torchao-dynamic"}
    again = load_policy(path)
    assert again == served and again.int8_method == "torchao-dynamic"
    assert again.to_yaml() == path.read_text()
    # A policy without a method (written by hand, or before methods were recorded) writes
    # no quantization and serves with the device's default.
    assert "quantization" not in Policy.uniform("int8").to_dict()
    assert Policy.uniform("int8").int8_method is None


def test_a_bad_int8_method_is_one_line():
    with pytest.raises(PolicyError) as caught:
        Policy(default="int8", quantization=Quantization(int8="int8-fast"))
    assert "\n" not in str(caught.value)
    assert str(caught.value).startswith("quantization.int8: unknown method 'int8-fast'")


def test_unreadable_file(tmp_path):
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "missing.yaml")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00default")
    with pytest.raises(PolicyError, match="not UTF-8"):
        load_policy(binary)


def test_rule_that_matches_no_module_is_an_error():
    policy = Policy(rules=(Rule("fp16", patterns=("encoder.*",)),))
    with pytest.raises(PolicyError, match=r"rules\[0\] \(patterns encoder.\*\): matches no module"):
        policy.resolve(mlp())


def test_int8_is_for_serving_only():
    model = mlp()
    policy = Policy(rules=(Rule("int8", patterns=("fc1",)),))
    assert Policy.from_yaml(policy.to_yaml()) == policy  # a valid policy, for serving
    with pytest.raises(PolicyError, match=r"rules\[0\]: int8 is for serving only"):
        policy.apply(model, "cpu")
    assert policy.resolve_served(model)["fc1"] == "int8"
    # int8 from the default goes where it can (Linear); the LayerNorm stays fp32.
    resolved = Policy.uniform("int8").resolve_served(model)
    assert resolved["fc1"] == resolved["head"] == "int8" and resolved["norm"] == "fp32"


def test_resolve_maps_every_leaf_with_parameters():
    model = mlp()
    leaves = {n for n, m in model.named_modules() if list(m.parameters(recurse=False))}
    resolved = MIXED.resolve(model)
    assert set(resolved) == leaves  # ReLUs run in their input's dtype: not listed
    assert resolved["fc1"] == "fp16"
    assert resolved["norm"] == "fp32"
    assert resolved["block.fc"] == "bf16"
    assert resolved["head"] == "fp32"


def test_an_explicit_fp32_rule_for_a_norm_is_honoured_on_every_device():
    # On the CPU, autocast runs LayerNorm in its input's dtype: the rule needs a region.
    # On CUDA and Ascend, autocast keeps LayerNorm in fp32 anyway: no region.
    model = mlp()
    cpu = MIXED.plan(model, "cpu")
    assert {r.name: r.dtype for r in cpu.regions}["norm"] == "fp32"
    for kind in ("cuda", "npu"):
        plan = MIXED.plan(model, kind)
        assert "norm" not in {r.name for r in plan.regions}
        assert plan.leaf_dtypes["norm"] == "fp32"
    assert Policy.uniform("bf16").resolve(model, "cuda")["norm"] == "fp32"
    assert Policy.uniform("bf16").resolve(model, "cpu")["norm"] == "bf16"


def test_patterns_cover_descendants_and_types_cover_subclasses():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(8, 2))
    policy = Policy(rules=(Rule("fp32", types=("_BatchNorm",)),), default="bf16")
    resolved = policy.resolve(model)
    assert resolved["1"] == "fp32"
    assert resolved["0"] == "bf16"


def test_uniform_policy_is_plain_autocast_and_a_rule_that_names_a_layer_decides_it():
    model = _blocky()  # linears only
    assert Policy.uniform("bf16").plan(model).regions == ()
    prec = Policy.uniform("bf16").apply(model, "cpu")
    assert not any("forward" in m.__dict__ for m in model.modules())
    prec.remove()
    # On the CPU, LayerNorm runs in its input's dtype. A uniform policy leaves it so, as
    # plain autocast does; a rule that names it casts its input, so that it runs in bf16
    # even where its input arrives in fp32. CUDA keeps it in fp32: nothing to do.
    assert Policy.uniform("bf16").plan(mlp(), "cpu").regions == ()
    named = Policy(rules=(Rule("bf16", types=("LayerNorm",)),), default="bf16")
    plan = named.plan(mlp(), "cpu")
    assert [(r.name, r.dtype, r.cast_inputs) for r in plan.regions] == [("norm", "bf16", True)]
    assert Policy.uniform("bf16").plan(mlp(), "cuda").regions == ()
    assert named.plan(mlp(), "cuda").regions == ()


def _blocky() -> nn.Module:
    block = nn.Sequential(OrderedDict(a=nn.Linear(16, 16), act=nn.ReLU(), b=nn.Linear(16, 16)))
    return nn.Sequential(OrderedDict(fc1=nn.Linear(8, 16), block=block, head=nn.Linear(16, 3)))


def test_same_dtype_neighbours_share_one_region():
    # The outer region takes the dtype holding most parameters; a whole same-dtype
    # subtree gets one region, never one per leaf.
    plan = Policy(rules=(Rule("fp16", patterns=("fc1",)),)).plan(_blocky())
    assert plan.outer_dtype == "fp32"
    assert [(r.name, r.dtype) for r in plan.regions] == [("fc1", "fp16")]
    plan = Policy(rules=(Rule("fp16", patterns=("block",)),)).plan(_blocky())
    assert plan.outer_dtype == "fp16"
    assert {r.name: r.dtype for r in plan.regions} == {"fc1": "fp32", "head": "fp32"}
    assert plan.leaf_dtypes["block.a"] == "fp16"


def _run_dtypes(policy: Policy, model: nn.Module) -> dict[str, torch.dtype]:
    """The dtype each parameterised leaf produced in one forward pass."""
    seen: dict[str, torch.dtype] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear | nn.LayerNorm):
            module.register_forward_hook(
                lambda mod, args, out, name=name: seen.__setitem__(name, out.dtype)
            )
    prec = policy.apply(model, "cpu")
    with prec.autocast():
        out = model(torch.randn(4, 8))
    loss = out.float().sum()
    prec.backward(loss)
    prec.remove()
    return seen


@pytest.mark.parametrize("low", ["fp16", "bf16"])
def test_fp32_layers_stay_fp32_inside_low_precision_regions(low):
    model = mlp()
    policy = Policy(rules=(Rule("fp32", patterns=("fc1", "head")),), default=low)
    assert policy.plan(model).outer_dtype == low
    dtypes = _run_dtypes(policy, model)
    assert dtypes["fc1"] == torch.float32
    assert dtypes["head"] == torch.float32  # its input came from a low-precision layer
    assert dtypes["block.fc"] == {"fp16": torch.float16, "bf16": torch.bfloat16}[low]
    # Master weights and their gradients stay fp32.
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_remove_restores_the_model():
    model = mlp()
    x = torch.randn(2, 8)
    expected = model(x)
    prec = MIXED.apply(model, "cpu")
    prec.remove()
    assert not any("forward" in m.__dict__ for m in model.modules())
    torch.testing.assert_close(model(x), expected)


def test_low_precision_share_counts_parameters():
    model = nn.Sequential(OrderedDict(big=nn.Linear(10, 10), small=nn.Linear(10, 1)))
    policy = Policy(rules=(Rule("fp16", patterns=("big",)),))
    assert policy.low_precision_share(model) == pytest.approx(110 / 121)


@pytest.mark.parametrize("low", ["fp16", "bf16"])
def test_low_precision_regions_inside_fp32_hand_fp32_to_the_next_layer(low):
    # fc1 and norm low precision, the bigger rest fp32: the outer region is fp32 and the
    # fp32 layers after a low-precision region must still get fp32 inputs.
    model = mlp()
    policy = Policy(rules=(Rule(low, patterns=("fc1", "norm")),), default="fp32")
    assert policy.plan(model).outer_dtype == "fp32"
    outputs = {}
    model.fc1.register_forward_hook(lambda m, a, out: outputs.__setitem__("fc1", out))
    dtypes = _run_dtypes(policy, model)
    # fc1 computed in low precision (hooks on it see what it computed), then handed on in
    # fp32 to the layers after it.
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[low]
    assert dtypes["fc1"] == dtype and outputs["fc1"].dtype == dtype
    assert dtypes["block.fc"] == torch.float32
    assert dtypes["head"] == torch.float32


class Holder(nn.Module):
    """A user's module around the searched model, with a layer of its own."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.extra = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.extra(self.model(x))


def output_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """Forward hooks on every leaf with parameters: the dtype each one computed in."""
    seen: dict[str, torch.dtype] = {}
    for name, module in model.named_modules():
        if next(module.children(), None) is None and next(module.parameters(), None) is not None:
            module.register_forward_hook(
                lambda m, args, out, name=name: seen.__setitem__(name, out.dtype)
            )
    return seen


@pytest.mark.parametrize("wrap", [Holder, nn.DataParallel], ids=["holder", "dataparallel"])
def test_apply_on_a_wrapper_lands_on_the_searched_model(wrap, caplog):
    torch.manual_seed(0)
    bare, x = mlp(), torch.randn(4, 8)
    wrapper = wrap(mlp())
    inner = "module" if wrap is nn.DataParallel else "model"
    wrapper.get_submodule(inner).load_state_dict(bare.state_dict())
    expected = {f"{inner}.{leaf}": dtype for leaf, dtype in MIXED.resolve(bare, "cpu").items()}
    if wrap is Holder:
        expected["extra"] = "fp32"  # not the policy's: left as it was
    assert MIXED.resolve(wrapper, "cpu") == expected
    seen = output_dtypes(wrapper)
    with caplog.at_level("WARNING", logger="autoprec"):
        reference = MIXED.apply(bare)
        prec = MIXED.apply(wrapper)
    with reference.autocast():
        want = bare(x)
    with prec.autocast():
        got = wrapper.get_submodule(inner)(x)
        wrapper(x)
    assert torch.equal(got, want)  # the same numbers as on the model itself
    assert seen == {name: DTYPES[dtype] for name, dtype in expected.items()}
    lines = [r.getMessage() for r in caplog.records if r.name == "autoprec"]
    assert lines == [  # nothing said for the bare model
        f"autoprec: policy mixed applied to submodule {inner!r} (Sequential, 4 layers)"
    ]
    prec.remove()
    assert [name for name, m in wrapper.named_modules() if "forward" in m.__dict__] == []
    seen.clear()
    wrapper(x)
    assert set(seen.values()) == {torch.float32}


def test_two_fitting_submodules_are_named_and_module_picks_one():
    pair = nn.ModuleDict({"student": mlp(), "teacher": mlp()})
    with pytest.raises(
        PolicyError,
        match=r"^the policy fits several submodules of ModuleDict \('student', 'teacher'\): "
        r'pass module="student"',
    ):
        MIXED.apply(pair)
    prec = MIXED.apply(pair, module="teacher")
    regions = [name for name, m in pair.named_modules() if "forward" in m.__dict__]
    assert regions == ["teacher", "teacher.fc1", "teacher.norm", "teacher.head"]
    assert {d for name, d in prec.plan.leaf_dtypes.items() if name.startswith("student.")} == {
        "fp32"
    }
    with pytest.raises(PolicyError, match=r"^module='tutor': ModuleDict has no such submodule"):
        MIXED.apply(pair, module="tutor")
    with pytest.raises(PolicyError, match=r"rules\[1\] \(patterns block\): matches no module"):
        MIXED.apply(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)))


def test_a_container_that_its_parent_never_calls_is_not_a_place():
    parts = nn.ModuleDict(dict(mlp().named_children()))  # the layers, without their forward
    holder = nn.ModuleDict({"parts": parts})
    with pytest.raises(PolicyError, match=r"rules\[1\] \(patterns block\): matches no module"):
        MIXED.apply(holder)
    with pytest.raises(PolicyError, match=r"^module='parts': a ModuleDict is not called"):
        MIXED.apply(holder, module="parts")


def test_an_unnamed_policy_is_announced_as_the_policy(caplog):
    unnamed = Policy(rules=MIXED.rules, default="fp16")
    with caplog.at_level("WARNING", logger="autoprec"):
        unnamed.apply(Holder(mlp())).remove()
    assert [r.getMessage() for r in caplog.records if r.name == "autoprec"] == [
        "autoprec: the policy applied to submodule 'model' (Sequential, 4 layers)"
    ]
