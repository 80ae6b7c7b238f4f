"""fp8 telemetry and the profile's fp8 risk: what torchao's float8 casts do to each fp8
layer (amax, scale, values past the format's range, flushes to zero), the profile's
ranking of the Linear layers by their fp8 deviation against bf16, and a failing fp8
trial's reason naming the layer, on the fp8 task through the real search."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

import autoprec
from autoprec import Policy
from autoprec.devices import get_backend
from autoprec.formats.fp8 import Fp8Layers
from autoprec.numerics.telemetry import GradientMonitor
from autoprec.profile.guided import GuidedStrategy, Observation
from autoprec.profile.sensitivity import Profile, profile_task
from autoprec.space import SearchSpace
from autoprec.space.fitting import fp8_group_order
from autoprec.tasks import load_task
from autoprec.trials.training import LAYERS_ARTIFACT, Budget, TrialResult, TrialState, run_trial
from tests.cpu_fp8 import trains_fp8

pytestmark = trains_fp8  # every test here trains in emulated fp8

pytest.importorskip("torchao.float8")
EMULATED = get_backend("cpu", emulate="fp8")
SHIPPED = Path(__file__).resolve().parents[1] / "search_spaces" / "fp8.yaml"
TENSORWISE = {**yaml.safe_load(SHIPPED.read_text()), "fp8_recipes": ["tensorwise"]}
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
E5M2_MAX = float(torch.finfo(torch.float8_e5m2).max)  # 57344
E4M3_SMALLEST = float(torch.finfo(torch.float8_e4m3fn).smallest_normal) * 2.0**-3  # 2**-9
OUTLIER = 2.0**20


def _outlier_step(recipe: str = "tensorwise") -> tuple[GradientMonitor, torch.Tensor, float]:
    """One observed step of a converted Linear whose input has one huge outlier, ordinary
    values of 1 (which the outlier's tensorwise scale crushes) and a row of 8s (which
    survive), and whose output gradient holds one value past e5m2's range."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16))
    Fp8Layers(model, ["0"], recipe)
    x = torch.ones(8, 32)
    x[0, 0] = OUTLIER
    x[1] = 8.0
    monitor = GradientMonitor(model)
    big_grad = 1e5
    with monitor.activations():
        out = model(x)
        weights = torch.full_like(out, 1e-3)
        weights[2, 3] = big_grad
        (out * weights).sum().backward()
    monitor.observe_gradients()
    return monitor, x, big_grad


def test_fp8_telemetry_counts_the_outlier_scale_flushes_and_values_past_the_range():
    monitor, x, big_grad = _outlier_step()
    (row,) = monitor.report()["layers"]
    scale = E4M3_MAX / OUTLIER  # torchao's tensorwise scale: fp8 max / amax
    assert row["fp8_input_amax"] == OUTLIER
    assert row["fp8_input_scale"] == pytest.approx(scale)
    # The ones scale below half of e4m3's smallest subnormal and flush; the 8s and the
    # outlier survive. Only the outlier is past 448 before scaling; none clamps after it.
    assert 1.0 * scale < E4M3_SMALLEST / 2 < 8.0 * scale
    assert row["fp8_input_flushed"] == int((x == 1.0).sum())
    assert row["fp8_input_flushed_share"] == pytest.approx(int((x == 1.0).sum()) / x.numel())
    assert row["fp8_input_above_max"] == 1 and row["fp8_input_saturated"] == 0
    # The output gradient is cast to e5m2 under tensorwise: one value past 57344.
    assert big_grad > E5M2_MAX
    assert row["fp8_grad_output_above_max"] == 1
    assert row["fp8_grad_output_amax"] == pytest.approx(big_grad)
    assert row["fp8_weight_above_max"] == 0 and row["fp8_weight_flushed"] == 0
    fp8 = monitor.fp8.stats["0"]
    assert fp8.casts["input"].format == "e4m3" and fp8.casts["grad_output"].format == "e5m2"
    assert any(w.startswith("fp8 flush:") and "0's nonzero inputs" in w for w in monitor.warnings())
    assert monitor.fp8.evidence().startswith("fp8: 0 flushes")
    # The fields are in the trial's per-layer CSV artifact.
    result = TrialResult(TrialState.COMPLETE, telemetry=monitor.report())
    csv_text = result.artifacts()[LAYERS_ARTIFACT]
    assert "fp8_input_flushed" in csv_text.splitlines()[0]


def test_rowwise_scaling_spares_the_rows_without_the_outlier():
    """Rowwise scales each row by its own amax (rounded down to a power of 2, as torchao's
    rowwise recipe does): only the outlier's row loses its ones."""
    monitor, x, _ = _outlier_step("rowwise")
    row = monitor.report()["layers"][0]
    assert row["fp8_input_flushed"] == int((x[0] == 1.0).sum())
    smallest = 2.0 ** math.floor(math.log2(E4M3_MAX / OUTLIER))  # the outlier row's scale
    assert row["fp8_input_scale"] == smallest


