"""Sensitivity profiling: the layer that really overflows ranks among the top three, on the
shipped overflow task and on held-out tasks written only against the Task contract."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import autoprec
from autoprec import Policy, Rule
from autoprec.devices import (
    CPUBackend,
    autocast_behaviour,
    failing_dtypes,
    get_backend,
    record_behaviour,
)
from autoprec.errors import AutoprecError, DeviceError, PolicyError, SpaceError, TaskError
from autoprec.numerics.observe import watch_task
from autoprec.precision.plan import parameterised_leaves
from autoprec.profile.sensitivity import Profile, _alone
from autoprec.space import load_space
from autoprec.tasks import load_task
from autoprec.tasks.builtin import Bottleneck, ResNet
from autoprec.trials.training import Budget, run_trial
from tests.boundary_tasks import no_fp16_training_task, training_kernel_task
from tests.contract_tasks import make_lstm_task
from tests.test_fragile_search import attention_overflow_task


def gain_cnn_task() -> autoprec.Task:
    """Held out: a CNN whose middle block multiplies its normalised activations by a large
    gain (an untuned residual scale); the next block's BatchNorm absorbs it in fp32, but
    in fp16 the block's outputs pass 65504."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(576, 3, 8, 8, generator=g)
    y = (x[:, 0].mean(dim=(1, 2)) > x[:, 1].mean(dim=(1, 2))).long()

    class Block(nn.Module):
        def __init__(self, channels_in: int, channels_out: int, gain: float = 1.0):
            super().__init__()
            self.conv = nn.Conv2d(channels_in, channels_out, 3, padding=1)
            self.bn = nn.BatchNorm2d(channels_out)
            self.gain = gain

        def forward(self, h):
            return F.relu(self.bn(self.conv(h))) * self.gain

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(Block(3, 8), Block(8, 16, gain=3e4), Block(16, 16))
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.head = nn.Linear(16, 2)

        def forward(self, images):
            return self.head(torch.flatten(self.pool(self.blocks(images)), 1))

    def train_data(seed):
        gen = torch.Generator().manual_seed(seed)
        while True:
            order = torch.randperm(512, generator=gen)
            for i in range(0, 512, 64):
                yield x[order[i : i + 64]], y[order[i : i + 64]]

    return autoprec.Task(
        "held-out-gain", Net, train_data, lambda: [(x[512:], y[512:])], F.cross_entropy
    )


@pytest.fixture(scope="module")
def overflow_profile() -> Profile:
    return autoprec.profile_task("digits-overflow")


@pytest.mark.parametrize(
    ("make_task", "culprit"),
    [
        (lambda: load_task("digits-overflow"), "features"),
        (attention_overflow_task, "attn"),
        (gain_cnn_task, "blocks.1"),
    ],
    ids=["digits-overflow", "held-out-attention", "held-out-gain-cnn"],
)
def test_the_overflowing_layer_ranks_in_the_top_three(make_task, culprit):
    task = make_task()
    profile = autoprec.profile_task(task, "cpu")
    assert culprit in [m.name for m in profile.modules[:3]]
    entry = next(m for m in profile.modules if m.name == culprit)
    assert math.isinf(entry.risk) and entry.stats["fp16"]["nonfinite"] == 1.0
    assert entry.reason.startswith("fp16: output non-finite")
    assert math.isfinite(entry.stats["bf16"]["risk"])  # bf16 has fp32's range
    # Every module but the root, ranked 1..n, riskiest first.
    names = [name for name, _ in task.model().named_modules() if name]
    assert sorted(m.name for m in profile.modules) == sorted(names)
    assert [m.rank for m in profile.modules] == list(range(1, len(names) + 1))
    risks = [m.risk for m in profile.modules]
    assert risks == sorted(risks, reverse=True)


class LoudBottleneck(Bottleneck):
    """A block whose output is scaled by a large gain, past fp16's range."""

    def forward(self, x):
        return super().forward(x) * 2e4


def test_a_150_module_resnet():
    def loud_resnet():
        model = ResNet()
        model.layer3[2] = LoudBottleneck(64, 16)
        return model

    task = dataclasses.replace(load_task("digits-resnet"), model=loud_resnet)
    profile = autoprec.profile_task(task)
    model = loud_resnet()
    assert len(profile.modules) == len(list(model.named_modules())) - 1 >= 149
    assert profile.modules[0].name == "layer3.2"
    # Modules before the loud block are unaffected.
    assert all(math.isfinite(m.risk) for m in profile.modules if m.name.startswith("layer1"))
    space = load_space("default").fit(model, profile)
    assert space.groups[0].name == "risk.layer3.2" and len(space.groups) <= 12
    assert space.group_risk(profile, model)[0] == ("risk.layer3.2", math.inf)


