"""The NPU path end to end, against a STAND-IN for torch_npu on CPU tensors (not Ascend).

tests/npu_standin is installed as ``torch_npu``: the real NPUBackend code runs (detection,
device selection, synchronisation, allocator statistics, bf16 checks, HF32 switches) and so
do a trial, a profile, a search from the command line and the torch-npu export, on device
"npu". What this cannot show: kernels, numerics or memory on a chip (tests/npu_standin/README.md).
"""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from collections.abc import Iterator
from contextlib import nullcontext
from types import ModuleType

import pytest
import torch
from torch import nn

import autoprec
from autoprec import Policy, Rule
from autoprec.devices import NPUBackend, forget_watched, get_backend, npu_available
from autoprec.errors import DeviceError, PolicyError
from autoprec.exports import ExportWarning, export_policy
from autoprec.exports.npu import precision_mode
from autoprec.numerics.observe import watch_task
from autoprec.tasks import load_task
from autoprec.trials.training import Budget, run_trial
from tests import npu_standin


@pytest.fixture(scope="module")
def torch_npu() -> Iterator[ModuleType]:
    module = npu_standin.install()
    yield module
    npu_standin.uninstall()


@pytest.fixture
def standin(torch_npu):
    """The stand-in machine, fresh for each test: one Ascend910B3, torch_npu's defaults.
    What a search watched on it (CPU kernels under an NPU's name) is forgotten after."""
    torch_npu.STANDIN.reset()
    yield torch_npu.STANDIN
    forget_watched("npu")


def cli(*args: str, cwd, **settings: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "autoprec.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=npu_standin.subprocess_env(PYTHONWARNINGS="ignore", **settings),
        timeout=600,
    )


# -- detection and device selection --------------------------------------------------------


def test_auto_and_npu_pick_the_npu(standin):
    assert npu_available()
    for name in ("auto", "npu", "npu:0"):
        backend = get_backend(name)
        assert isinstance(backend, NPUBackend)
        assert backend.device == torch.device("npu:0") and backend.name == "npu:0"


def test_no_visible_npu_falls_back_or_refuses(standin):
    standin.devices = 0
    assert not npu_available()
    assert get_backend("auto").kind == "cpu"
    with pytest.raises(DeviceError, match="no NPU device is available"):
        get_backend("npu")


def test_npu_1_is_selected_for_the_block_and_restored(standin):
    standin.devices = 2
    backend = get_backend("npu:1")
    with backend.selected():
        assert torch.npu.current_device() == 1
        backend.synchronize()
    assert torch.npu.current_device() == 0
    backend.empty_cache()  # selects npu:1 for the call, then puts npu:0 back
    assert standin.calls_to("set_device") == [1, 0, 1, 0]
    assert standin.calls_to("synchronize") == [1]
    assert standin.calls_to("empty_cache") == [1]
    with pytest.raises(DeviceError, match="only 2 NPU"):
        get_backend("npu:2")


def test_bf16_is_asked_of_the_selected_chip(standin):
    standin.devices = 2
    assert get_backend("npu:1").supports("bf16")
    assert standin.calls == [("set_device", 1), ("is_bf16_supported", 1), ("set_device", 0)]
    standin.soc = "Ascend910A"  # no bf16 before 910B
    backend = get_backend("npu")
    assert not backend.supports("bf16") and backend.supports("fp16")
    with pytest.raises(PolicyError, match="bf16: not supported by device npu:0"):
        Policy.uniform("bf16").apply(nn.Linear(4, 4), "npu")


def test_a_guard_that_would_promote_to_a_dtype_the_chip_lacks_is_refused(standin):
    standin.soc = "Ascend910A"  # no bf16 before 910B
    with pytest.raises(
        autoprec.GuardError, match=r"guard\.promote: bf16 cannot run on device npu:0"
    ):
        Policy.uniform("fp16").apply(nn.Linear(4, 4), "npu", guard=autoprec.Guard())
    prec = Policy.uniform("fp16").apply(
        nn.Linear(4, 4), "npu", guard=autoprec.Guard(promote=("fp32",))
    )
    assert prec.settings.target("fp16") == "fp32"


