"""Search spaces: shipped files, fitting a model, suggestions, strict validation."""

from __future__ import annotations

import optuna
import pytest

from autoprec.errors import SpaceError
from autoprec.space import builtin_spaces, load_space
from autoprec.tasks import BUILTIN_TASKS, load_task


def test_shipped_spaces_load_and_fit_their_tasks():
    assert {"default", "digits-mlp", "digits-cnn"} <= set(builtin_spaces())
    for name in BUILTIN_TASKS:
        model = load_task(name).model()
        load_space(name).fit(model)
        load_space("default").fit(model)


def test_default_space_drops_optional_groups_the_model_lacks(tiny_task):
    fitted = load_space("default").fit(tiny_task.model())
    # The tiny task's LayerNorm runs in fp32 under autocast anyway: nothing to search.
    assert [g.name for g in fitted.groups] == ["linears"]


def test_suggest_searches_loss_scaling_only_with_fp16(tiny_task):
    space = load_space("default").fit(tiny_task.model())
    bf16 = space.suggest(optuna.trial.FixedTrial({"dtype.linears": "bf16"}))
    assert bf16.loss_scale.mode == "none"
    fp16 = space.suggest(
        optuna.trial.FixedTrial(
            {
                "dtype.linears": "fp16",
                "loss_scale.mode": "static",
                "loss_scale.static_scale_log2": 10,
            }
        )
    )
    assert fp16.loss_scale.mode == "static" and fp16.loss_scale.init_scale == 1024.0
    assert fp16.resolve(tiny_task.model())["fc1"] == "fp16"


def test_uniform_params_are_the_anchors(tiny_task):
    space = load_space("default").fit(tiny_task.model())
    policy = space.policy(space.uniform_params("fp16"))
    resolved = policy.resolve(tiny_task.model())
    assert resolved["norm"] == "fp32"  # autocast keeps LayerNorm in fp32
    assert {d for name, d in resolved.items() if name != "norm"} == {"fp16"}
    assert policy.loss_scale.mode == "dynamic" and policy.loss_scale.init_scale == 2.0**16


def test_restrict_removes_unsupported_dtypes(tiny_task):
    space = load_space("default").fit(tiny_task.model()).restrict({"fp32", "fp16"})
    assert all("bf16" not in g.dtypes for g in space.groups)


def _write(tmp_path, text):
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "groups:\n- {name: a, patterns: [fc1], dtypes: [fp8]}\n",
            "groups[0].dtypes: unknown dtype 'fp8'",
        ),
        ("groups: []\n", "groups: expected a non-empty list"),
        (
            "groups:\n- {name: a, patterns: [fc1]}\nloss_scale: {modes: [sometimes]}\n",
            "loss_scale.modes",
        ),
        (
            "groups:\n- {name: a, patterns: [fc1]}\nloss_scale: {init_scale_log2: [9, 3]}\n",
            "loss_scale.init_scale_log2",
        ),
        ("groups:\n- {name: a, patterns: [fc1]}\naccuracy_tolerance: -1\n", "accuracy_tolerance"),
        ("groups:\n- {name: a, patterns: [fc1]}\n- {name: a, types: [Linear]}\n", "named twice"),
        ("groups:\n- {name: a, patterns: [fc1], colour: red}\n", "groups[0].colour: unknown field"),
        ("groups: [\n", "not valid YAML"),
    ],
)
def test_bad_space_files(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(SpaceError) as caught:
        load_space(path)
    assert str(path) in str(caught.value)
    assert message in str(caught.value)


def test_group_that_matches_nothing(tmp_path, tiny_task):
    path = _write(tmp_path, "groups:\n- {name: enc, patterns: [encoder]}\n")
    with pytest.raises(
        SpaceError, match=r"groups\[0\] \(enc, patterns encoder\): matches no module"
    ):
        load_space(path).fit(tiny_task.model())


def test_missing_space():
    with pytest.raises(SpaceError, match="no such file, and not a shipped space"):
        load_space("nope.yaml")
