"""The guard in a plain loop: settings, promotion before failure, rollback and replay, the
record of every change, and quiet on a healthy run. Real training steps throughout."""

from __future__ import annotations

import math
import shutil
import subprocess
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from autoprec import Guard, GuardError, Policy, load_policy
from autoprec.guard.changes import PROMOTE, ROLLBACK, owning_leaves, promoted_policy
from autoprec.guard.precision import GuardedPrecision
from autoprec.tasks.zoo import zoo_task
from autoprec.trials.training import draw_batch, train_step

STEPS = 2000  # the zoo's real length
AUTOPREC = shutil.which("autoprec") or "autoprec"  # the command as a user types it


def guarded_run(name: str, dtype: str = "fp16", steps: int = STEPS, **settings):
    """The zoo task ``name`` trained ``steps`` under uniform ``dtype``, guarded, as the
    README's loop runs it (batches drawn through ``prec.guarded``)."""
    task = zoo_task(name)
    torch.manual_seed(0)
    model = task.model()
    model.train()
    prec = Policy.uniform(dtype).apply(model, guard=Guard(**settings))
    optimizer = task.make_optimizer(model.parameters())
    scheduler = task.make_scheduler(optimizer)
    if scheduler is not None:
        prec.track(scheduler)
    source = iter(task.train_data(0))
    cpu = torch.device("cpu")

    def batches():
        for step in range(steps):
            yield draw_batch(task, source, step, steps, _Cpu(cpu))

    losses = []
    for drawn in prec.guarded(batches()):
        loss, stepped = train_step(task, model, optimizer, prec, drawn, scheduler)
        losses.append(loss if stepped else None)
    return model, prec, optimizer, losses


class _Cpu:
    def __init__(self, device: torch.device) -> None:
        self.device = device


# -- settings ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"check_every": 0}, "guard.check_every: expected a whole number of steps"),
        ({"margin_bits": -1}, "guard.margin_bits: expected a number of bits from 0 to 16"),
        ({"snapshot_every": 75}, "guard.snapshot_every: 75 is not a multiple of check_every"),
        ({"promote": ("int8",)}, "guard.promote: 'int8' is not a dtype a layer can be promoted"),
        ({"promote": ("fp32", "bf16")}, "guard.promote: expected dtypes from narrow to wide"),
        ({"promote": ()}, "guard.promote: expected at least one dtype"),
        ({"lookahead": float("nan")}, "guard.lookahead: expected a multiple"),
    ],
)
def test_a_setting_out_of_range_is_refused_in_one_line(settings, message):
    with pytest.raises(GuardError) as caught:
        Guard(**settings)
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


def test_the_guard_section_round_trips_and_is_not_the_policys_identity(tmp_path):
    guarded = Policy(default="fp16", guard=Guard(check_every=25, snapshot_every=100))
    path = guarded.save(tmp_path / "policy.yaml")
    data = yaml.safe_load(path.read_text())
    assert data["guard"] == {
        "check_every": 25,
        "margin_bits": 3.0,
        "lookahead": 2.0,
        "snapshot_every": 100,
        "promote": ["bf16", "fp32"],
        "max_rollbacks": 8,
    }
    loaded = load_policy(path)
    assert loaded.guard == Guard(check_every=25, snapshot_every=100)
    assert loaded == Policy(default="fp16")  # the guard is how it runs, not what it is
    assert "guard" not in Policy(default="fp16").to_dict()
    (tmp_path / "on.yaml").write_text("default: fp16\nguard: true\n")
    assert load_policy(tmp_path / "on.yaml").guard == Guard()


