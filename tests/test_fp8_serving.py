"""fp8 for serving (torchao's float8 configs): a serving policy's fp8 layers hold float8
weights exactly as torchao's own ``quantize_`` gives them, the method goes into the policy as
int8's does and comes back from its file, the serving search offers fp8 only where it runs
(on the CPU only with ``--emulate fp8``), and the exports carry the fp8 layers.

Checked against torchao itself: nothing here re-implements its quantization."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

from autoprec import Policy, Rule, load_policy, load_served_model
from autoprec.cli import main
from autoprec.devices import get_backend
from autoprec.errors import DeviceError, PolicyError, SpaceError
from autoprec.exports import export_policy
from autoprec.policy import Quantization
from autoprec.serving.conversion import convert_policy, weight_bytes, weight_dtypes
from autoprec.serving.fp8 import (
    DEFAULT_FP8_METHOD,
    FP8_SERVING_METHODS,
    fp8_layer_refusal,
    fp8_serving_refusal,
    search_refusal,
)
from autoprec.serving.quantizers import QUANTIZERS
from autoprec.space import SearchSpace
from tests import npu_standin
from tests.cpu_fp8 import trains_fp8

quantization = pytest.importorskip("torchao.quantization")
WEIGHT_ONLY = "torchao-fp8-weight-only"
FP8_LAYERS = ("fc1", "block.fc")
CC_89 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def mlp() -> nn.Module:
    """Linear layers (one of them 24 wide, which torch._scaled_mm would refuse), a norm."""
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(32, 64),
            act=nn.ReLU(),
            block=nn.Sequential(OrderedDict(fc=nn.Linear(64, 24), norm=nn.LayerNorm(24))),
            head=nn.Linear(24, 16),
        )
    ).eval()


def fp8_policy(method: str = WEIGHT_ONLY, layers=FP8_LAYERS) -> Policy:
    return Policy(
        rules=(Rule("fp8", patterns=layers),),
        writes_loss_scale=False,
        quantization=Quantization(fp8=method),
        name="fp8-body",
    )


def torchao_reference(model: nn.Module, layers, config) -> nn.Module:
    """What torchao's own users run: quantize_ on a copy, the same layers by name."""
    reference = copy.deepcopy(model).eval()
    chosen = set(layers)
    quantization.quantize_(reference, config, filter_fn=lambda module, fqn: fqn in chosen)
    return reference


