"""A trial whose quantised optimizer state hurts names the group and the mechanism, and a
trial with fp32 states measures what each kind's quantiser would lose on them: real
training of a one-layer model, whose only weight (4,352 elements, so torchao quantises
its states) reads rare one-hot codes beside raw measurements ten times their size, as the
built-in ``rare-features`` task does. One weight shape: torchao compiles one step."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import autoprec
from autoprec.devices import get_backend
from autoprec.numerics.state_health import (
    BLOWUP,
    SATURATION,
    UNDERFLOW,
    GroupStateHealth,
    StateHealth,
    adam_step_bound,
)
from autoprec.optim.state import OptimizerStates, StateGroup
from autoprec.policy import Policy
from autoprec.study.summary_schema import Entry
from autoprec.trials.training import Budget, TrialResult, run_trial

pytest.importorskip("torchao.optim")

DENSE, CODES, OUT = 16, 256, 16  # inputs.weight: 16 x 272 = 17 blocks of 256


class Codes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inputs = nn.Linear(DENSE + CODES, OUT, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inputs(x)


def rows(seed: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    z = torch.randn(count, DENSE, generator=generator)
    code = torch.randint(0, CODES, (count,), generator=generator)
    fixed = torch.Generator().manual_seed(7)
    weights = torch.randn(DENSE, OUT, generator=fixed) / DENSE**0.5
    offsets = 0.5 * torch.randn(CODES, OUT, generator=fixed)
    x = torch.cat([10.0 * z, F.one_hot(code, CODES).float()], 1)
    return x, z @ weights + offsets[code]


def codes_task() -> autoprec.Task:
    def train_data(seed: int):
        step = 0
        while True:
            yield rows(seed * 1_000_003 + step, 256)
            step += 1

    return autoprec.Task(
        "codes",
        Codes,
        train_data,
        lambda: [rows(2**31, 512)],
        F.mse_loss,
        metric=lambda out, y: -float(F.mse_loss(out.float(), y)),
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
    )


def policy(state: str) -> Policy:
    group = StateGroup(patterns=("inputs",), state=state, name="inputs")
    return Policy(optimizer_states=OptimizerStates(groups=(group,)))


def trial(state: str) -> TrialResult:
    return run_trial(codes_task(), policy(state), get_backend("cpu"), Budget(steps=30))


def test_8bit_states_that_collapse_name_the_group_and_the_mechanism_everywhere():
    result = trial("8bit")
    [group] = result.state_groups()
    assert (group.group, group.state, group.parameters, group.elements) == (
        "inputs",
        "8bit",
        1,
        4352,
    )
    # Rare codes' second moments stored as 0 under a live first moment, and their steps
    # past Adam's bound. Which of the two the last step's states still show moves with
    # the CPU's kernels: here both; with oneDNN held to AVX2 the first moments had also
    # rounded to 0 by then, and only the blown-up steps remain.
    assert group.blown_up_share > 0.0
    assert BLOWUP in group.mechanisms and set(group.mechanisms) <= {UNDERFLOW, BLOWUP}
    if group.collapsed_share > 0.0:
        assert group.mechanisms[0] == UNDERFLOW
    assert group.worst_parameter == "inputs.weight"
    assert group.reason is not None
    assert group.reason.startswith("optimizer state of group inputs: inputs.weight (Linear")
    if UNDERFLOW in group.mechanisms:
        assert "lr * exp_avg / eps" in group.reason
    assert result.reason is not None and group.reason in result.reason
    # MLflow: the figures as metrics, the reason as a tag, in the trial's one batch.
    metrics = result.extra_metrics()
    assert metrics["state_health.inputs.collapsed_share"] == group.collapsed_share
    assert result.run_tags() == {"state_reason.inputs": group.reason}
    # summary.json: typed, and back.
    fields = result.entry_fields()
    entry = Entry(1, "complete", {}, {}, False, False, state_health=fields["state_health"])
    assert Entry.from_json(entry.to_json()).state_health == [group]
    stored = TrialResult.from_dict(result.to_dict())  # as the study keeps it
    assert stored.state_groups() == [group]


def test_fp32_states_are_healthy_and_measure_what_each_kind_would_lose():
    result = trial("fp32")
    [group] = result.state_groups()
    assert group.mechanisms == () and group.reason is None
    assert 0.0 < group.update_weight_ratio < 1.0
    losses = {loss.kind: loss for loss in result.state_losses()}
    assert set(losses) == {"bf16", "8bit", "4bit", "fp8", "fp8-bf16"}
    assert losses["8bit"].quantised_elements == 4352
    assert losses["8bit"].collapsed_share > 0.0  # what the 8-bit trial then shows
    assert losses["bf16"].collapsed_share == 0.0  # bf16 has fp32's range
    assert losses["4bit"].collapsed_share == 0.0  # torchao's 4-bit second moment has no 0
    assert 0.0 < losses["bf16"].second_moment_rel_error < 0.01
    assert result.extra_metrics()["state_loss.inputs.8bit.collapsed_share"] == (
        losses["8bit"].collapsed_share
    )


def test_summaries_written_before_state_reasons_still_load():
    old = {"number": 3, "state": "complete", "metrics": {}, "params": {}}
    entry = Entry.from_json(old)
    assert entry.state_health == [] and entry.state_loss == []
    assert "state_health" not in entry.to_json()


def test_each_mechanism_is_named():
    base = dict(parameter="w", module_type="Linear", stored_as="OptimState8bit", elements=10)
    health = StateHealth(**base, zero_second_moment_share=0.0, collapsed_share=0.0)
    assert health.mechanisms == () and health.reason() is None
    saturated = StateHealth(
        **base, zero_second_moment_share=0.0, collapsed_share=0.0, saturated_share=0.1
    )
    assert saturated.mechanisms == (SATURATION,)
    assert "saturates" in (saturated.reason() or "")
    blown = StateHealth(
        **base,
        zero_second_moment_share=0.0,
        collapsed_share=0.0,
        blown_up_share=0.2,
        update_weight_ratio=3.0,
    )
    assert blown.mechanisms == (BLOWUP,)
    assert "updates blow up past Adam's bound in 20.00%" in (blown.reason() or "")
    group = GroupStateHealth("g", "8bit", 1, 10, 0.0, 0.0, 0.1, 0.2, 3.0, "w", (SATURATION,))
    assert GroupStateHealth.from_json(group.to_json()) == group


def test_adams_bound_holds_for_exact_moments_and_is_reached():
    """|m_hat| / sqrt(v_hat) of exact moments never exceeds the bound (random gradients of
    any scale), and gradients growing by beta2 / beta1 a step reach it."""
    beta1, beta2 = 0.9, 0.999

    def ratios(gradients: list[float]) -> list[tuple[float, float]]:
        m = v = 0.0
        found = []
        for t, g in enumerate(gradients, 1):
            m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
            ratio = abs(m / (1 - beta1**t)) / math.sqrt(v / (1 - beta2**t))
            found.append((ratio, adam_step_bound(beta1, beta2, t)))
        return found

    generator = torch.Generator().manual_seed(0)
    scales = 10 ** (6 * torch.rand(300, generator=generator) - 3)
    noisy = (torch.randn(300, generator=generator) * scales).tolist()
    assert all(ratio <= bound * (1 + 1e-9) for ratio, bound in ratios(noisy))
    growing = [(beta2 / beta1) ** i for i in range(60)]
    assert all(ratio == pytest.approx(bound, rel=1e-9) for ratio, bound in ratios(growing))
    assert adam_step_bound(0.999, 0.9, 5) == math.inf  # beta1**2 >= beta2: no bound


def test_a_trials_mlflow_writes_split_only_past_mlflows_limits():
    from autoprec.tracking import MAX_ENTITIES, MAX_PARAMS_TAGS, _batches

    assert len(_batches(list(range(900)), list(range(40)), list(range(20)))) == 1
    many = _batches(list(range(2500)), list(range(150)), list(range(120)))
    assert all(
        len(b["params"]) <= MAX_PARAMS_TAGS and len(b["tags"]) <= MAX_PARAMS_TAGS for b in many
    )
    assert all(len(b["metrics"]) + len(b["params"]) + len(b["tags"]) <= MAX_ENTITIES for b in many)
    assert sorted(m for b in many for m in b["metrics"]) == list(range(2500))
    assert sum(len(b["params"]) for b in many) == 150 and sum(len(b["tags"]) for b in many) == 120