def test_a_bad_guard_section_exits_2_in_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("default: fp16\nguard: {check_every: 0}\n")
    done = subprocess.run(
        [AUTOPREC, "resolve", "--policy", str(bad)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "guard.check_every" in lines[0] and "bad.yaml" in lines[0]
    assert "Traceback" not in done.stderr


def test_guard_false_runs_unguarded_and_true_takes_the_defaults():
    model = nn.Linear(4, 4)
    assert type(Policy(default="bf16", guard=Guard()).apply(model, guard=False)).__name__ == (
        "Precision"
    )
    prec = Policy(default="bf16").apply(nn.Linear(4, 4), guard=True)
    assert isinstance(prec, GuardedPrecision) and prec.settings == Guard()
    own = Policy(default="bf16", guard=Guard(check_every=10, snapshot_every=10))
    assert own.apply(nn.Linear(4, 4)).settings.check_every == 10  # the policy's own section


# -- promotion ----------------------------------------------------------------------------


def test_a_growing_layer_is_promoted_before_it_overflows():
    """zoo-exp-growth's head overflows fp16 at step 986 unguarded (the zoo's truth); the
    guard widens it first, and the run never sees a non-finite loss."""
    model, prec, optimizer, losses = guarded_run("zoo-exp-growth")
    assert all(math.isfinite(loss) for loss in losses if loss is not None)
    assert len(losses) == STEPS
    [change] = prec.changes
    assert change.action == PROMOTE
    assert change.layer == "head" and change.leaves == ("head",)
    assert (change.from_dtype, change.to_dtype) == ("fp16", "bf16")
    assert change.step < 986 and change.step % prec.settings.check_every == 0
    assert "65504" in change.reason and change.trend
    assert prec.plan.leaf_dtypes["head"] == "bf16"
    assert prec.plan.leaf_dtypes["body.fc1"] == "fp16"
    policy = yaml.safe_load(prec.current_policy())
    assert policy["rules"][0] == {
        "name": f"guard step {change.step}",
        "patterns": ["head"],
        "dtype": "bf16",
    }
    assert f"step {change.step}: promoted head fp16 -> bf16" in prec.summary()
    # The optimizer kept its state: Adam's step count is the run's, not the promotion's.
    head_weight = dict(model.named_parameters())["head.weight"]
    stepped = sum(loss is not None for loss in losses)  # the scaler skipped a few at first
    assert stepped > STEPS - 20
    assert int(optimizer.state[head_weight]["step"]) == stepped
    prec.remove()


def test_a_promotion_keeps_the_weights_optimizer_and_scale():
    """At the boundary where the guard promotes, nothing but the regions changes."""
    task = zoo_task("zoo-exp-growth")
    torch.manual_seed(0)
    model = task.model()
    prec = Policy.uniform("fp16").apply(model, guard=Guard())
    optimizer = task.make_optimizer(model.parameters())
    source = iter(task.train_data(0))
    before = None
    for step in range(400):
        drawn = draw_batch(task, source, step, 400, _Cpu(torch.device("cpu")))
        if step == 351:  # the boundary after step 350's check (the promotion is taken here)
            prec.update()  # the loss scale's own update ends every step, guarded or not
            before = (
                {k: v.clone() for k, v in model.state_dict().items()},
                prec.scaler.state_dict(),
                {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()},
                len(prec.changes),
            )
            prec._finish_step()  # the boundary itself, as the next autocast() takes it
            assert len(prec.changes) == before[3] + 1
            assert all(torch.equal(model.state_dict()[k], v) for k, v in before[0].items())
            assert prec.scaler.state_dict() == before[1]
            for param, state in optimizer.state.items():
                assert all(torch.equal(state[k], v) for k, v in before[2][id(param)].items())
        train_step(task, model, optimizer, prec, drawn)
    assert before is not None and prec.changes[0].step == 350


def test_a_promoted_layer_below_a_parameter_free_module_widens_its_owner():
    leaves = {"embed": "fp32", "attn.q": "fp16", "attn.k": "fp16", "head": "fp16"}
    assert owning_leaves("attn.scores", leaves) == ("attn", ("attn.q", "attn.k"))
    assert owning_leaves("head", leaves) == ("head", ("head",))
    assert owning_leaves("act", leaves) == ("", ("attn.q", "attn.k", "head"))


def test_promoted_rules_come_first_newest_first_and_name_the_leaves_alone():
    from autoprec.guard.changes import Change

    changes = [
        Change(10, PROMOTE, "head", ("net.head",), "fp16", "bf16", "x"),
        Change(20, PROMOTE, "head", ("net.head",), "bf16", "fp32", "y"),
        Change(30, PROMOTE, "odd", ("net.w[0]",), "fp16", "bf16", "z"),
    ]
    policy = promoted_policy(Policy(default="fp16"), changes, prefix="net.")
    assert [(r.patterns, r.dtype) for r in policy.rules] == [
        (("w[[]0]",), "bf16"),
        (("head",), "fp32"),
        (("head",), "bf16"),
    ]


# -- rollback -----------------------------------------------------------------------------


class Normalise(nn.Module):
    """Parameter-free: each row over its largest |value| (so what follows stays small)."""

    def forward(self, x):
        return x / x.abs().amax(dim=-1, keepdim=True).clamp(min=1.0)


class RareBatchNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            OrderedDict(fc1=nn.Linear(8, 16), norm=Normalise(), fc2=nn.Linear(16, 16))
        )
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.layers(x))