def test_telemetry_of_a_model_without_fp8_layers_has_no_fp8_fields():
    model = nn.Sequential(nn.Linear(4, 4))
    monitor = GradientMonitor(model)
    with monitor.activations():
        model(torch.ones(2, 4)).sum().backward()
    monitor.observe_gradients()
    assert not any(k.startswith("fp8_") for k in monitor.report()["layers"][0])
    assert monitor.fp8.evidence() is None


def test_profile_ranks_the_outlier_layer_riskiest_in_fp8_and_guides_fp8_by_it():
    task = load_task("fp8-outliers")
    profile = profile_task(task, EMULATED)
    ranked = profile.fp8_order()
    assert ranked[0].name == "fc2"  # the layer whose inputs carry the outlier channel
    assert {m.name for m in ranked} == {"fc1", "fc2", "fc3", "head"}  # the Linear layers
    assert ranked[0].fp8_risk > 10 * ranked[1].fp8_risk
    assert "flush" in ranked[0].fp8_reason and profile.fp8_recipe == "tensorwise"
    assert "fc2" in profile.fp8_table().splitlines()[2]
    # The search keeps the study's brief profile: the fp8 risks survive it.
    kept = Profile.from_dict(profile.brief())
    assert [m.name for m in kept.fp8_order()] == [m.name for m in ranked]
    # The guided search bisects fp8 in that order: its first fp8 probe keeps fc2's group.
    model = task.model()
    space = SearchSpace.from_dict(TENSORWISE, "fp8.yaml").fit(model, profile, EMULATED)
    fp8_order = fp8_group_order(space, profile, model)
    assigned = space.assignment(model, "cpu")
    assert fp8_order[0] == assigned["fc2"]
    # A contrary fp16/bf16 order: the fp8 bisection still follows the fp8 risk.
    contrary = list(reversed(fp8_order))
    guide = GuidedStrategy(space, contrary, "speed", model, EMULATED, fp8_risk_order=fp8_order)
    history = []
    for _ in range(3):
        proposal = guide.propose(history)
        assert proposal is not None
        if proposal[1] == "bisect":
            break
        history.append(Observation(proposal[0], "complete", False, {"step_time_ms": 1.0}))
    assert proposal[1] == "bisect"
    assert proposal[0][f"dtype.{assigned['fc2']}"] != "fp8"
    assert all(proposal[0][f"dtype.{assigned[n]}"] == "fp8" for n in ("fc1", "fc3", "head"))


def test_a_profile_where_fp8_does_not_run_has_no_fp8_risk():
    profile = profile_task("fp8-outliers", "cpu")
    assert profile.fp8_recipe == "" and profile.fp8_order() == []
    assert profile.fp8_table() == ""


@pytest.mark.slow  # a whole search end to end: the everyday subset skips it
def test_an_fp8_trial_that_crushes_the_outlier_layer_names_it():
    task = load_task("fp8-outliers")
    policy = Policy.from_dict({"default": "bf16", "rules": [{"types": ["Linear"], "dtype": "fp8"}]})
    result = run_trial(task, policy, EMULATED, Budget(steps=4, warmup_steps=1))
    assert result.reason is not None and result.reason.startswith("fp8: fc2 flushes")
    assert "keep fc2 out of fp8" in result.reason
    # With fc2 in bf16, no fp8 layer flushes: no reason.
    kept = Policy.from_dict(
        {
            "default": "bf16",
            "rules": [
                {"patterns": ["fc2"], "dtype": "bf16"},
                {"types": ["Linear"], "dtype": "fp8"},
            ],
        }
    )
    assert run_trial(task, kept, EMULATED, Budget(steps=4, warmup_steps=1)).reason is None


@pytest.mark.slow
def test_the_uniform_fp8_anchor_is_infeasible_with_a_reason_that_names_the_layer(in_tmp):
    result = autoprec.search(
        "fp8-outliers",
        SearchSpace.from_dict(TENSORWISE, "fp8-tensorwise.yaml"),
        trials=2,
        steps=40,
        device="cpu",
        emulate=("fp8",),
        confirm_top=0,
    )
    anchors = {t["anchor"]: t for t in result.summary["trials"] if t["anchor"]}
    uniform = anchors["uniform-fp8"]
    assert not uniform["feasible"]
    assert "fc2" in uniform["reason"] and "flushes" in uniform["reason"]
    assert "fc2" not in (anchors["uniform-bf16"]["reason"] or "")
