"""A policy in transformers' Trainer: PolicyTrainer on the built-in tiny-gpt2 and tiny-bert
tasks (layers in their dtypes, the loss going down, the loss scale in the checkpoint and back
on resume), the Trainer's own fp16/bf16 refused, clipping on true gradients, and overflowing
steps skipped together with the LR scheduler's."""

from __future__ import annotations

import copy

import pytest
import torch

import autoprec
from autoprec import Policy
from autoprec.errors import PolicyError
from autoprec.tasks import load_task

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
from autoprec.integrations.transformers import PolicyTrainer  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DYNAMIC = {"mode": "dynamic", "init_scale": 1024.0, "growth_interval": 1}
# Per task: fp16 attention, the rest bf16 but for an fp32 head.
MIXED = {
    "tiny-gpt2": [
        {"patterns": ["transformer.h.*.attn"], "dtype": "fp16"},
        {"patterns": ["lm_head"], "dtype": "fp32"},
    ],
    "tiny-bert": [
        {"patterns": ["bert.encoder.layer.*.attention"], "dtype": "fp16"},
        {"patterns": ["classifier"], "dtype": "fp32"},
    ],
}


SETTINGS = {  # per task: batch size, learning rate, steps to see the loss go down
    "tiny-gpt2": (16, 3e-3, 30),
    "tiny-bert": (32, 1e-3, 60),
}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models step many times faster on one thread than on two shared, busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def mixed(task: str, loss_scale: dict) -> Policy:
    return Policy.from_dict(
        {"name": "mixed", "default": "bf16", "rules": MIXED[task], "loss_scale": loss_scale}
    )


def examples(task: autoprec.Task, batches: int = 4) -> list[dict[str, torch.Tensor]]:
    """The task's first batches, split into examples for the Trainer's own batching (a few
    batches, seen again every epoch: the loss goes down within a few dozen steps)."""
    stream = iter(task.train_data(0))
    rows = []
    for _ in range(batches):
        batch = next(stream)
        rows += [
            {key: value[i] for key, value in batch.items()} for i in range(len(batch["labels"]))
        ]
    return rows


def arguments(tmp_path, task: str, max_steps: int, **kwargs) -> transformers.TrainingArguments:
    defaults = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": SETTINGS[task][0],
        "learning_rate": SETTINGS[task][1],
        "max_steps": max_steps,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
    }
    return transformers.TrainingArguments(**{**defaults, **kwargs})


def record_dtypes(model: torch.nn.Module, names: list[str]) -> dict[str, set[torch.dtype]]:
    """Forward hooks, registered before the policy is applied, that collect output dtypes."""
    seen: dict[str, set[torch.dtype]] = {name: set() for name in names}
    for name in names:
        model.get_submodule(name).register_forward_hook(
            lambda module, args, out, name=name: seen[name].add(out.dtype)
        )
    return seen


class OnTrainBegin(transformers.TrainerCallback):
    def __init__(self, action) -> None:
        self.action = action

    def on_train_begin(self, args, state, control, **kwargs):
        self.action()


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-bert"])
def test_mixed_policy_trains_and_its_loss_scale_survives_a_resume(tmp_path, name):
    task = load_task(name)
    policy = mixed(name, DYNAMIC)
    torch.manual_seed(0)
    model = task.model()
    resolved = policy.resolve(model, "cpu")
    assert {"fp16", "bf16", "fp32"} <= set(resolved.values())
    seen = record_dtypes(model, list(resolved))
    steps = SETTINGS[name][2]
    data = examples(task)
    args = arguments(tmp_path, name, steps, save_strategy="steps", save_steps=steps)
    trainer = PolicyTrainer(model=model, args=args, train_dataset=data, policy=policy)
    trainer.train()

    assert seen == {leaf: {DTYPES[dtype]} for leaf, dtype in resolved.items()}
    for dtypes in seen.values():
        dtypes.clear()
    assert trainer.evaluate(data[:8])["eval_loss"] < 10  # evaluation forwards: the same dtypes
    assert seen == {leaf: {DTYPES[dtype]} for leaf, dtype in resolved.items()}
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == steps
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses
    saved = torch.load(tmp_path / f"out/checkpoint-{steps}/scaler.pt", weights_only=True)
    assert saved["loss_scaler"]["scale"] == trainer.precision.loss_scale != DYNAMIC["init_scale"]

    torch.manual_seed(0)
    args = arguments(tmp_path, name, steps + 1)
    resumed = PolicyTrainer(model=task.model(), args=args, train_dataset=data, policy=policy)
    scales = []
    resumed.add_callback(OnTrainBegin(lambda: scales.append(resumed.precision.loss_scale)))
    resumed.train(resume_from_checkpoint=str(tmp_path / f"out/checkpoint-{steps}"))
    assert scales == [saved["loss_scaler"]["scale"]]
    assert resumed.state.global_step == steps + 1


@pytest.mark.parametrize("flag", ["fp16", "bf16", "bf16_full_eval"])
def test_the_trainers_own_mixed_precision_is_refused(tmp_path, flag):
    task = load_task("tiny-bert")
    args = arguments(tmp_path, "tiny-bert", 1, **{flag: True})
    with pytest.raises(ValueError, match=rf"TrainingArguments\({flag}=True\) would add"):
        PolicyTrainer(model=task.model(), args=args, policy=Policy.uniform("bf16"))