def outputs(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(x)


def test_served_fp8_layers_are_torchao_s_float8_weight_only_exactly():
    model = mlp()
    before = copy.deepcopy(model.state_dict())
    served = convert_policy(model, fp8_policy(), "cpu")
    x = torch.randn(6, 32)
    reference = torchao_reference(model, FP8_LAYERS, quantization.Float8WeightOnlyConfig())
    assert torch.equal(outputs(served, x), outputs(reference, x))
    assert not torch.equal(outputs(served, x), outputs(model, x)), "fp8 changes the outputs"
    found = weight_dtypes(served)
    assert [name for name, dtype in found.items() if dtype == "fp8"] == list(FP8_LAYERS)
    assert found["head"] == "fp32" and found["block.norm"] == "fp32"
    # float8 weights are a byte each, plus a scale per row; the fp32 model is untouched.
    assert weight_bytes(served) < weight_bytes(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_method_goes_into_the_policy_and_back_from_its_file(tmp_path):
    model = mlp()
    policy = fp8_policy()
    path = policy.save(tmp_path / "policy.yaml")
    loaded = load_policy(path)
    assert loaded == policy and loaded.fp8_method == WEIGHT_ONLY and loaded.serving_only
    assert "fp8: torchao-fp8-weight-only" in path.read_text()
    x = torch.randn(4, 32)
    assert torch.equal(
        outputs(load_served_model(model, loaded, "cpu"), x),
        outputs(convert_policy(model, policy, "cpu"), x),
    )
    # The served state dict loads back (weights_only) into a converted model.
    served = convert_policy(model, policy, "cpu")
    torch.save(served.state_dict(), tmp_path / "served.pt")
    again = convert_policy(model, policy, "cpu")
    state = torch.load(tmp_path / "served.pt", weights_only=True)
    again.load_state_dict(state, assign=True)
    assert torch.equal(outputs(again, x), outputs(served, x))


def test_what_fp8_serving_cannot_take_is_refused_in_one_line():
    model = mlp()
    with pytest.raises(
        PolicyError, match=r"quantization\.fp8: unknown fp8 recipe 'fp9'.*torchao-fp8-weight-only"
    ):
        Quantization(fp8="fp9")
    with pytest.raises(PolicyError, match=r"block\.norm.*not an nn\.Linear"):
        convert_policy(model, fp8_policy(layers=("block.norm",)), "cpu")
    # A training recipe is not a serving method, nor the other way round.
    with pytest.raises(PolicyError, match="is a serving method"):
        fp8_policy().apply(model, emulate="fp8")
    # The default fp8 goes to the layers it can take; the norm stays fp32.
    default = Policy(
        default="fp8", writes_loss_scale=False, quantization=Quantization(fp8=WEIGHT_ONLY)
    )
    assert default.resolve_served(model)["block.norm"] == "fp32"
    assert default.resolve_served(model)["block.fc"] == "fp8"
    # torch._scaled_mm (the dynamic methods) needs dimensions that are multiples of 16.
    assert fp8_layer_refusal(model.block.fc, WEIGHT_ONLY) is None
    assert "multiples of 16" in fp8_layer_refusal(model.block.fc, "torchao-fp8-dynamic")


@pytest.mark.skipif(CC_89, reason="checks the refusal where torchao has no float8 kernels")
@pytest.mark.parametrize("method", ["torchao-fp8-dynamic", "torchao-fp8-dynamic-rowwise"])
def test_dynamic_fp8_is_refused_on_the_cpu_as_torchao_refuses_it(method):
    model = mlp()
    with pytest.raises(DeviceError) as caught:
        convert_policy(model, fp8_policy(method, ("fc1",)), "cpu")
    assert "compute capability 8.9" in str(caught.value) and "\n" not in str(caught.value)
    # torchao itself refuses it here: the refusal is the device's truth, not ours.
    with pytest.raises(AssertionError, match=r"8\.9"):
        torchao_reference(model, ("fc1",), QUANTIZERS[method].torchao_config_object())


def test_the_registry_names_fp8_beside_int8():
    assert tuple(n for n, q in QUANTIZERS.items() if q.dtype == "fp8") == FP8_SERVING_METHODS
    assert set(DEFAULT_FP8_METHOD.values()) <= set(FP8_SERVING_METHODS)
    for method in FP8_SERVING_METHODS:
        assert hasattr(quantization, QUANTIZERS[method].torchao_config)
    cpu = get_backend("cpu")
    assert fp8_serving_refusal(cpu, WEIGHT_ONLY) is None  # converting: torchao runs it
    assert "--emulate fp8" in search_refusal(cpu, WEIGHT_ONLY)  # searching: opted into
    assert search_refusal(get_backend("cpu", emulate="fp8"), WEIGHT_ONLY) is None


@pytest.mark.skipif(not CC_89, reason="needs CUDA compute capability 8.9+ (never ran here)")
@pytest.mark.parametrize("method", ["torchao-fp8-dynamic", "torchao-fp8-dynamic-rowwise"])
def test_dynamic_fp8_on_a_gpu_is_torchao_s_exactly(method):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).cuda().eval()
    served = convert_policy(model, fp8_policy(method, ("0", "2")), "cuda")
    config = QUANTIZERS[method].torchao_config_object()
    reference = torchao_reference(model, ("0", "2"), config)
    x = torch.randn(8, 64, device="cuda")
    assert torch.equal(outputs(served, x), outputs(reference, x))


def test_a_space_offers_fp8_to_the_layers_it_fits_and_only_where_it_runs():
    model = mlp()
    space = SearchSpace.from_dict(
        {
            "groups": [
                {"name": "fc1", "patterns": ["fc1"]},
                {"name": "block", "patterns": ["block"]},
                {"name": "head", "patterns": ["head"]},
            ]
        },
        "<test>",
    )
    emulated = get_backend("cpu", emulate="fp8")
    fitted = space.fit(model, None, emulated, mode="serving", fp8_method=WEIGHT_ONLY)
    assert all("fp8" in g.dtypes for g in fitted.groups)
    block = next(g for g in fitted.groups if g.name == "block")
    assert block.fp8_leaves == ("block.fc",) and block.fp8_kept  # the norm stays fp32
    anchor = fitted.policy(fitted.anchors()["uniform-fp8"])
    assert anchor.fp8_method == WEIGHT_ONLY
    resolved = anchor.resolve_served(model)
    assert resolved == {"fc1": "fp8", "block.fc": "fp8", "block.norm": "fp32", "head": "fp8"}
    # Without an fp8 method settled for it, a space listing fp8 is refused in one line.
    listed = SearchSpace.from_dict(
        {"dtypes": ["fp32", "fp8"], "groups": [{"name": "all", "patterns": ["*"]}]}, "<test>"
    )
    with pytest.raises(SpaceError, match="--emulate fp8"):
        listed.fit(model, None, get_backend("cpu"), mode="serving")
    assert "fp8" not in space.fit(model, None, emulated, mode="serving").groups[0].dtypes


def test_a_cpu_serving_search_without_emulate_refuses_fp8_in_one_line(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    args = ["search", "--task", "digits-mlp", "--mode", "serving", "--no-progress"]
    assert main([*args, "--fp8", WEIGHT_ONLY, "--trials", "2", "--steps", "30"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--emulate fp8" in lines[0] and WEIGHT_ONLY in lines[0], lines
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").glob("*/summary.json"))


def test_fp8_serving_on_ascend_is_refused_in_one_line(tmp_path):
    done = subprocess.run(
        [
            *(sys.executable, "-m", "autoprec.cli", "search", "--task", "digits-mlp"),
            *("--device", "npu", "--mode", "serving", "--fp8", WEIGHT_ONLY, "--no-progress"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=npu_standin.subprocess_env(PYTHONWARNINGS="ignore"),
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Ascend" in lines[0] and "fp8" in lines[0], lines


@pytest.fixture(scope="module")
def emulated_search(tmp_path_factory):
    """A short serving search on the CPU with --emulate fp8 (int8 off, so fp8 is the only
    quantized choice)."""
    folder = tmp_path_factory.mktemp("fp8serve")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(folder)
        code = main(
            [
                *("search", "--task", "digits-mlp", "--mode", "serving", "--emulate", "fp8"),
                *("--int8", "off", "--trials", "4", "--steps", "30", "--no-progress"),
            ]
        )
    assert code == 0
    runs = folder / "runs"
    return folder, runs, json.loads((runs / "digits-mlp-server" / "summary.json").read_text())


def test_an_emulated_serving_search_tries_fp8(emulated_search):
    _, _, summary = emulated_search
    assert summary["settings"]["emulated"] == "fp8"
    assert summary["settings"]["fp8"] == WEIGHT_ONLY
    tried = [t for t in summary["trials"] if "fp8" in t["params"].values()]
    assert tried and all(t["state"] == "complete" for t in tried), summary["trials"]
    # Their latencies are no fp8 device's, and say so; the others are real.
    assert all(t["execution"]["emulated"] == ["fp8"] for t in tried)
    others = [t for t in summary["trials"] if t not in tried]
    assert others and all("emulated" not in t.get("execution", {}) for t in others)


@pytest.mark.parametrize("method", [WEIGHT_ONLY, None])
def test_the_mlflow_model_serves_the_fp8_layers(tmp_path, method):
    """As the search leaves it behind; a hand-written policy (no method) too."""
    import mlflow

    from autoprec.serving.mlflow_model import save_mlflow_model
    from autoprec.tasks import load_task

    task = load_task("digits-mlp")
    model = task.model().eval()
    batch = task.first_val_batch()
    linear = tuple(n for n, m in model.named_modules() if type(m) is nn.Linear)
    policy = Policy(
        rules=(Rule("fp8", patterns=linear),),
        writes_loss_scale=False,
        quantization=Quantization(fp8=method),
    )
    served = convert_policy(model, policy, "cpu")
    assert set(weight_dtypes(served).values()) >= {"fp8"}
    assert save_mlflow_model(served, batch, policy, tmp_path / "model", None) == "pt2"
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    loaded = mlflow.pyfunc.load_model(str(tmp_path / "model"))
    x = batch.args[0][:5]
    assert (loaded.predict(x.numpy()) == outputs(served, x).numpy()).all()
    assert "torchao==" in (tmp_path / "model" / "requirements.txt").read_text()


def test_fp8_beside_torch_s_dynamic_int8_is_rebuilt_at_load(tmp_path):
    """What a CPU search with --emulate fp8 and int8 on can choose: torch's dynamic int8
    does not export, so the MLflow model is rebuilt at load, fp8 layers and all."""
    import mlflow

    from autoprec.serving.mlflow_model import save_mlflow_model
    from autoprec.tasks import load_task

    task = load_task("digits-mlp")
    model = task.model().eval()
    batch = task.first_val_batch()
    linear = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    policy = Policy(
        rules=(Rule("int8", patterns=(linear[0],)), Rule("fp8", patterns=tuple(linear[1:]))),
        writes_loss_scale=False,
        quantization=Quantization(int8="dynamic", fp8=WEIGHT_ONLY),
    )
    served = convert_policy(model, policy, "cpu")
    assert set(weight_dtypes(served).values()) >= {"int8", "fp8"}
    path = tmp_path / "model"
    fmt = save_mlflow_model(served, batch, policy, path, "dynamic", model, "digits-mlp")
    assert fmt == "autoprec-rebuilt"
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    loaded = mlflow.pyfunc.load_model(str(path))
    x = batch.args[0][:5]
    assert (loaded.predict(x.numpy()) == outputs(served, x).numpy()).all()


def test_the_exports_carry_the_fp8_layers(tmp_path):
    from autoprec.tasks import load_task

    task = load_task("digits-mlp")
    model = task.model().eval()
    batch = task.first_val_batch()
    linear = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    policy = fp8_policy(layers=tuple(linear[:-1]))  # the head stays fp32
    served = convert_policy(model, policy, "cpu")
    x = batch.args[0]
    # torchao format: FP8_LAYERS with Float8WeightOnlyConfig, as torchao's user runs it.
    paths = export_policy(policy, "torchao", tmp_path / "torchao", model=model)
    config_file = next(p for p in paths if p.name == "torchao_config.py")
    spec = importlib.util.spec_from_file_location("torchao_config", config_file)
    config = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(config)
    assert linear[:-1] == config.FP8_LAYERS and config.LAYERS == []
    fresh = task.model().eval()
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(outputs(config.quantize(fresh), x), outputs(served, x))
    # model format: the program and the served weights hold the fp8 layers.
    paths = export_policy(policy, "model", tmp_path / "model", model=model, example=batch)
    names = {p.name: p for p in paths}
    program = torch.export.load(names["program.pt2"]).module()
    with torch.inference_mode():
        assert torch.equal(program(x), outputs(served, x))
    state = torch.load(names["served.pt"], weights_only=True)
    assert state[f"{linear[0]}.weight"].qdata.dtype == torch.float8_e4m3fn
    assert load_policy(names["policy.yaml"]).fp8_method == WEIGHT_ONLY


BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_fp8.py"


def _benchmark(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCHMARK), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(BENCHMARK.parents[1]), "PYTHONWARNINGS": "ignore"},
        timeout=600,
    )


@trains_fp8
def test_the_gpu_fp8_script_runs_its_smoke_mode(tmp_path):
    """benchmarks/gpu_fp8.py on a tiny model, emulated on the CPU and not compiled, with a
    policy given (the built-in short search is the slow part, skipped here): it times the
    four policies side by side and writes its figures."""
    policy = Policy(
        rules=(Rule("fp8", patterns=("blocks.0.*",), types=("Linear",)),),
        default="bf16",
        quantization=Quantization(fp8="rowwise"),
    )
    path = policy.save(tmp_path / "policy.yaml")
    done = _benchmark(
        *("--smoke", "--policy", str(path), "--warmup", "1", "--rounds", "2", "--block", "1"),
        *("--out", str(tmp_path / "out")),
        cwd=tmp_path,
    )
    assert done.returncode in (0, 1), done.stderr  # 1: a target missed (the figures decide)
    figures = json.loads((tmp_path / "out" / "gpu_fp8.json").read_text())
    rows = {row["name"]: row for row in figures["rows"]}
    assert list(rows) == ["bf16", "fp8-tensorwise", "fp8-rowwise", "searched"]
    assert rows["bf16"]["fp8_share"] == 0 and rows["bf16"]["feasible"]
    # The uniform recipes put every block Linear in fp8; the head (500 outputs) stays bf16.
    assert 0 < rows["searched"]["fp8_share"] < rows["fp8-tensorwise"]["fp8_share"] < 1
    assert all(row["step_ms"] > 0 for row in rows.values())
    assert figures["target_met"] == (done.returncode == 0)
    assert "torchao's published float8 training speed-ups" in done.stdout


@pytest.mark.skipif(CC_89, reason="checks the refusal on a machine without fp8 kernels")
def test_the_gpu_fp8_script_refuses_without_an_fp8_gpu(tmp_path):
    done = _benchmark(cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "compute capability 8.9" in lines[0], lines


def test_the_training_formats_refuse_a_serving_fp8_policy_in_one_line(tmp_path):
    from autoprec.errors import ExportError

    model = mlp()
    for fmt in ("fp8", "transformers"):
        with pytest.raises(ExportError, match=r"serves layers in fp8 \(torchao-fp8-weight-only\)"):
            export_policy(fp8_policy(), fmt, tmp_path / fmt, model=model)
