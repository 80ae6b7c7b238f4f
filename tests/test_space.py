"""Search spaces: shipped files, fitting a model, suggestions, strict validation."""

from __future__ import annotations

import math
import re
from collections import OrderedDict

import optuna
import pytest
import torch
from torch import nn

import autoprec.trials
from autoprec.errors import SpaceError
from autoprec.profile.sensitivity import ModuleRisk, Profile
from autoprec.space import builtin_spaces, load_space, searched_leaves
from autoprec.tasks import BUILTIN_TASKS, load_task


def test_shipped_spaces_load_and_fit_their_tasks():
    assert {"default", "digits-mlp", "digits-cnn"} <= set(builtin_spaces())
    for name in BUILTIN_TASKS:
        model = load_task(name).model()
        if name in builtin_spaces():  # digits-resnet has none: the default fits it
            load_space(name).fit(model)
        load_space("default").fit(model)


def test_default_space_searches_what_the_device_lets_a_policy_change(tiny_task):
    # On CUDA (and Ascend) autocast keeps LayerNorm in fp32: nothing to search. On the CPU
    # it runs in its input's dtype, so a policy decides it.
    cuda = load_space("default").fit(tiny_task.model(), device="cuda")
    assert [g.name for g in cuda.groups] == ["linears.fc1", "linears.head"]
    cpu = load_space("default").fit(tiny_task.model())
    assert [g.name for g in cpu.groups] == ["norms.norm", "linears.fc1", "linears.head"]


def test_a_fitted_space_keeps_the_fingerprint_studies_recorded_it_with(tiny_task):
    """The fingerprint still hashes "inference", true where the mode's rules convert the
    weights: a study started before the modes owned their space rules continues."""
    space = load_space("default")
    training = space.fit(tiny_task.model(), device="cpu")
    assert training.mode == "training" and training.fingerprint() == "c409579de671"
    for name in ("serving", "inference"):  # its earlier name fits the same space
        serving = space.fit(tiny_task.model(), device="cpu", mode=name)
        assert serving.mode == "serving" and serving.fingerprint() == "251599d28304"


def test_a_mode_without_space_rules_of_its_own_fits_its_spaces_as_training(tiny_task, monkeypatch):
    class Plain(autoprec.trials.Mode):
        name = "plain"
        trials = "tests.test_third_mode:CountingTrials"

    monkeypatch.setitem(autoprec.trials.MODES, "plain", Plain())
    space = load_space("default")
    plain = space.fit(tiny_task.model(), device="cpu", mode="plain")
    training = space.fit(tiny_task.model(), device="cpu")
    assert plain.mode == "plain" and plain.fingerprint() == training.fingerprint()
    assert plain.anchors() == training.anchors()


def test_suggest_searches_loss_scaling_only_with_fp16(tiny_task):
    space = load_space("default").fit(tiny_task.model(), device="cuda")
    bf16 = space.suggest(
        optuna.trial.FixedTrial({"dtype.linears.fc1": "bf16", "dtype.linears.head": "bf16"})
    )
    assert bf16.loss_scale.mode == "none"
    fp16 = space.suggest(
        optuna.trial.FixedTrial(
            {
                "dtype.linears.fc1": "fp16",
                "dtype.linears.head": "fp32",
                "loss_scale.mode": "static",
                "loss_scale.static_scale_log2": 10,
            }
        )
    )
    assert fp16.loss_scale.mode == "static" and fp16.loss_scale.init_scale == 1024.0
    assert fp16.resolve(tiny_task.model())["fc1"] == "fp16"
    assert fp16.resolve(tiny_task.model())["head"] == "fp32"


def test_uniform_params_are_the_anchors(tiny_task):
    for kind in ("cpu", "cuda"):
        space = load_space("default").fit(tiny_task.model(), device=kind)
        policy = space.policy(space.uniform_params("fp16"))
        resolved = policy.resolve(tiny_task.model(), kind)
        assert resolved["norm"] == ("fp16" if kind == "cpu" else "fp32")  # CUDA keeps it
        assert {d for name, d in resolved.items() if name != "norm"} == {"fp16"}
        assert policy.loss_scale.mode == "dynamic" and policy.loss_scale.init_scale == 2.0**16


@pytest.mark.parametrize(
    ("task_name", "last_layer"),
    [("digits-mlp", "head"), ("digits-cnn", "head"), ("tiny-bert", "classifier")],
)
def test_serving_anchors_keep_the_output_layer_in_fp32_whatever_its_group_is_called(
    task_name, last_layer
):
    if task_name.startswith("tiny-"):
        pytest.importorskip("transformers")
    model = load_task(task_name).model()
    space = load_space("default").fit(model, mode="serving")
    anchors = space.anchors()
    assert {"uniform-fp16", "uniform-bf16", "uniform-int8", "fp16-body-fp32-head"} <= set(anchors)
    resolved = space.policy(anchors["fp16-body-fp32-head"]).resolve_served(model)
    assert resolved[last_layer] == "fp32"
    assert {d for name, d in resolved.items() if space.assignment(model)[name] != space.head} == {
        "fp16"
    }


