"""A policy's optimizer states exported: torchao's classes per group
(``torchao-optimizer``), bitsandbytes' overrides (``bitsandbytes``) and transformers' Trainer
(``trainer``). Each generated file is loaded as written and trains bit for bit as
``policy.optimizer`` does; names from the model come out as string literals, never code; and
the Trainer trains with the policy's optimizer as a plain loop does, or as its own ``optim``
string where the mapping claims it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from autoprec import Policy, load_policy
from autoprec.cli import main
from autoprec.exports import ExportError, export_policy, trainer_optim
from autoprec.optim.state import OptimizerStates, StateGroup
from autoprec.tasks import load_task

bnb = pytest.importorskip("bitsandbytes")

EMBEDDINGS_FP32 = StateGroup(types=("Embedding",), state="fp32", name="embeddings")
BNB = Policy(
    optimizer_states=OptimizerStates("8bit", groups=(EMBEDDINGS_FP32,), library="bitsandbytes")
)
# A name no generated file may run: it closes a string, a docstring and a line.
HOSTILE = "x'\"\"\"\nprint('hacked')  # "


class Tiny(nn.Module):
    """An embedding (4,096 elements) and a head (8,192, 8-bit where asked) that return
    their loss, as the Trainer's models do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 64)
        self.head = nn.Linear(64, 128)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.embed(input_ids).mean(1))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def make_model() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def examples(count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        {
            "input_ids": torch.randint(0, 64, (6,), generator=generator),
            "labels": torch.randint(0, 128, (), generator=generator),
        }
        for _ in range(count)
    ]


def batches(rows: list[dict[str, torch.Tensor]], size: int) -> list[dict[str, torch.Tensor]]:
    return [
        {key: torch.stack([row[key] for row in rows[i : i + size]]) for key in rows[0]}
        for i in range(0, len(rows), size)
    ]


def train(model: nn.Module, optimizers: list[torch.optim.Optimizer], data: list[dict]) -> None:
    for batch in data:
        for optimizer in optimizers:
            optimizer.zero_grad()
        model(**batch)["loss"].backward()
        for optimizer in optimizers:
            optimizer.step()