def test_the_device_calls_refuse_what_is_not_an_npu(standin, torch_npu):
    # The stand-in checks device arguments, so that a backend passing the wrong one fails here.
    with pytest.raises(ValueError, match="expected an NPU device"):
        torch.npu.synchronize(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="invalid device 3"):
        torch.ones(2).to("npu:3")
    assert torch.ones(2).to(torch.device("npu:0")).device.type == "cpu"  # CPU tensors


# -- precision switches and options --------------------------------------------------------


@pytest.mark.parametrize("hf32", [True, False])
def test_hf32_switches_are_recorded_and_restored(standin, hf32):
    prec = Policy(default="fp16", hf32=hf32).apply(nn.Linear(4, 4), "npu")
    assert prec.switches == {"hf32_matmul": hf32, "hf32_conv": hf32}
    assert (torch.npu.matmul.allow_hf32, torch.npu.conv.allow_hf32) == (hf32, hf32)
    prec.remove()
    assert (torch.npu.matmul.allow_hf32, torch.npu.conv.allow_hf32) == (False, True)


def test_a_policy_without_hf32_leaves_the_defaults(standin):
    prec = Policy.uniform("fp16").apply(nn.Linear(4, 4), "npu")
    assert prec.switches == {"hf32_matmul": False, "hf32_conv": True}
    prec.remove()
    assert standin.calls_to("matmul.allow_hf32") == [False]  # restored, never changed


@pytest.mark.parametrize(
    "option",
    [
        {"ACL_PRECISION_MODE": "force_fp16"},  # CANN's graph modes are not torch_npu's
        {"ACL_PRECISION_MODE": "allow_mix_precision"},
        {"ACL_PRECISION_MODE": "force_fp32"},
        {"ACL_PRECISION": "must_keep_origin_dtype"},
    ],
)
def test_set_option_accepts_only_the_two_documented_modes(standin, torch_npu, option):
    with pytest.raises(ValueError, match="ACL_PRECISION_MODE"):
        torch_npu.npu.set_option(option)
    assert standin.options == {"ACL_PRECISION_MODE": "must_keep_origin_dtype"}  # 910B default