def test_overflow_shares_and_where_it_starts(overflow_profile):
    modules = {m.name: m for m in overflow_profile.modules}
    features = modules["features"]
    assert overflow_profile.modules[0] is features  # the origin, before what it feeds
    assert features.stats["fp16"]["act_above_max"] > 0.05
    assert features.stats["bf16"]["act_above_max"] == 0.0
    assert features.max_abs["act"] > 65504 > features.max_abs["input"]
    assert "of outputs above 65504" in features.reason
    # The LayerNorm behind it breaks in fp16 only because its inputs already do.
    assert "inputs already reach" in modules["norm_in"].reason
    assert modules["features.proj"].stats["fp16"]["act_above_max"] == 0.0


def test_a_healthy_task_has_finite_risks_and_no_overflow():
    profile = autoprec.profile_task("digits-mlp", dtypes=["fp16", "bf16"])
    assert profile.dtypes == ("fp16", "bf16")
    for module in profile.modules:
        assert 0 <= module.risk < 1, module.reason
        for dtype in profile.dtypes:
            stats = module.stats[dtype]
            assert stats["nonfinite"] == 0.0
            assert all(stats[f"{kind}_above_max"] == 0.0 for kind in ("act", "grad", "param_grad"))
            assert stats["output_deviation"] < 0.05
    fc1 = next(m for m in profile.modules if m.name == "fc1")
    assert fc1.leaf and fc1.parameters == 64 * 256 + 256 and fc1.type == "Linear"


def test_json_round_trip_and_table(overflow_profile, tmp_path):
    path = overflow_profile.save(tmp_path / "runs/study/profile.json")

    def no_bare_constants(name):
        raise AssertionError(f"{name} is not JSON")

    data = json.loads(path.read_text(), parse_constant=no_bare_constants)
    assert data["modules"][0]["risk"] == "inf"
    assert Profile.load(path) == overflow_profile
    assert Profile.from_dict(data) == overflow_profile

    table = overflow_profile.table(top=3)
    lines = table.splitlines()
    assert len(lines) == 2 + 3  # title, header, three modules
    assert lines[1].split()[:5] == ["rank", "module", "type", "params", "risk"]
    for rank, module in enumerate(overflow_profile.modules[:3], start=1):
        assert lines[1 + rank].split()[:2] == [str(rank), module.name]
    assert "inf" in lines[2] and "above 65504" in lines[2]


def test_group_risk_on_fitted_spaces(overflow_profile):
    model = load_task("digits-overflow").model()
    space = load_space("default").fit(model)
    risks = space.group_risk(overflow_profile, model)
    assert risks[0] == ("linears.features", math.inf)
    # On the CPU the LayerNorm after it is searched too, and in fp16 it overflows on the
    # features' fp32 output; it only passes the problem on, so it ranks second.
    assert risks[1] == ("norms.norm_in", math.inf)
    assert {name for name, _ in risks} == {g.name for g in space.groups}
    assert all(math.isfinite(risk) for _, risk in risks[2:])
    # Fitted with the profile, the culprit is a group of its own, first.
    guided = load_space("default").fit(model, overflow_profile)
    assert guided.groups[0].name == "risk.features"
    assert guided.group_risk(overflow_profile, model)[0] == ("risk.features", math.inf)
    hand = load_space("digits-overflow").fit(model)
    assert hand.group_risk(overflow_profile, model)[0] == ("features", math.inf)


class NoFp16(CPUBackend):
    def supports(self, dtype: str) -> bool:
        return dtype != "fp16"


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"steps": 0}, AutoprecError, "steps: expected a positive integer"),
        ({"dtypes": ["fp32"]}, AutoprecError, "dtypes: expected fp16 and/or bf16, got 'fp32'"),
        ({"dtypes": []}, AutoprecError, "dtypes: expected fp16 and/or bf16, got none"),
        ({"backend": "tpu"}, DeviceError, "unknown device"),
        ({"backend": NoFp16(), "dtypes": ["fp16"]}, DeviceError, "fp16: not supported"),
        ({"task": "no-such-task"}, TaskError, "no-such-task"),
    ],
)
def test_bad_input(tiny_task, kwargs, error, message):
    kwargs = {"task": tiny_task, **kwargs}
    with pytest.raises(error, match=message):
        autoprec.profile_task(kwargs.pop("task"), **kwargs)


def test_a_task_that_fails_in_fp32(tiny_task):
    broken = dataclasses.replace(tiny_task, loss=lambda outputs, targets: outputs.sum(dim=5))
    with pytest.raises(TaskError, match="'tiny': the fp32 pass failed \\(IndexError"):
        autoprec.profile_task(broken)