def assert_identical(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        assert x.dtype == y.dtype, name
        assert torch.equal(x, y), name


def load(path: Path) -> ModuleType:
    """The generated file imported as written."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- bitsandbytes -------------------------------------------------------------------------


def test_the_bitsandbytes_file_trains_as_the_policys_optimizer_bit_for_bit(tmp_path):
    paths = export_policy(BNB, "bitsandbytes", tmp_path, model=make_model())
    assert [p.name for p in paths] == ["bitsandbytes_optimizer.py", "policy.yaml"]
    generated = load(paths[0])
    assert generated.FP32_STATES == ["embed.weight"]
    data = batches(examples(32), 8)
    exported, ours = make_model(), make_model()
    optimizer = generated.optimizer(exported, lr=1e-2, weight_decay=0.05)
    assert type(optimizer) is bnb.optim.AdamW8bit
    train(exported, [optimizer], data)
    train(ours, [BNB.optimizer(ours, torch.optim.AdamW, lr=1e-2, weight_decay=0.05)], data)
    assert_identical(exported, ours)
    assert optimizer.state[exported.embed.weight]["state1"].dtype == torch.float32
    assert optimizer.state[exported.head.weight]["state1"].dtype == torch.uint8


def test_kinds_bitsandbytes_lacks_are_refused_by_its_export(tmp_path):
    policy = Policy(
        optimizer_states=OptimizerStates(
            "8bit", groups=(StateGroup(types=("Linear",), state="4bit"),)
        )
    )
    with pytest.raises(
        ExportError, match=r"'types Linear' keeps 4bit states; bitsandbytes implements"
    ):
        export_policy(policy, "bitsandbytes", tmp_path, model=make_model())
    assert not (tmp_path / "bitsandbytes_optimizer.py").exists()


def test_a_torchao_policy_exported_to_bitsandbytes_says_its_states_differ(tmp_path):
    policy = Policy(optimizer_states=OptimizerStates("8bit", groups=(EMBEDDINGS_FP32,)))
    with pytest.warns(UserWarning, match="measured with torchao's optimizers"):
        paths = export_policy(policy, "bitsandbytes", tmp_path, model=make_model())
    assert "# NOTE: the policy's states were measured with torchao" in paths[0].read_text()


# -- torchao ------------------------------------------------------------------------------


def test_the_torchao_file_names_each_groups_class_and_arguments(tmp_path):
    torchao_optim = pytest.importorskip("torchao.optim")
    policy = Policy(
        optimizer_states=OptimizerStates(
            "8bit",
            groups=(EMBEDDINGS_FP32, StateGroup(patterns=("head",), state="4bit", master="bf16")),
        )
    )
    paths = export_policy(policy, "torchao-optimizer", tmp_path, model=make_model())
    generated = load(paths[0])
    model = make_model()
    built = generated.optimizers(model, lr=3e-3)  # built, never stepped: no compile here
    ours = policy.optimizer(make_model(), torch.optim.AdamW, lr=3e-3)
    assert [type(o) for o in built] == [type(part) for _, part in ours.parts]
    assert [type(o) for o in built] == [torch.optim.AdamW, torchao_optim.AdamW4bit]
    assert built[0].param_groups[0]["params"] == [model.embed.weight]
    assert built[1].param_groups[0]["params"] == [model.head.weight, model.head.bias]
    assert model.head.weight.dtype == torch.bfloat16  # a bf16 master
    assert built[1].bf16_stochastic_round and built[1].block_size == 128
    for mine, theirs in zip(built, (part for _, part in ours.parts), strict=True):
        assert mine.defaults == theirs.defaults


def test_states_torchao_has_no_public_class_for_are_refused(tmp_path):
    policy = Policy(optimizer_states=OptimizerStates("bf16"))
    with pytest.raises(ExportError, match="the default keeps bf16 states, which torchao has no"):
        export_policy(policy, "torchao-optimizer", tmp_path, model=make_model())


@pytest.mark.slow
def test_the_torchao_file_trains_as_the_policys_optimizer_bit_for_bit(tmp_path):
    """fp8 states: torchao's quickest low-bit step to compile (tens of seconds here)."""
    pytest.importorskip("torchao.optim")
    policy = Policy(optimizer_states=OptimizerStates("fp8", groups=(EMBEDDINGS_FP32,)))
    generated = load(export_policy(policy, "torchao-optimizer", tmp_path, model=make_model())[0])
    data = batches(examples(16), 8)
    exported, ours = make_model(), make_model()
    train(exported, generated.optimizers(exported, lr=1e-2), data)
    train(ours, [policy.optimizer(ours, torch.optim.AdamW, lr=1e-2)], data)
    assert_identical(exported, ours)


# -- what goes into the files is quoted ----------------------------------------------------


@pytest.mark.parametrize("fmt", ["bitsandbytes", "torchao-optimizer", "trainer"])
def test_hostile_module_and_policy_names_come_out_as_string_literals(tmp_path, fmt, capfd):
    model = make_model()
    model.add_module(HOSTILE, nn.Linear(4, 4))
    policy = Policy(
        optimizer_states=OptimizerStates(
            "8bit",
            groups=(StateGroup(patterns=(HOSTILE,), state="fp32"),),
            library="torchao" if fmt == "torchao-optimizer" else "bitsandbytes",
        ),
        name='p\'"""\nimport os',
    )
    path = export_policy(policy, fmt, tmp_path, model=model)[0]
    generated = load(path)
    assert "hacked" not in capfd.readouterr().out
    assert not hasattr(generated, "os")
    names = {
        "bitsandbytes": lambda: generated.FP32_STATES,
        "torchao-optimizer": lambda: [n for g in generated.GROUPS for n in g["params"]],
        "trainer": lambda: [],
    }[fmt]()
    assert f"{HOSTILE}.weight" in names or fmt == "trainer"


# -- the Trainer ---------------------------------------------------------------------------


def test_the_trainer_optim_string_only_where_it_builds_the_policys_optimizer():
    model = make_model()

    def states(*args, **kwargs) -> Policy:
        return Policy(optimizer_states=OptimizerStates(*args, **kwargs))

    assert trainer_optim(states("fp32"), model) == "adamw_torch"
    assert trainer_optim(states("8bit"), model) == "adamw_torch_8bit"
    assert trainer_optim(states("4bit"), model) is None  # the Trainer's block is 256, not 128
    assert trainer_optim(states("8bit", "bf16"), model) is None
    assert trainer_optim(states("8bit", groups=(EMBEDDINGS_FP32,)), model) is None
    assert trainer_optim(BNB, model) == "adamw_bnb_8bit"
    assert trainer_optim(states("8bit", library="bitsandbytes"), model) is None


transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")


class Ordered(torch.utils.data.IterableDataset):
    """Examples in a fixed order: the Trainer samples none, so a plain loop sees the same
    batches."""

    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def arguments(tmp_path: Path, generated: ModuleType | None = None, **kwargs):
    settings = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 8,
        "learning_rate": 1e-2,
        "max_steps": 4,
        "lr_scheduler_type": "constant",
        "max_grad_norm": 0.0,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
        **kwargs,
    }
    if generated is not None:
        return generated.training_arguments(**settings)
    return transformers.TrainingArguments(**settings)