def rare_batch_net(**settings):
    """`RareBatchNet` in uniform fp16, guarded, with fc1's weights at 0.5 (so that an input
    of 1e6 overflows fc1's fp16 output), and its SGD optimizer."""
    torch.manual_seed(0)
    model = RareBatchNet()
    with torch.no_grad():
        model.layers.fc1.weight.fill_(0.5)
    prec = Policy.uniform("fp16").apply(model, guard=Guard(**settings))
    return model, prec, torch.optim.SGD(model.parameters(), lr=1e-3)


def test_a_forward_overflow_rolls_back_promotes_the_culprit_and_replays_the_same_batches():
    """A rare batch at step 130 overflows fp16 in the forward (no trend foretold it): the
    guard goes back to step 100's copy, widens the layer that first went non-finite, and
    the loop trains steps 100-130 again on the same batches."""
    model, prec, optimizer = rare_batch_net(check_every=50, snapshot_every=100)
    generator = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(4, 8, generator=generator) * (1e6 if step == 130 else 1.0), step)
        for step in range(200)
    ]
    seen = []
    losses = []
    for x, index in prec.guarded(data):
        seen.append(index)
        optimizer.zero_grad()
        with prec.autocast():
            out = model(x)
        loss = out.float().pow(2).mean()
        losses.append(float(loss.detach()))
        prec.backward(loss)
        prec.step(optimizer)
    [change] = prec.changes
    assert change.action == ROLLBACK
    assert (change.step, change.restored_step, change.replayed) == (130, 100, True)
    assert change.layer == "layers.fc1" and change.leaves == ("layers.fc1",)
    assert (change.from_dtype, change.to_dtype) == ("fp16", "bf16")
    assert "forward overflowed" in change.reason
    # Steps 100-130 were drawn twice, in order; every batch after them once.
    assert seen == [*range(131), *range(100, 200)]
    assert prec.step_count == 200
    assert all(math.isfinite(v) for v in model.state_dict()["head.weight"].flatten().tolist())
    assert "rolled back to step 100 (replayed)" in prec.summary()


def test_without_guarded_batches_a_rollback_restores_and_says_it_did_not_replay():
    model, prec, optimizer = rare_batch_net(check_every=50, snapshot_every=100)
    for step in range(140):
        x = torch.randn(4, 8) * (1e6 if step == 130 else 1.0)
        optimizer.zero_grad()
        with prec.autocast():
            loss = model(x).float().pow(2).mean()
        prec.backward(loss)
        prec.step(optimizer)
        if step == 129:
            at_129 = {k: v.clone() for k, v in model.state_dict().items()}
    prec._finish_step()
    [change] = prec.changes
    assert (change.action, change.restored_step, change.replayed) == (ROLLBACK, 100, False)
    assert prec.step_count == 100 + (139 - 130)  # the clock went back with the weights
    assert not all(torch.equal(model.state_dict()[k], at_129[k]) for k in at_129)