def test_bad_profiles(overflow_profile, tiny_task, tmp_path):
    with pytest.raises(AutoprecError, match="profile: malformed"):
        Profile.from_dict({"task": "x"})
    (tmp_path / "p.json").write_text("{")
    with pytest.raises(AutoprecError, match=r"p\.json: not a JSON profile"):
        Profile.load(tmp_path / "p.json")
    other = tiny_task.model()
    with pytest.raises(SpaceError, match="module 'features' is not in Sequential"):
        load_space("default").fit(other).group_risk(overflow_profile, other)
    with pytest.raises(SpaceError, match="fit the space"):
        load_space("default").group_risk(overflow_profile, other)


# -- the profile runs each module as the plan would ----------------------------------------


def test_the_profile_casts_a_layers_inputs_where_the_plan_does():
    """One rule for both: for every layer alone in a low dtype, the profile's region casts
    its inputs exactly where the plan of a policy naming that layer does (a LayerNorm on
    the CPU, which runs in its input's dtype, yes; a Linear, which autocast casts, no). For
    an LSTM the answer depends on the CPU's kernels (oneDNN runs some dtypes only on inputs
    already cast, and which ones varies with the instruction set): whatever was watched, a
    training step of the plan runs, or the policy is refused before it starts."""
    cpu = get_backend("cpu")
    for task in (load_task("digits-overflow"), make_lstm_task()):
        model = task.model()
        watch_task(task, model, cpu)
        casts = {}
        for name, _ in parameterised_leaves(model):
            for dtype in ("fp16", "bf16"):
                policy = Policy(rules=(Rule(dtype, patterns=(name,)),))
                planned = {r.name: r.cast_inputs for r in policy.plan(model, cpu).regions}
                alone = _alone(model, name, dtype, "cpu")
                casts[name, dtype] = {r.name: r.cast_inputs for r in alone.regions}[name]
                assert casts[name, dtype] == planned.get(name, False), (name, dtype)
        for dtype in ("fp16", "bf16"):
            assert casts.get(("norm_in", dtype), True) and not casts.get(("fc1", dtype), False)
            assert not casts.get(("head", dtype), False)
    for dtype in ("fp16", "bf16"):
        _assert_a_training_step_runs_or_is_refused(make_lstm_task(), lstm_policy(dtype))


