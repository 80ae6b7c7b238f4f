"""The README's loop with the policy's optimizer (``policy.optimizer``) in place of the
user's own: under a policy whose optimizer section keeps one group's states high and the
rest in 8 bits, it trains to the accuracy a search's trial of that policy measured, to the
last bit (the same seed, batches, kernels and steps).

The loop is the README's (``load_task``, ``policy.apply``, ``prec.autocast``,
``prec.backward``, ``prec.step``), on the built-in rare-features task, whose optimizer is
AdamW at lr 3e-3."""

from __future__ import annotations

import pytest
import torch

from autoprec import Policy
from autoprec.devices import get_backend
from autoprec.tasks import load_task
from autoprec.trials.training import Budget, run_trial

pytest.importorskip("torchao.optim")

STEPS = 200  # the rare-features search's trial length
POLICY = """
name: inputs-bf16-rest-8bit
default: fp32
optimizer:
  state: 8bit
  groups:
    - {name: inputs, patterns: [inputs], state: bf16}
"""


def _readme_loop(policy: Policy) -> float:
    task = load_task("rare-features")  # the task the search ran
    torch.manual_seed(0)  # the trial's seed
    model = task.model()  # a fresh fp32 model
    loader = task.train_data(seed=0)
    prec = policy.apply(model, device="cpu")
    optimizer = policy.optimizer(model, torch.optim.AdamW, lr=3e-3)
    for _step, (x, y) in zip(range(STEPS), loader, strict=False):
        optimizer.zero_grad()
        with prec.autocast():
            out = model(x)
        loss = task.loss(out.float(), y)
        prec.backward(loss)
        prec.step(optimizer)
    model.eval()
    scores, rows = 0.0, 0
    with torch.no_grad(), prec.autocast():
        for x, y in task.val_data():
            scores += task.metric(model(x), y) * len(y)
            rows += len(y)
    return scores / rows


@pytest.mark.slow  # torchao compiles its 8-bit and bf16 steps on first use
def test_the_readme_loop_with_the_policys_optimizer_trains_to_the_trials_accuracy():
    policy = Policy.from_yaml(POLICY)
    task = load_task("rare-features")
    trial = run_trial(task, policy, get_backend("cpu"), Budget(steps=STEPS))
    assert trial.state == "complete" and trial.accuracy is not None, trial.reason
    states = trial.metrics().get("optimizer_state_mb")
    assert states is not None and states < 0.5 * 2.196  # 8-bit states stored, not fp32's
    assert _readme_loop(policy) == trial.accuracy
    # Here the policy holds (0.999, as fp32). With oneDNN held to AVX2 its hidden.weight's
    # 8-bit states collapse too (0.518 in the trial and in the loop alike): whether it
    # holds is the search's to measure (tests/test_rare_features.py).
