"""fp8 in the search: the uniform-fp8 anchor, guided bisection over fp8, and the fragile
fp8 task (massive activations on marker rows in ``fc2``'s inputs), emulated on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from torch import nn

import autoprec
from autoprec import Policy
from autoprec.devices import get_backend
from autoprec.profile.guided import GuidedStrategy, Observation
from autoprec.space import SearchSpace, load_space
from autoprec.tasks import load_task
from tests.cpu_fp8 import trains_fp8

pytestmark = trains_fp8  # every test here trains in emulated fp8

pytest.importorskip("torchao.float8")
SHIPPED = Path(__file__).resolve().parents[1] / "search_spaces" / "fp8.yaml"
# The shipped space with tensorwise scaling only: the recipe that the outliers break
# (rowwise scales each row on its own, so the marker rows' outlier spares the others).
TENSORWISE = {**yaml.safe_load(SHIPPED.read_text()), "fp8_recipes": ["tensorwise"]}
GROUPS = """
name: fp8-hand
dtypes: [fp32, bf16, fp8]
fp8_recipes: [tensorwise, rowwise]
groups:
  - {name: fc1, patterns: [fc1]}
  - {name: fc2, patterns: [fc2]}
  - {name: fc3, patterns: [fc3]}
  - {name: head, patterns: [head]}
  - {name: norms, types: [LayerNorm]}
"""
EMULATED = get_backend("cpu", emulate="fp8")
UNIFORM_FP8 = {"fc1": "fp8", "fc2": "fp8", "fc3": "fp8", "head": "fp8", "norms": "bf16"}


def _fitted(text: str = GROUPS) -> SearchSpace:
    model = load_task("fp8-outliers").model()
    return SearchSpace.from_dict(yaml.safe_load(text), "fp8-hand.yaml").fit(model, device=EMULATED)


def _dtypes(params: dict) -> dict[str, str]:
    return {k.removeprefix("dtype."): v for k, v in params.items() if k.startswith("dtype.")}


def test_the_shipped_fp8_space_is_read_by_path():
    space = load_space(SHIPPED)
    assert space.offers_fp8 and space.dtypes == ("bf16", "fp8")


def test_the_uniform_fp8_anchor_puts_what_cannot_be_fp8_in_bf16():
    space = _fitted()
    anchors = space.anchors()
    fp8 = anchors["uniform-fp8"]
    assert _dtypes(fp8) == UNIFORM_FP8
    assert fp8["fp8.recipe"] == "tensorwise"  # torchao's default, though the space has two
    assert set(anchors) == {"uniform-bf16", "uniform-fp8"}
    assert space.policy(fp8).fp8_recipe == "tensorwise"
    # A space without fp8 has no such anchor.
    assert "uniform-fp8" not in _fitted(GROUPS.replace("fp32, bf16, fp8", "fp32, bf16")).anchors()


def test_guided_search_bisects_fp8_in_the_risk_order_and_keeps_in_bf16():
    """Seed uniform fp8; with fc2 riskiest, keep it (fp32 where offered) and the rest in
    fp8; once that is feasible, try the kept group in bf16."""
    space = _fitted()
    model = load_task("fp8-outliers").model()
    order = ["fc2", "norms", "fc3", "fc1", "head"]
    guide = GuidedStrategy(space, order, "speed", model, EMULATED)
    assert guide.low_dtypes == ["bf16", "fp8"]
    history: list[Observation] = []

    def step(feasible: bool) -> dict[str, str]:
        proposal = guide.propose(history)
        assert proposal is not None
        history.append(Observation(proposal[0], "complete", feasible, {"step_time_ms": 1.0}))
        return _dtypes(proposal[0])

    step(False)  # the bf16 seed: infeasible here, so that both seeds fail alike
    assert step(False) == UNIFORM_FP8
    # bf16's bisection comes first (the seeds tie); answer it infeasible until it is done.
    while True:
        proposal = guide.propose(history)
        assert proposal is not None
        if "fp8" in proposal[0].values():
            break
        history.append(Observation(proposal[0], "complete", False, {"step_time_ms": 1.0}))
    first = _dtypes(proposal[0])
    assert first == {"fc1": "fp8", "fc2": "fp32", "fc3": "fp8", "head": "fp8", "norms": "bf16"}
    assert proposal[1] == "bisect" and proposal[0]["fp8.recipe"] == "tensorwise"
    history.append(Observation(proposal[0], "complete", True, {"step_time_ms": 1.0}))
    assert step(True) == {**first, "fc2": "bf16"}  # refine: the kept group in bf16


@pytest.mark.slow
def test_search_keeps_the_outlier_layer_out_of_fp8(in_tmp):
    """The fp8 task, {bf16, fp8} with tensorwise scaling: uniform fp8 loses accuracy; the
    guided search keeps fc2 (the layer with the outlier inputs) in bf16 and runs the
    other Linear layers, most of the parameters, in fp8."""
    task = load_task("fp8-outliers")
    space = SearchSpace.from_dict(TENSORWISE, "fp8-tensorwise.yaml")
    result = autoprec.search(
        task, space, trials=4, steps=40, device="cpu", emulate=("fp8",), confirm_top=0
    )
    summary = result.summary
    anchors = {t["anchor"]: t for t in summary["trials"] if t["anchor"]}
    assert anchors["uniform-bf16"]["feasible"]
    uniform = anchors["uniform-fp8"]
    assert uniform["state"] == "pruned" or not uniform["feasible"]
    # The layers in fp8 of each feasible trial (emulated fp8 is slower than fp32 on the
    # CPU, so the chosen policy may well be fp32: what is asked is that one was found).
    model = task.model()
    linears = {n: m.weight.numel() for n, m in model.named_modules() if type(m) is nn.Linear}
    found = []
    for trial in summary["trials"]:
        if not trial["feasible"]:
            continue
        resolved = Policy.from_dict(trial["policy"]).resolve(model, EMULATED)
        in_fp8 = sum(size for name, size in linears.items() if resolved[name] == "fp8")
        if in_fp8 >= 0.5 * sum(linears.values()):
            found.append((trial["guided"], resolved))
    assert found, [t["params"] for t in summary["trials"]]
    assert all(resolved["fc2"] != "fp8" for _, resolved in found)
    assert found[0][0] == "bisect"  # the guided search's first step past the seed