def test_a_failure_in_a_layer_already_fp32_cannot_be_mended():
    model = RareBatchNet()
    prec = Policy(default="fp32").apply(model, guard=Guard(check_every=10, snapshot_every=10))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    optimizer.zero_grad()
    with prec.autocast():
        loss = model(torch.full((2, 8), float("inf"))).float().sum()
    prec.backward(loss)
    assert prec.step(optimizer) is False  # nothing scales the loss: the guard checked
    with pytest.raises(GuardError, match="cannot be mended"):
        prec._finish_step()


# -- quiet where nothing fails, and cheap -----------------------------------------------------


def test_a_healthy_run_is_never_changed_and_watched_only_on_check_steps():
    model, prec, _, losses = guarded_run("zoo-my-task", steps=600)
    assert prec.changes == [] and prec.rollbacks == 0
    assert all(math.isfinite(loss) for loss in losses if loss is not None)
    assert sum(loss is None for loss in losses) < 20  # the scaler's start-up back-off
    assert prec._monitor is not None
    assert prec._monitor.observed_steps == 600 // prec.settings.check_every
    # The trends are refitted once the run has grown by a tenth: at every check to step
    # 500, then not at 550 (50 steps is less than a tenth of 550).
    assert prec.fitted_at == 500
    assert prec.snapshot_bytes > 0  # one copy of the weights and Adam's state, on the host
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert params * 3 <= prec.snapshot_bytes <= params * 3 + 4096