def test_the_trainer_with_the_policys_optimizer_trains_as_a_plain_loop(tmp_path):
    from autoprec.integrations.transformers import PolicyTrainer

    policy = Policy(
        optimizer_states=OptimizerStates(
            "8bit", groups=(StateGroup(types=("Linear",), state="fp32"),), library="bitsandbytes"
        )
    )
    paths = export_policy(policy, "trainer", tmp_path / "export", model=make_model())
    generated = load(paths[0])
    assert generated.OPTIM is None  # no Trainer string keeps a Linear in 32 bits
    rows = examples(32)
    trained = make_model()
    args = arguments(tmp_path, generated)
    transformers.Trainer(
        model=trained,
        args=args,
        train_dataset=Ordered(rows),
        optimizers=generated.optimizers(trained, args),
    ).train()
    plain = make_model()
    train(
        plain,
        [policy.optimizer(plain, torch.optim.AdamW, lr=1e-2, weight_decay=0.0)],
        batches(rows, 8),
    )
    assert_identical(trained, plain)
    # PolicyTrainer builds the same optimizer itself from its policy.
    itself = make_model()
    PolicyTrainer(
        model=itself, args=arguments(tmp_path), train_dataset=Ordered(rows), policy=policy
    ).train()
    assert_identical(itself, plain)


def test_the_trainers_adamw_bnb_8bit_is_the_bitsandbytes_recipe_bit_for_bit(tmp_path):
    from autoprec.integrations.transformers import policy_optimizers

    generated = load(export_policy(BNB, "trainer", tmp_path / "export", model=make_model())[0])
    assert generated.OPTIM == "adamw_bnb_8bit"
    rows = examples(32)
    own = make_model()
    args = arguments(tmp_path, generated)
    assert args.optim == "adamw_bnb_8bit"
    transformers.Trainer(
        model=own,
        args=args,
        train_dataset=Ordered(rows),
        optimizers=generated.optimizers(own, args),
    ).train()
    ours = make_model()
    args = arguments(tmp_path)
    transformers.Trainer(
        model=ours,
        args=args,
        train_dataset=Ordered(rows),
        optimizers=policy_optimizers(BNB, ours, args),
    ).train()
    assert_identical(own, ours)


@pytest.mark.parametrize(
    ("fmt", "written"),
    [
        ("torchao-optimizer", "torchao_optimizer.py"),
        ("bitsandbytes", "bitsandbytes_optimizer.py"),
        ("trainer", "trainer_optimizer.py"),
    ],
)
def test_autoprec_export_writes_each_optimizer_format_of_a_training_study(
    fmt, written, in_tmp, capsys
):
    study = in_tmp / "runs" / "s"  # what a training search leaves and export reads
    study.mkdir(parents=True)
    settings = {"task_spec": "rare-features", "device": "cpu"}
    (study / "summary.json").write_text(json.dumps({"mode": "training", "settings": settings}))
    states = OptimizerStates("8bit", groups=(StateGroup(patterns=("inputs",), state="fp32"),))
    Policy(optimizer_states=states, name="inputs-fp32").save(study / "best_policy.yaml")
    assert main(["export", "--study", "s", "--format", fmt]) == 0
    out = study / f"export-{fmt}"
    assert load_policy(out / "policy.yaml") == load_policy(study / "best_policy.yaml")
    generated = load(out / written)
    model = load_task("rare-features").model()
    if fmt == "bitsandbytes":
        built = generated.optimizer(model, lr=1e-3)
        assert isinstance(built, bnb.optim.AdamW8bit)
        assert "not bit for bit" in capsys.readouterr().err  # trials ran torchao's states
    elif fmt == "torchao-optimizer":
        classes = {type(o).__name__ for o in generated.optimizers(model, lr=1e-3)}
        assert classes == {"AdamW", "AdamW8bit"}
    else:
        assert hasattr(generated, "training_arguments") and hasattr(generated, "optimizers")