def test_restrict_removes_unsupported_dtypes(tiny_task):
    space = load_space("default").fit(tiny_task.model()).restrict({"fp32", "fp16"})
    assert all("bf16" not in g.dtypes for g in space.groups)
    # An automatic space restricted before it is fitted builds its groups without them.
    space = load_space("default").restrict({"fp32", "fp16"}).fit(tiny_task.model())
    assert all("bf16" not in g.dtypes for g in space.groups)


def _write(tmp_path, text):
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "groups:\n- {name: a, patterns: [fc1], dtypes: [fp4]}\n",
            "groups[0].dtypes: unknown dtype 'fp4'",
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


# -- groups: auto ---------------------------------------------------------------------------


def _auto_space(tmp_path, max_groups=12, own_groups=3):
    return load_space(
        _write(
            tmp_path,
            f"groups: auto\nauto_groups: {{max_groups: {max_groups}, own_groups: {own_groups}}}\n",
        )
    )


def _fake_profile(model, risky):
    """A profile in which the modules named in ``risky`` are the riskiest, in that order."""
    names = [name for name, _ in model.named_modules() if name]
    ordered = risky + [n for n in names if n not in risky]
    modules = [
        ModuleRisk(n, "Module", 0, False, risk=math.inf if n in risky else 0.01, rank=i + 1)
        for i, n in enumerate(ordered)
    ]
    return Profile("fake", "cpu", 1, 0, ("fp16",), modules, 0.0)


def _check_fitted(space, model, max_groups, kind="cpu"):
    """At most max_groups groups, and every searched leaf taken by one of them."""
    assert len(space.groups) <= max_groups
    assigned = space.assignment(model, kind)
    assert set(assigned) == {name for name, _ in searched_leaves(model, kind)}
    assert set(assigned.values()) == {g.name for g in space.groups}
    for group in space.groups:
        assert re.fullmatch(r"[A-Za-z0-9_.-]+", group.name)
        for pattern in group.rule.patterns:  # exact module names or "*"
            assert pattern == "*" or pattern in dict(model.named_modules())


def test_default_space_groups_a_resnet_by_block_range_and_role():
    model = load_task("digits-resnet").model()
    space = load_space("default")
    assert space.auto is not None and not space.groups
    fitted = space.fit(model)
    assert fitted.auto is None
    _check_fitted(fitted, model, 12)
    names = [g.name for g in fitted.groups]
    # The four stages are one run of bottleneck blocks: ranges of blocks by role (the
    # downsample branch, the block's own convs and norms), then the stem and the head.
    assert names[-3:] == ["convs.conv1", "norms.bn1", "head"]
    roles = [name.rsplit(".", 1)[-1] for name in names[:-3]]
    assert set(roles) == {"downsample", "convs", "norms"}
    assert roles == sorted(roles, key=["downsample", "convs", "norms"].index)
    # Ranges merge where parameters are few: the wide last stage keeps the finest ranges.
    assert "layer4.2.convs" in names and "layer1.0-layer3.5.convs" in names
    convs = next(g.rule for g in fitted.groups if g.name == "layer4.0-1.convs")
    assert convs.patterns == ("layer4.0", "layer4.1") and convs.types == ("_ConvNd",)
    assert not any(g.name.startswith("risk.") for g in fitted.groups)  # no profile
    policy = fitted.policy(fitted.uniform_params("bf16"))
    assert set(policy.resolve(model).values()) == {"bf16"}


def test_risky_modules_get_groups_of_their_own_first(tmp_path):
    model = load_task("digits-resnet").model()
    # layer3 only contains the risky block: it must not become a group of its own.
    risky = ["layer3.2", "layer3", "layer4.0.conv1", "layer4.0.relu", "fc"]
    profile = _fake_profile(model, risky)
    fitted = load_space("default").fit(model, profile)
    _check_fitted(fitted, model, 12)
    names = [g.name for g in fitted.groups]
    assert names[:3] == ["risk.layer3.2", "risk.layer4.0.conv1", "risk.fc"]
    assert fitted.groups[0].rule.patterns == ("layer3.2",) and not fitted.groups[0].rule.types
    assignment = fitted.assignment(model)
    assert {assignment[f"layer3.2.{leaf}"] for leaf in ("conv1", "bn2", "conv3")} == {
        "risk.layer3.2"
    }
    assert assignment["layer3.1.conv1"].endswith(".convs")  # the rest of the stage as before
    assert assignment["layer4.0.conv2"].startswith("layer4.0")
    assert len(names) == 12 and "head" not in names  # fc is its own group already
    for max_groups in (2, 4, 6):  # fewer groups: neighbouring ranges merge further
        small = _auto_space(tmp_path, max_groups, 1).fit(model, profile)
        _check_fitted(small, model, max_groups)
        assert small.groups[0].name == "risk.layer3.2"


