"""The optimizer states a search offers on its own (`autoprec.optim.offered`): in the
shipped ``default`` space (``optimizer_states: auto``) and under ``--prefer memory``,
wherever the task trains with Adam or AdamW, from the library installed; without one, one
line says so and the search goes on without states."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import autoprec
from autoprec.devices import get_backend
from autoprec.errors import AutoprecError, SpaceError
from autoprec.optim.space import StateSpace
from autoprec.report.gains import gains_line
from autoprec.space import SearchSpace, load_space
from autoprec.trials.training import Budget, TrainingTrials
from tests.conftest import make_tiny_task
from tests.token_task import token_task

pytest.importorskip("torchao.optim")

TORCHAO_KINDS = ("fp32", "8bit", "4bit", "fp8-bf16")
LAYERS_ONLY = {  # a space written by hand, without an optimizer_states section
    "name": "layers",
    "accuracy_tolerance": 0.05,
    "dtypes": ["fp32", "bf16"],
    "groups": [{"name": "all", "patterns": ["*"]}],
}
TOKEN_TASK = Path(__file__).with_name("token_task.py")


def fitted(task: autoprec.Task, space: SearchSpace, prefer: str | None = None) -> SearchSpace:
    """``space`` fitted as a search of ``task`` on the CPU fits it."""
    trials = TrainingTrials(
        task=task,
        model=task.model(),
        backend=get_backend("cpu"),
        budget=Budget(steps=10),
        prefer=prefer,
    )
    return trials.fit(space, None)


def test_the_default_space_offers_states_to_an_adamw_task():
    space = fitted(token_task(), load_space("default"))
    states = space.optimizer_states
    assert states is not None and states.library == "torchao"
    assert [(c.name, c.states) for c in states.groups] == [
        ("embeddings", TORCHAO_KINDS),
        ("rest", TORCHAO_KINDS),
    ]
    anchors = space.anchors()
    recipe = anchors["states-8bit-embeddings-fp32"]  # bitsandbytes' recipe
    assert (recipe["state.embeddings"], recipe["state.rest"]) == ("fp32", "8bit")
    msamp = anchors["states-msamp-o2"]
    assert (msamp["state.embeddings"], msamp["state.rest"]) == ("fp8-bf16", "fp8-bf16")
    assert space.policy(recipe).optimizer_states.to_dict()["groups"][1]["state"] == "8bit"
    assert space.notes == ()


def test_a_task_that_trains_with_sgd_is_offered_no_states():
    sgd = token_task(lambda params: torch.optim.SGD(params, lr=0.1))
    for prefer in (None, "memory"):
        space = fitted(sgd, load_space("default"), prefer)
        assert space.optimizer_states is None
        assert not any(name.startswith("states-") for name in space.anchors())
        assert space.notes == ()


def test_prefer_memory_offers_states_to_a_space_without_the_section():
    space = SearchSpace.from_dict(LAYERS_ONLY, "layers.yaml")
    assert fitted(token_task(), space, "speed").optimizer_states is None
    states = fitted(token_task(), space, "memory").optimizer_states
    assert states is not None
    assert [(c.name, c.states) for c in states.groups] == [
        ("embeddings", TORCHAO_KINDS),
        ("rest", TORCHAO_KINDS),
    ]


def test_a_section_written_by_hand_is_searched_as_written():
    written = {**LAYERS_ONLY, "optimizer_states": {"states": ["fp32", "8bit"]}}
    space = fitted(token_task(), SearchSpace.from_dict(written, "states.yaml"), "memory")
    assert space.optimizer_states is not None
    assert [(c.name, c.states) for c in space.optimizer_states.groups] == [
        ("all", ("fp32", "8bit"))
    ]


def test_a_model_whose_parameters_are_all_too_small_to_quantise_is_offered_none():
    small = make_tiny_task()  # 16 -> 32 -> 4: every tensor under 4,096 elements, Adam
    assert fitted(small, load_space("default"), "memory").optimizer_states is None


def test_optimizer_states_auto_is_read_and_another_word_refused():
    auto = SearchSpace.from_dict({**LAYERS_ONLY, "optimizer_states": "auto"}, "auto.yaml")
    assert auto.auto_states and auto.optimizer_states is None
    with pytest.raises(SpaceError) as error:
        SearchSpace.from_dict({**LAYERS_ONLY, "optimizer_states": "always"}, "odd.yaml")
    assert (
        str(error.value) == "odd.yaml: optimizer_states: expected a mapping or 'auto', got 'always'"
    )


def test_an_all_fp32_policy_of_bitsandbytes_states_is_the_tasks_own_optimizer():
    """The fp32 baseline trains with the task's optimizer, not bitsandbytes' 32-bit step."""
    offered = fitted(token_task(), load_space("default")).optimizer_states
    assert offered is not None
    bnb = StateSpace(offered.groups, library="bitsandbytes")
    all_fp32 = bnb.states({"state.embeddings": "fp32", "state.rest": "fp32"})
    assert all_fp32.all_fp32() and all_fp32.library == "torchao"
    recipe = bnb.states({"state.embeddings": "fp32", "state.rest": "8bit"})
    assert recipe.library == "bitsandbytes"


def _run_without(tmp_path: Path, missing: list[str], script: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh Python where the ``missing`` libraries cannot be imported
    (their ``sys.modules`` entries set to None, as Python marks a module that is not there)."""
    runner = tmp_path / "runner.py"
    blocked = "".join(f"sys.modules[{name!r}] = None\n" for name in missing)
    runner.write_text(f"import sys\n{blocked}{textwrap.dedent(script)}")
    return subprocess.run(
        [sys.executable, str(runner)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )


def test_without_torchao_the_states_of_bitsandbytes_are_offered(tmp_path):
    pytest.importorskip("bitsandbytes")
    done = _run_without(
        tmp_path,
        ["torchao"],
        f"""
        from autoprec.optim.offered import offered_states
        from autoprec.tasks import load_task

        task = load_task({f"{TOKEN_TASK}:token_task"!r})
        model = task.model()
        states = offered_states(model, task.make_optimizer(model.parameters())).states
        print(states.library, *[",".join(c.states) for c in states.groups])
        """,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["bitsandbytes", "fp32,8bit", "fp32,8bit"]


def test_without_either_library_one_line_says_so_and_the_search_goes_on(tmp_path):
    argv = [
        "search", "--task", f"{TOKEN_TASK}:token_task", "--prefer", "memory",
        "--trials", "1", "--steps", "10", "--device", "cpu", "--no-progress",
        "--storage", f"sqlite:///{tmp_path}/optuna.db",
        "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db",
        "--runs-dir", str(tmp_path / "runs"),
    ]  # fmt: skip
    done = _run_without(
        tmp_path,
        ["torchao", "bitsandbytes"],
        f"""
        from autoprec.cli import main

        sys.exit(main({argv!r}))
        """,
    )
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "optimizer states" in line]
    assert len(said) == 1
    assert "neither torchao nor bitsandbytes is installed" in said[0]
    assert "pip install torchao" in said[0]
    summary = json.loads((tmp_path / "runs/tokens/summary.json").read_text())
    assert [t["state"] for t in summary["trials"]] == ["complete"]
    for entry in [summary["baseline"], *summary["trials"]]:
        assert "optimizer" not in entry["policy"]
        assert not any(key.startswith("state.") for key in entry.get("params") or {})


@pytest.mark.slow  # torchao compiles its step once per process and state kind: minutes here
def test_a_search_that_prefers_memory_chooses_low_bit_states(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    space = SearchSpace.from_dict({**LAYERS_ONLY, "dtypes": ["fp32"]}, "layers.yaml")
    result = autoprec.search(
        token_task(), space, trials=3, steps=40, study="tokens", device="cpu", prefer="memory"
    )
    summary = result.typed
    assert summary is not None and not summary.best.is_baseline
    kept = result.best_policy.optimizer_states.assign(token_task().model())
    assert {state.state for state in kept.values()} & {"8bit", "4bit", "fp8-bf16"}
    best_mb = summary.best.metrics["optimizer_state_mb"]
    assert best_mb < summary.baseline.metrics["optimizer_state_mb"]
    assert f"optimizer state {best_mb:.2f} MB against fp32's" in gains_line(summary)


def test_under_fsdp2_on_the_cpu_offered_4bit_states_are_left_out_and_written_ones_refused(
    tmp_path,
):
    """torchao's 4-bit state fails on sharded parameters on the CPU: states the search
    offered go on without it, a section written by hand that lists it is refused."""
    from autoprec.distributed.launch import LaunchPlan

    plan = LaunchPlan(
        nproc=2,
        parallel="fsdp2",
        backend="gloo",
        group=["cpu", "cpu"],
        task_spec="unused",
        folder=tmp_path,
        limit_s=300.0,
    )
    offered = plan.fit(fitted(token_task(), load_space("default")))
    assert offered.optimizer_states is not None
    assert [c.states for c in offered.optimizer_states.groups] == [("fp32", "8bit", "fp8-bf16")] * 2
    written = {**LAYERS_ONLY, "optimizer_states": {"states": ["fp32", "4bit"]}}
    with pytest.raises(AutoprecError, match="4bit under --parallel fsdp2"):
        plan.fit(fitted(token_task(), SearchSpace.from_dict(written, "states.yaml")))
