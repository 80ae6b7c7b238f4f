"""A number format is one object: the registry, the microscaling formats (MXFP8 trained and
served, MXFP4 and NVFP4 served, all emulated on the CPU through torchao's mx_formats), and
a made-up format registered from a file outside the package, then applied, searched,
exported and drawn without a line changed elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch
from torch import nn

import autoprec
import autoprec.formats as formats
from autoprec import Policy, Rule
from autoprec.errors import PolicyError
from autoprec.serving.conversion import convert, weight_dtypes

pytest.importorskip("torchao.prototype.mx_formats")
ROOT = Path(__file__).resolve().parent.parent
AUTOPREC = str(Path(sys.executable).with_name("autoprec"))

# A format of our own: e3m2 (6 bits) rounded in blocks of 32 by plain torch, trained by
# conversion as the MX formats are. It lives in a file outside the package.
MADE_UP = """
import torch
from autoprec.formats import CONVERT, Format, Limits
from autoprec.formats.blocks import BlockLayers, dims_refusal


def round_trip(x):
    amax = x.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-126)
    scale = torch.exp2(torch.floor(torch.log2(amax)) - 4)  # the block's largest near 16
    scaled = (x / scale).clamp(-28.0, 28.0)
    exponent = torch.floor(torch.log2(scaled.abs().clamp(min=0.25)))
    step = torch.exp2(exponent - 2)  # 2 mantissa bits
    return torch.round(scaled / step) * step * scale


class E3M2(Format):
    name = "e3m2"
    help = "a made-up 6-bit float in blocks of 32"
    limits = Limits(28.0 * 2.0**127, 2.0**-2 * 2.0**-127, 2.0**-4 * 2.0**-127, 2)
    modes = ("training",)
    trains = CONVERT
    bytes_per_element = 0.75 + 1 / 32
    colour = "#17becf"

    def layer_refusal(self, module):
        return dims_refusal(module, self.name, 32)

    def convert(self, model, names, recipe):
        return BlockLayers(model, names, self.name, round_trip, 32)
"""


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def train(model: nn.Module, policy: Policy, emulate: str = "", steps: int = 10) -> list[float]:
    prec = policy.apply(model, device="cpu", emulate=emulate or ())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    losses = []
    for _ in range(steps):
        with prec.autocast():
            out = model(x)
        loss = nn.functional.cross_entropy(out.float(), y)
        optimizer.zero_grad()
        prec.backward(loss)
        prec.step(optimizer)
        losses.append(loss.item())
    prec.remove()
    return losses


def test_every_format_declares_its_limits_modes_and_bytes() -> None:
    names = formats.names()
    assert names[:5] == ("fp32", "fp16", "bf16", "fp8", "int8")
    assert {"mxfp8", "mxfp4", "nvfp4"} <= set(names)
    assert formats.get("fp16").limits.largest == torch.finfo(torch.float16).max
    assert 2.0 ** -formats.get("bf16").limits.mantissa_bits == torch.finfo(torch.bfloat16).eps
    assert formats.get("fp8").element_limits()["fp8_e5m2"].largest == 57344.0
    assert formats.get("mxfp4").bytes_per_element == 0.5 + 1 / 32
    assert formats.names("training")[:5] == ("fp32", "fp16", "bf16", "fp8", "mxfp8")
    assert "mxfp4" not in formats.names("training")  # served only
    assert formats.reference().name == "fp32"
    with pytest.raises(PolicyError, match="unknown dtype 'fp6'"):
        formats.get("fp6")


def test_mxfp8_trains_by_hand_as_its_numerics_say_and_its_layers_come_back() -> None:
    model = mlp()
    first = model[0]
    weight = first.weight
    policy = Policy(rules=(Rule("mxfp8", patterns=("0",)),))
    assert policy.resolve(model, "cpu") == {"0": "mxfp8", "2": "fp32"}
    losses = train(model, policy, emulate="mxfp8")
    assert losses[-1] < losses[0]
    assert model[0] is first and model[0].weight is weight and weight.dtype == torch.float32
    assert type(model[0]) is nn.Linear  # prec.remove() turned it back
    # MXFP8's rounding really ran: fp32 training of the same model ends elsewhere.
    assert train(mlp(), Policy()) != losses


def test_mxfp8_layers_inside_a_bf16_region_train() -> None:
    """Behind a LayerNorm that hands on fp32, inside bf16 autocast: the matmul's operands
    and the backward's take one dtype."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 10))
    policy = Policy.from_yaml("default: bf16\nrules:\n- {patterns: ['2'], dtype: mxfp8}\n")
    losses = train(model, policy, emulate="mxfp8")
    assert losses[-1] < losses[0] and model[2].weight.dtype == torch.float32