def _assert_a_training_step_runs_or_is_refused(task: autoprec.Task, policy: Policy) -> None:
    """The probe's verdict against what training does on this machine: a policy the probe
    let through trains (forward, backward, step) without an exception; one it refused
    raises PolicyError before anything runs."""
    model = task.model()
    refused = any(
        dtype in failing_dtypes("cpu", module)
        for name, module in parameterised_leaves(model)
        for dtype in (policy.resolve(model, "cpu")[name],)
    )
    if refused:
        with pytest.raises(PolicyError, match="cannot run in"):
            policy.apply(model, "cpu")
        return
    prec = policy.apply(model, "cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, targets = next(iter(task.train_data(0)))
    with prec.autocast():
        outputs = model(inputs)
    prec.backward(task.loss(outputs.float(), targets))
    prec.step(optimizer)
    prec.remove()


def lstm_policy(dtype: str) -> Policy:
    return Policy(rules=(Rule(dtype, patterns=("lstm",)),), name=f"lstm-{dtype}")


def test_the_profiles_verdict_on_an_lstm_in_fp16_is_what_a_trial_of_it_does():
    """Embedding + LSTM on the CPU: the embedding hands the LSTM fp32, which oneDNN's fp16
    LSTM may not take in training (on some CPUs not even cast). The profile watches the
    LSTM as training runs it; whatever it finds, a trial agrees: where it measured the LSTM
    in fp16 (a deviation, no error), the trial trains without an exception; where fp16
    cannot run, the profile says why and the trial is refused before training."""
    task = make_lstm_task()
    profile = autoprec.profile_task(task, "cpu", dtypes=["fp16"])
    lstm = next(m for m in profile.modules if m.name == "lstm")
    if "fp16" in failing_dtypes("cpu", task.model().lstm):
        assert "fp16" in lstm.error and "cannot run in fp16" in lstm.error, lstm.reason
        with pytest.raises(PolicyError, match=r"lstm .*cannot run in fp16 on cpu"):
            run_trial(task, lstm_policy("fp16"), get_backend("cpu"), Budget(steps=6))
        return
    assert not lstm.error, lstm.reason
    assert math.isfinite(lstm.risk) and lstm.stats["fp16"]["output_deviation"] > 0
    result = run_trial(task, lstm_policy("fp16"), get_backend("cpu"), Budget(steps=6))
    assert result.state != "failed", result.reason
    assert result.low_precision_share > 0


class UnwatchedLSTM(nn.LSTM):
    """An LSTM class whose treatment under autocast was recorded as a matmul layer's
    (autocast casts what it needs): the plan then hands it its input uncast."""


def test_a_dtype_a_layer_cannot_run_in_as_the_plan_runs_it_is_failing_for_the_space():
    """Where the plan does not cast the LSTM's input, a low dtype may not run (oneDNN's
    LSTM, on fp32 inputs in training; which dtypes fail depends on the CPU). The profile,
    running it as the plan does, fails exactly where a trial of it fails, says so, and
    records the dtype as failing for that class, so that the space offers it no more and
    a policy that names it is refused before training."""
    record_behaviour("cpu", UnwatchedLSTM, "region")
    base = make_lstm_task()

    def model():
        net = base.model()
        net.lstm = UnwatchedLSTM(16, 32, batch_first=True)
        return net

    task = dataclasses.replace(base, name="lstm-unwatched", model=model)
    cpu = get_backend("cpu")
    trials = {d: run_trial(task, lstm_policy(d), cpu, Budget(steps=3)) for d in ("fp16", "bf16")}
    profile = autoprec.profile_task(task, "cpu", dtypes=["fp16", "bf16"])
    lstm = next(m for m in profile.modules if m.name == "lstm")
    fresh = model()
    space = load_space("default").fit(fresh)
    offered = next(g for g in space.groups if g.name == space.assignment(fresh)["lstm"]).dtypes
    for dtype, trial in trials.items():
        crashed = trial.state == "failed"
        assert (f"{dtype}:" in lstm.error) == crashed, (dtype, trial.reason, lstm.error)
        assert (dtype in failing_dtypes("cpu", fresh.lstm)) == crashed
        assert (dtype not in offered) == crashed
        if crashed:
            assert "primitive descriptor" in trial.reason
            with pytest.raises(PolicyError, match=rf"lstm .*cannot run in {dtype} on cpu"):
                run_trial(task, lstm_policy(dtype), cpu, Budget(steps=3))
        else:
            _assert_a_training_step_runs_or_is_refused(task, lstm_policy(dtype))


def test_a_kernel_that_runs_for_inference_only_is_probed_as_training_runs_it():
    """The mechanism behind oneDNN's fp16 LSTM on CPUs with avx512_fp16, reproduced on
    every CPU: a layer that runs an fp32 input under autocast for inference, but in a
    training step only on inputs already cast. Probed as training runs it, its inputs are
    cast (a probe without gradients let them through, and trials crashed), so trials in
    fp16, bf16 and mixes of both train."""
    task = training_kernel_task()
    model = task.model()
    watch_task(task, model, get_backend("cpu"))
    assert autocast_behaviour("cpu", model.kernel) == "cast"
    assert not failing_dtypes("cpu", model.kernel)
    for policy in (
        Policy.uniform("fp16"),
        Policy.uniform("bf16"),
        Policy(rules=(Rule("fp16", patterns=("kernel",)),), default="bf16"),
        Policy(rules=(Rule("bf16", patterns=("kernel",)),), default="fp32"),
    ):
        result = run_trial(task, policy, get_backend("cpu"), Budget(steps=3, warmup_steps=1))
        assert result.state != "failed", (policy, result.reason)
    profile = autoprec.profile_task(task, "cpu")
    assert not next(m for m in profile.modules if m.name == "kernel").error


def test_what_the_probe_cannot_train_is_refused_before_training_with_its_reason(tmp_path):
    """A layer without an fp16 backward: the probe's backward finds it, the space offers
    it fp32 and bf16 only, and a policy that names fp16 for it is refused before any step,
    in one line (the CLI: exit 2); bf16 trains."""
    task = no_fp16_training_task()
    model = task.model()
    cpu = get_backend("cpu")
    watch_task(task, model, cpu)
    assert "no fp16 backward kernel" in failing_dtypes("cpu", model.kernel)["fp16"]
    offered = load_space("default").fit(model).restrict({"fp32", "fp16", "bf16"})
    group = offered.assignment(model)["kernel"]
    assert "fp16" not in next(g for g in offered.groups if g.name == group).dtypes
    fp16 = Policy(rules=(Rule("fp16", patterns=("kernel",)),))
    with pytest.raises(PolicyError, match=r"^kernel \(NoFp16TrainingLinear\): cannot run in fp16"):
        run_trial(task, fp16, cpu, Budget(steps=3, warmup_steps=1))
    bf16 = Policy(rules=(Rule("bf16", patterns=("kernel",)),))
    assert run_trial(task, bf16, cpu, Budget(steps=3, warmup_steps=1)).state != "failed"
    path = fp16.save(tmp_path / "fp16.yaml")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "autoprec.cli",
            "resolve",
            "--policy",
            str(path),
            "--task",
            "tests/boundary_tasks.py:no_fp16_training_task",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot run in fp16 on cpu" in lines[0], done.stderr
    assert "no fp16 backward kernel" in lines[0]