def test_no_hook_runs_on_steps_that_are_not_checked():
    model = RareBatchNet()
    prec = Policy.uniform("bf16").apply(model, guard=Guard(check_every=4, snapshot_every=4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    hooked = []
    for _ in range(8):
        optimizer.zero_grad()
        with prec.autocast():
            hooked.append(bool(model.layers.fc1._forward_hooks))
            loss = model(torch.randn(2, 8)).float().sum()
        prec.backward(loss)
        prec.step(optimizer)
    assert hooked == [True, False, False, False, True, False, False, False]


def test_state_dict_carries_the_changes_and_a_resumed_run_lands_the_promoted_policy():
    _, prec, _, _ = guarded_run("zoo-exp-growth", steps=400)
    state = prec.state_dict()
    assert state["guard"]["step"] == 400 and len(state["guard"]["changes"]) == 1
    task = zoo_task("zoo-exp-growth")
    fresh = task.model()
    resumed = Policy.uniform("fp16").apply(fresh, guard=Guard())
    assert resumed.plan.leaf_dtypes["head"] == "fp16"
    resumed.load_state_dict(state)
    assert resumed.plan.leaf_dtypes["head"] == "bf16"
    assert resumed.changes == prec.changes and resumed.step_count == 400
    assert resumed.current_policy() == prec.current_policy()


# -- fp8, and the record in MLflow ------------------------------------------------------------


def test_an_fp8_layer_whose_cast_flushes_goes_back_to_its_linear_with_its_state():
    """An outlier from step 10 on makes fp8's tensorwise scale flush most of fc1's inputs:
    the check at step 10 takes fc1 (and what the outlier reaches) out of fp8. The Linear
    comes back with the same Parameters, and AdamW's state carries on."""
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(16, 32), act=nn.ReLU(), fc2=nn.Linear(32, 16), head=nn.Linear(16, 16)
        )
    )
    guard = Guard(check_every=10, snapshot_every=20)
    prec = Policy.uniform("fp8").apply(model, guard=guard, emulate="fp8")
    assert type(model.fc1).__name__ == "Float8Linear"
    params = [id(p) for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    for step in range(40):
        x = torch.randn(32, 16, generator=generator)
        if step >= 10:
            x[0, 0] = 1e6
        optimizer.zero_grad()
        with prec.autocast():
            loss = model(x).float().pow(2).mean()
        prec.backward(loss)
        prec.step(optimizer)
    prec._finish_step()
    first = prec.changes[0]
    assert (first.step, first.layer, first.from_dtype, first.to_dtype) == (10, "fc1", "fp8", "bf16")
    assert "flushes" in first.reason and "inputs" in first.reason
    assert prec.plan.leaf_dtypes["fc1"] == "bf16"
    assert type(model.fc1) is nn.Linear
    assert params == [id(p) for p in model.parameters()]
    assert int(optimizer.state[model.fc1.weight]["step"]) == 40
    prec.remove()


def test_every_change_is_in_the_active_mlflow_run(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with mlflow.start_run() as run:
        _, prec, _, _ = guarded_run("zoo-exp-growth", steps=400)
    [change] = prec.changes
    client = mlflow.tracking.MlflowClient()
    done = client.get_run(run.info.run_id)
    assert done.data.tags["autoprec.guard"].startswith(f"1 change(s); last: step {change.step}")
    history = client.get_metric_history(run.info.run_id, "guard.changes")
    assert [(m.step, m.value) for m in history] == [(change.step, 1.0)]
    path = client.download_artifacts(run.info.run_id, "guard/changes.json", str(tmp_path))
    assert yaml.safe_load(Path(path).read_text()) == {"changes": [change.to_dict()]}


def test_a_culprit_already_in_fp32_widens_no_neighbour():
    leaves = {"fc1": "fp32", "fc2": "fp8", "head": "fp8"}
    assert owning_leaves("fc1", leaves) == ("fc1", ())
    assert owning_leaves("act", leaves) == ("", ("fc2", "head"))


def test_a_level_inside_the_margin_is_seen_without_a_fit():
    from autoprec.guard.changes import inside_margin
    from autoprec.numerics.forecast import RangeSeries

    series = RangeSeries()
    series.add_activation("head", 0, 1000.0, "fp16")
    assert not inside_margin(series, 3.0)  # 6 bits below 65504
    series.add_activation("head", 50, 9000.0, "fp16")
    assert inside_margin(series, 3.0)  # 2.9 bits below
    assert not inside_margin(series, 2.0)


def test_without_loss_scaling_a_non_finite_loss_is_the_guards_to_mend():
    """bf16 without scaling: the trials' own step hands a non-finite loss to a guarded
    precision (it skips the step and the guard rolls back), where unguarded it stops."""
    from autoprec.tasks.base import Task

    torch.manual_seed(0)
    model = RareBatchNet()
    prec = Policy.uniform("bf16").apply(model, guard=Guard(check_every=10, snapshot_every=10))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    task = Task("rare", RareBatchNet, lambda seed: [], lambda: [], loss=lambda o, t: o.sum())
    batch = task.batch((torch.full((2, 8), float("inf")), torch.zeros(2)))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    loss, stepped = train_step(task, model, optimizer, prec, [batch])
    assert not math.isfinite(loss) and stepped is False
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    assert (
        prec.checks_gradients and not Policy.uniform("bf16").apply(RareBatchNet()).checks_gradients
    )


def test_an_overflow_in_any_accumulated_batch_is_the_forwards():
    """With gradient accumulation, the step's first batch overflows and its last does not:
    the failure is still the forward's, and it is rolled back."""
    model, prec, optimizer = rare_batch_net(check_every=10, snapshot_every=10)
    for step in range(16):
        optimizer.zero_grad()
        for part in range(2):
            x = torch.randn(4, 8) * (1e6 if (step, part) == (15, 0) else 1.0)
            with prec.autocast():
                loss = model(x).float().pow(2).mean() / 2
            prec.backward(loss)
        prec.step(optimizer)
    prec._finish_step()
    [change] = prec.changes
    assert (change.action, change.step, change.restored_step) == (ROLLBACK, 15, 10)
    assert "forward overflowed" in change.reason and change.layer == "layers.fc1"