def test_mxfp8_without_emulation_on_the_cpu_is_refused_in_one_line() -> None:
    policy = Policy(rules=(Rule("mxfp8", patterns=("0",)),))
    with pytest.raises(PolicyError) as error:
        policy.apply(mlp(), device="cpu")
    assert "--emulate mxfp8" in str(error.value) and "\n" not in str(error.value)


def test_a_layer_mxfp8_cannot_take_is_refused_by_a_rule_and_left_by_the_default() -> None:
    model = nn.Sequential(nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 10))
    with pytest.raises(PolicyError, match="in features 40 are not a multiple of mxfp8's block"):
        Policy(rules=(Rule("mxfp8", patterns=("0",)),)).plan(model, "cpu")
    plan = Policy(default="mxfp8").plan(model, "cpu")
    assert plan.leaf_dtypes == {"0": "bf16", "2": "mxfp8"}  # the rest: bf16, as fp8's


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "nvfp4"])
def test_microscaling_formats_serve_real_torchao_weights_close_to_fp32(name: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16)).eval()
    x = torch.randn(16, 64)
    served = convert(model, {"0": name, "2": name}, "cpu")
    assert weight_dtypes(served) == {"0": name, "2": name}
    with torch.no_grad():
        error = (served(x) - model(x)).abs().max().item()
    scale = model(x).abs().max().item()
    assert 0 < error < 0.5 * scale  # rounded (4 bits: coarsely), and still the model
    assert served(x).dtype == torch.float32


def test_a_made_up_format_from_outside_the_package_is_applied_and_written(tmp_path: Path) -> None:
    source = tmp_path / "e3m2.py"
    source.write_text(MADE_UP)
    made = formats.register(f"{source}:E3M2")
    try:
        assert formats.get("e3m2") is made and "e3m2" in formats.names("training")
        policy = Policy(rules=(Rule("e3m2", patterns=("0",)),))
        losses = train(mlp(), policy)
        assert losses[-1] < losses[0] and losses != train(mlp(), Policy())
        assert autoprec.Policy.from_yaml(policy.to_yaml()) == policy
    finally:
        formats.unregister("e3m2")
    with pytest.raises(PolicyError, match="unknown dtype 'e3m2'"):
        Policy(rules=(Rule("e3m2", patterns=("0",)),))


@pytest.mark.slow
def test_a_made_up_format_is_searched_exported_and_drawn(tmp_path: Path) -> None:
    """The same file, named in AUTOPREC_FORMATS, in the commands a user types."""
    source = tmp_path / "e3m2.py"
    source.write_text(MADE_UP)
    space = tmp_path / "space.yaml"
    space.write_text(
        textwrap.dedent("""\
            name: e3m2
            accuracy_tolerance: 0.02
            dtypes: [fp32, e3m2]
            groups: auto
            auto_groups: {max_groups: 4}
        """)
    )
    env = {**os.environ, "AUTOPREC_FORMATS": f"{source}:E3M2"}
    runs = tmp_path / "runs"
    tracking = f"--tracking-uri=sqlite:///{runs}/mlflow.db"
    stores = [f"--runs-dir={runs}", f"--storage=sqlite:///{runs}/optuna.db", tracking]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [AUTOPREC, *args], env=env, cwd=tmp_path, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done

    run("search", "--space", str(space), "--trials", "4", "--steps", "40", *stores)
    summary = json.loads((runs / "digits-mlp" / "summary.json").read_text())
    assert '"e3m2"' in json.dumps(summary["trials"])  # some trial put a group in it
    out = tmp_path / "exported"
    run("export", "--study", "digits-mlp", "--out", str(out), f"--runs-dir={runs}")
    best = Policy.from_yaml((runs / "digits-mlp" / "best_policy.yaml").read_text())
    assert Policy.from_yaml((out / "policy.yaml").read_text()) == best
    run("report", "--study", "digits-mlp", f"--runs-dir={runs}", tracking)
    assert "e3m2" in (runs / "digits-mlp" / "report.html").read_text()
    # the dtype map draws its layers in the format's own colour, #17becf
    pixels = matplotlib.image.imread(runs / "digits-mlp" / "dtype_map.png")[..., :3]
    colour = np.array([0x17, 0xBE, 0xCF]) / 255
    assert (np.abs(pixels - colour).max(axis=-1) < 0.02).any()