def test_risky_modules_leave_some_leaf_to_the_other_groups():
    """A serving profile of tiny-bert may rank the head, then the whole backbone: the two
    would take every leaf, so the backbone gets no group of its own."""
    pytest.importorskip("transformers")
    model = load_task("tiny-bert").model()
    profile = _fake_profile(model, ["classifier", "bert"])
    fitted = load_space("default").fit(model, profile, mode="serving")
    names = [g.name for g in fitted.groups]
    assert names[0] == "risk.classifier" and "risk.bert" not in names
    assigned = fitted.assignment(model, "cpu")
    assert set(assigned) == {name for name, _ in searched_leaves(model, mode="serving")}
    assert set(assigned.values()) == set(names)


def test_a_gpt2_gets_groups_by_block_range_and_role():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=4, n_head=2, use_cache=False
    )
    model = transformers.GPT2LMHeadModel(config)
    for kind, norms in (("cpu", True), ("cuda", False)):
        fitted = load_space("default").fit(model, device=kind)
        names = [g.name for g in fitted.groups]
        assert len(names) >= 6 and len(names) <= 12
        assert "head" in names and fitted.assignment(model, kind)["lm_head"] == "head"
        assert any(re.fullmatch(r"h\.0(-\d)?\.attn", n) for n in names)
        assert any(re.fullmatch(r"h\.\d(-\d)?\.mlp", n) for n in names)
        # LayerNorm is searched on the CPU only: CUDA autocast keeps it in fp32.
        assert any(n.endswith(".norms") for n in names) == norms
        assert ("norms.ln_f" in names) == norms
        assignment = fitted.assignment(model, kind)
        assert assignment["transformer.h.3.attn.c_attn"].endswith(".attn")
        assert "transformer.wte" not in assignment  # embeddings compute in fp32 anyway


def test_a_bert_gets_groups_by_block_range_and_role():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
    )
    model = transformers.BertForSequenceClassification(config)
    fitted = load_space("default").fit(model, device="cuda")
    names = [g.name for g in fitted.groups]
    for role in ("attention", "intermediate", "output"):
        assert any(n.endswith(f".{role}") for n in names), names
    assert "head" in names and "linears.pooler" in names
    _check_fitted(fitted, model, 12, "cuda")


def test_auto_groups_are_stable_and_fingerprinted(tmp_path):
    task = load_task("digits-resnet")
    space = load_space("default")
    first, second = space.fit(task.model()), space.fit(task.model())
    assert first == second and first.fingerprint() == second.fingerprint()
    model = task.model()
    guided = space.fit(model, _fake_profile(model, ["layer2.1"]))
    assert guided.fingerprint() != first.fingerprint()
    assert (
        guided.fingerprint() == space.fit(model, _fake_profile(model, ["layer2.1"])).fingerprint()
    )
    assert space.fingerprint() != _auto_space(tmp_path, 6).fingerprint()


def test_auto_groups_look_through_a_wrapper_and_keep_other_layers_last():
    class Scaler(nn.Module):  # a parameterised layer of no known family
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))

        def forward(self, x):
            return x * self.weight

    body = nn.Sequential(
        OrderedDict(
            stem=nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), Scaler()),
            head=nn.Linear(8, 2),
        )
    )
    model = nn.Sequential(OrderedDict(backbone=body))
    fitted = load_space("default").fit(model, device="cuda")
    _check_fitted(fitted, model, 12, "cuda")
    assert [g.name for g in fitted.groups] == ["linears.stem", "linears.head", "other.stem"]
    assert fitted.groups[0].rule.patterns == ("backbone.stem",)
    assert fitted.assignment(model, "cuda")["backbone.stem.2"] == "other.stem"
    assert "backbone.stem.1" not in fitted.assignment(model, "cuda")  # LayerNorm: fp32 there


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("groups: auto\nauto_groups: {max_groups: 3, own_groups: 3}\n", "auto_groups.own_groups"),
        ("groups: auto\nauto_groups: {max_groups: 0}\n", "auto_groups.max_groups"),
        ("groups: auto\nauto_groups: {max_groups: two}\n", "auto_groups.max_groups"),
        ("groups: auto\nauto_groups: {most: 3}\n", "auto_groups.most: unknown field"),
        ("groups: [{name: a, patterns: [fc1]}]\nauto_groups: {max_groups: 3}\n", "only with"),
        ("groups: some\n", "groups: expected a non-empty list or 'auto'"),
    ],
)
def test_bad_auto_groups(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(SpaceError) as caught:
        load_space(path)
    assert str(path) in str(caught.value) and message in str(caught.value)


def test_a_profile_of_another_model(tiny_task):
    model = load_task("digits-resnet").model()
    with pytest.raises(SpaceError, match=r"names module 'layer1\.0'"):
        load_space("default").fit(tiny_task.model(), _fake_profile(model, ["layer1.0"]))