@pytest.mark.parametrize("dynamic", [True, False])
def test_the_grad_scaler_skips_an_overflow(standin, torch_npu, dynamic):
    weight = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = torch_npu.npu.amp.GradScaler(init_scale=128.0, dynamic=dynamic)
    scaler.scale((weight * float("inf")).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(weight.detach(), torch.ones(2))  # the step was skipped
    assert scaler.get_scale() == (64.0 if dynamic else 128.0)


# -- the policy, a trial and a profile on device "npu" -------------------------------------


def test_policy_resolves_with_the_npu_autocast_table(standin):
    model = load_task("digits-mlp").model()
    norms = [name for name, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    assert norms
    on_npu = Policy.uniform("fp16").resolve(model, "npu")
    assert all(on_npu[n] == "fp32" for n in norms)  # on the NPU's fp32 list
    on_cpu = Policy.uniform("fp16").resolve(model, "cpu")
    assert all(on_cpu[n] == "fp16" for n in norms)  # on no CPU list: follows its input
    prec = Policy.uniform("fp16").apply(model.to(get_backend("npu").device), "npu")
    assert prec.plan.device_kind == "npu" and not prec.plan.regions
    with prec.autocast():
        assert torch.isfinite(model(torch.rand(8, 64))).all()
    assert standin.calls_to("autocast") == [torch.float16]  # the backend's autocast("npu")
    prec.remove()


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_trial_runs_on_the_npu_with_the_allocator_peak(standin, dtype):
    standin.peak_bytes = 3 * 2**20
    task = load_task("digits-mlp")
    # A trial first watches its layers' classes on a real batch under each low dtype
    # the device has (once per class: `autoprec.numerics.observe`); what trains after is
    # the trial's own autocast.
    watch_task(task, task.model().to(get_backend("npu").device), get_backend("npu"))
    assert set(standin.calls_to("autocast")) == {torch.float16, torch.bfloat16}
    standin.reset()
    standin.peak_bytes = 3 * 2**20
    result = run_trial(task, Policy.uniform(dtype), get_backend("npu"), Budget(steps=12))
    assert result.state == "complete", result.reason
    assert result.steps_run == 12 and result.accuracy > 0.5
    assert result.peak_memory_mb == 3.0 and not result.peak_memory_is_estimate
    assert result.switches == {"hf32_matmul": False, "hf32_conv": True}
    resets = standin.calls_to("reset_peak_memory_stats")
    peaks = standin.calls_to("max_memory_allocated")
    assert resets and resets == peaks == [0] * len(resets)  # a pair per measured step, on npu:0
    autocasts = set(standin.calls_to("autocast"))
    assert autocasts == {torch.float16 if dtype == "fp16" else torch.bfloat16}


def test_profile_task_runs_on_the_npu(standin):
    profile = autoprec.profile_task("digits-mlp", "npu")
    assert profile.device == "npu:0" and profile.dtypes == ("fp16", "bf16")
    assert {m.name for m in profile.modules} >= {"fc1", "fc2", "head"}
    standin.soc = "Ascend910A"
    assert autoprec.profile_task("digits-mlp", "npu").dtypes == ("fp16",)


# -- the command line, in processes of their own -------------------------------------------


@pytest.mark.slow
def test_search_and_profile_from_the_command_line(tmp_path):
    done = cli(
        "search",
        "--task",
        "digits-mlp",
        "--device",
        "npu",
        "--trials",
        "3",
        "--steps",
        "12",
        "--no-progress",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "runs" / "digits-mlp" / "summary.json").read_text())
    assert summary["settings"]["device"] == "npu"
    assert summary["settings"]["devices"] == ["npu:0"]
    assert summary["peak_memory_is_estimate"] is False
    assert summary["baseline"]["switches"] == {"hf32_matmul": False, "hf32_conv": True}
    done = cli(
        "profile",
        "--task",
        "digits-mlp",
        "--device",
        "npu:1",
        cwd=tmp_path,
        NPU_STANDIN_DEVICES="2",
    )
    assert done.returncode == 0, done.stderr
    assert "on npu:1" in done.stdout


# -- the torch-npu export, run ---------------------------------------------------------------


@pytest.mark.parametrize(
    "policy",
    [
        Policy.uniform("fp16"),  # LayerNorms in fp32 by autocast only: allow_fp32_to_fp16
        Policy((Rule("fp32", ("fc2",)),), default="fp16", hf32=True),
        Policy.uniform("bf16"),
    ],
    ids=["fp16", "fp32-rule-hf32", "bf16"],
)
def test_the_exported_settings_run_against_the_stand_in(standin, tmp_path, monkeypatch, policy):
    model = load_task("digits-mlp").model()
    with pytest.warns(ExportWarning) if policy.default == "bf16" else nullcontext():
        export_policy(policy, "torch-npu", tmp_path, model=model)  # bf16: no such mode, it warns
    mode, _, _ = precision_mode(policy, model)
    monkeypatch.chdir(tmp_path)  # the file loads policy.yaml from beside it
    ran = runpy.run_path(str(tmp_path / "npu_settings.py"), init_globals={"model": model})
    assert standin.calls_to("set_option") == [{"ACL_PRECISION_MODE": mode}]
    assert standin.options == {"ACL_PRECISION_MODE": mode}
    hf32 = (False, True) if policy.hf32 is None else (policy.hf32, policy.hf32)
    assert (torch.npu.matmul.allow_hf32, torch.npu.conv.allow_hf32) == hf32
    prec = ran["prec"]
    assert prec.plan.device_kind == "npu"
    assert prec.plan.leaf_dtypes == policy.resolve(model, "npu")
    prec.remove()