def test_clipping_sees_unscaled_gradients(tmp_path):
    norms = []

    class RecordingSGD(torch.optim.SGD):
        """Records the gradients' total norm as the step sees them."""

        def step(self, closure=None):
            grads = [p.grad for group in self.param_groups for p in group["params"]]
            norms.append(float(torch.nn.utils.get_total_norm([g for g in grads if g is not None])))
            return super().step(closure)

    task = load_task("tiny-bert")
    model = task.model()
    policy = mixed("tiny-bert", {"mode": "static", "init_scale": 2.0**12})
    trainer = PolicyTrainer(
        model=model,
        args=arguments(tmp_path, "tiny-bert", 3, max_grad_norm=1e-3),
        train_dataset=examples(task),
        optimizers=(RecordingSGD(model.parameters(), lr=1e-3), None),
        policy=policy,
    )
    trainer.train()
    assert norms == pytest.approx([1e-3] * 3, rel=1e-3)  # not 1e-3 / 2**12
    logged = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    assert len(logged) == 3 and all(0.01 < norm < 100 for norm in logged), logged  # unscaled


def test_every_step_overflowing_is_skipped_with_the_scheduler_step(tmp_path):
    task = load_task("tiny-bert")
    model = task.model()
    before = copy.deepcopy(model.state_dict())
    policy = mixed("tiny-bert", {"mode": "static", "init_scale": 2.0**40})
    args = arguments(tmp_path, "tiny-bert", 3)
    trainer = PolicyTrainer(model=model, args=args, train_dataset=examples(task), policy=policy)
    trainer.train()
    assert trainer.state.global_step == 3
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not trainer.optimizer.state  # AdamW never stepped
    assert trainer.lr_scheduler.last_epoch == 0  # nor did the LR schedule


class Wrapped(torch.nn.Module):
    """A user's module around the searched model, as the Trainer is given it."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def test_a_wrapped_model_trains_with_the_policy_on_the_model_inside(tmp_path, caplog):
    task = load_task("tiny-bert")
    policy = mixed("tiny-bert", DYNAMIC)
    torch.manual_seed(0)
    inner = task.model()
    expected = {f"model.{leaf}": dtype for leaf, dtype in policy.resolve(inner, "cpu").items()}
    model = Wrapped(inner)
    assert policy.resolve(model, "cpu") == expected
    seen = record_dtypes(model, list(expected))
    args = arguments(tmp_path, "tiny-bert", 3)
    with caplog.at_level("WARNING", logger="autoprec"):
        trainer = PolicyTrainer(model=model, args=args, train_dataset=examples(task), policy=policy)
    trainer.train()
    assert seen == {leaf: {DTYPES[dtype]} for leaf, dtype in expected.items()}
    assert [r.getMessage() for r in caplog.records if r.name == "autoprec"] == [
        "autoprec: policy mixed applied to submodule 'model' (BertForSequenceClassification, "
        f"{len(expected)} layers)"
    ]
    trainer.precision.remove()
    assert [name for name, m in model.named_modules() if "forward" in m.__dict__] == []


def test_two_fitting_models_ask_for_module(tmp_path):
    task = load_task("tiny-bert")
    pair = torch.nn.ModuleDict({"student": task.model(), "teacher": task.model()})
    model = Wrapped(pair)  # the Trainer never calls it here: the policy is refused first
    args = arguments(tmp_path, "tiny-bert", 1)
    policy = mixed("tiny-bert", DYNAMIC)
    with pytest.raises(PolicyError, match=r"\('model.student', 'model.teacher'\)"):
        PolicyTrainer(model=model, args=args, policy=policy)
    trainer = PolicyTrainer(model=model, args=args, policy=policy, module="model.teacher")
    resolved = trainer.precision.plan.leaf_dtypes
    teacher = {d for leaf, d in resolved.items() if leaf.startswith("model.teacher.")}
    assert teacher == {"fp16", "bf16", "fp32"}
    assert {d for leaf, d in resolved.items() if leaf.startswith("model.student.")} == {"fp32"}


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-bert"])
def test_uniform_bf16_is_the_trainers_own_bf16(tmp_path, name):
    """PolicyTrainer with uniform bf16 and transformers' Trainer(bf16=True) on the same model
    and data: the same losses step by step and the same final weights, bit for bit."""
    task = load_task(name)
    data, steps = examples(task, 2), 6
    runs = []
    for own in (True, False):
        torch.manual_seed(0)
        model = task.model()
        if own:
            args = arguments(tmp_path / "own", name, steps, bf16=True)
            trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        else:
            args = arguments(tmp_path / "policy", name, steps)
            trainer = PolicyTrainer(
                model=model, args=args, train_dataset=data, policy=Policy.uniform("bf16")
            )
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        runs.append((losses, {k: v.clone() for k, v in model.state_dict().items()}))
    (own_losses, own_weights), (losses, weights) = runs
    assert len(losses) == steps and losses == own_losses
    for key, tensor in own_weights.items():
        torch.testing.assert_close(weights[key], tensor, rtol=0, atol=0)
