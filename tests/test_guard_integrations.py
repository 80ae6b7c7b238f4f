"""The guard where users train: a guarded Lightning run and a guarded Trainer run make the
changes a guarded plain loop makes, on the same model, data and seed, and keep them across a
checkpoint; a rollback there restores and promotes but does not replay. Needs lightning,
transformers and accelerate."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from autoprec import Guard, Policy
from autoprec.errors import GuardError
from autoprec.tasks.zoo import zoo_task

pl = pytest.importorskip(
    "lightning.pytorch", reason="the Lightning integration needs: pip install 'autoprec[lightning]'"
)
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
from autoprec.integrations.lightning import GuardCallback, PolicyPrecision  # noqa: E402
from autoprec.integrations.transformers import PolicyTrainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers:UserWarning",
    "ignore:.*GPU available but not used:UserWarning",
    "ignore:The dirpath has changed:UserWarning",
    "ignore:Be aware that when using `ckpt_path`:UserWarning",
)
FRAGILE = "zoo-exp-growth"  # uniform fp16 overflows at step ~986; the guard promotes at 350
PROMOTED_AT = 350


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fragile_batches(steps: int) -> list:
    return list(itertools.islice(zoo_task(FRAGILE).train_data(0), steps))


class Fragile(pl.LightningModule):
    """The fragile zoo task's model and loss as a LightningModule (Adam, lr 1e-3, as the
    task trains it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = zoo_task(FRAGILE).model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, labels = batch
        return F.cross_entropy(self(x).float(), labels)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def plain_loop(module: nn.Module, batches: list, guard: Guard, replay: bool = True):
    """The guarded loop the guard's docs show, on ``module``: its Precision after the run.
    ``replay``: draw the batches through ``prec.guarded`` (False: as Lightning does, not)."""
    prec = Policy.uniform("fp16").apply(module, guard=guard)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    module.train()
    for x, labels in prec.guarded(batches) if replay else batches:
        optimizer.zero_grad(set_to_none=True)
        with prec.autocast():
            out = module(x)
        prec.backward(F.cross_entropy(out.float(), labels))
        prec.step(optimizer)
    prec.summary()  # closes the last step
    return prec


def lightning_trainer(root, plugin, steps: int, **kwargs) -> pl.Trainer:
    """A quiet CPU Trainer with ``plugin``; ``kwargs`` add to or override its options."""
    options = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        **kwargs,
    }
    return pl.Trainer(
        plugins=[plugin], max_steps=steps, accelerator="cpu", default_root_dir=root, **options
    )


def test_lightning_guard_makes_the_plain_loops_change_at_the_same_step(tmp_path, caplog):
    steps = 1200  # past step ~986, where the unguarded fp16 head overflows
    batches = fragile_batches(steps)
    plain = plain_loop(Fragile(), batches, Guard())

    module = Fragile()
    callback = GuardCallback()
    plugin = PolicyPrecision(Policy.uniform("fp16"), guard=Guard())
    with caplog.at_level(logging.INFO):
        lightning_trainer(tmp_path, plugin, steps, callbacks=[callback]).fit(
            module, DataLoader(batches, batch_size=None)
        )

    assert [c.action for c in plain.changes] == ["promote"]
    assert plain.changes[0].step == PROMOTED_AT and plain.changes[0].layer == "net.head"
    assert callback.changes == plain.changes  # every field: step, layer, dtypes, reason
    assert callback.summary.splitlines()[0].startswith(f"guard: {steps} steps")
    assert plain.changes[0].describe() in caplog.text  # the guard's line, and the summary's
    assert all(torch.isfinite(p).all() for p in module.parameters())
    # after the run the plugin keeps the guard's state for the next fit
    assert plugin.state_dict()["guard"]["changes"] == [plain.changes[0].to_dict()]


def test_lightning_rollback_restores_and_promotes_without_replay(tmp_path):
    # Checked only at step 0, the guard sees the head overflow at step ~986 and rolls back.
    guard = Guard(check_every=1000, snapshot_every=1000)
    steps = 1050
    batches = fragile_batches(steps)
    plain = plain_loop(Fragile(), batches, guard, replay=False)

    class Scheduled(Fragile):
        def configure_optimizers(self):
            optimizer = super().configure_optimizers()
            self.schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": self.schedule, "interval": "step"},
            }

    module = Scheduled()
    callback = GuardCallback()
    plugin = PolicyPrecision(Policy.uniform("fp16"), guard=guard)
    run = lightning_trainer(tmp_path, plugin, steps, callbacks=[callback])
    run.fit(module, DataLoader(batches, batch_size=None))

    [rollback] = plain.changes
    assert rollback.action == "rollback" and rollback.replayed is False
    assert rollback.restored_step == 0 and rollback.to_dtype == "bf16"
    assert "the loss was not finite" in rollback.reason
    assert callback.changes == plain.changes
    assert "rolled back to step 0 (not replayed" in callback.summary
    # the lost steps are not trained again: the guard's clock is behind Lightning's
    guard_steps = plugin.state_dict()["guard"]["step"]
    assert run.global_step == steps and guard_steps == steps - rollback.step - 1
    assert module.schedule.last_epoch == guard_steps  # restored with the weights, stepped on
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_lightning_resume_continues_with_the_promoted_policy(tmp_path):
    batches = fragile_batches(PROMOTED_AT + 20)
    first = lightning_trainer(
        tmp_path,
        PolicyPrecision(Policy.uniform("fp16"), guard=Guard()),
        len(batches),
        enable_checkpointing=True,
    )
    first.fit(Fragile(), DataLoader(batches, batch_size=None))
    path = first.checkpoint_callback.best_model_path
    saved = torch.load(path, weights_only=True)["PolicyPrecision"]["guard"]
    assert [c["step"] for c in saved["changes"]] == [PROMOTED_AT]

    module = Fragile()
    head_dtypes: set[torch.dtype] = set()
    module.net.head.register_forward_hook(lambda m, args, out: head_dtypes.add(out.dtype))
    callback = GuardCallback()
    plugin = PolicyPrecision(Policy.uniform("fp16"), guard=Guard())
    resumed = lightning_trainer(
        tmp_path / "resumed", plugin, len(batches) + 5, callbacks=[callback]
    )
    resumed.fit(module, DataLoader(batches, batch_size=None), ckpt_path=path)
    assert head_dtypes == {torch.bfloat16}  # fp16 before the promotion
    assert [c.step for c in callback.changes] == [PROMOTED_AT]  # the checkpoint's, restored


def test_lightning_validation_between_steps_changes_nothing_the_guard_decides(tmp_path):
    # A validation forward (no grad) right before a check step's training forward is not
    # the one the guard watches: the run decides as the run without validation does.
    batches = fragile_batches(PROMOTED_AT + 20)
    plain = plain_loop(Fragile(), batches, Guard())

    class Validated(Fragile):
        def validation_step(self, batch, batch_idx):
            x, labels = batch
            self.log("val_loss", F.cross_entropy(self(x).float(), labels))

    callback = GuardCallback()
    run = lightning_trainer(
        tmp_path,
        PolicyPrecision(Policy.uniform("fp16"), guard=Guard()),
        len(batches),
        callbacks=[callback],
        val_check_interval=50,  # validation comes right before each check step
        limit_val_batches=1,
        num_sanity_val_steps=1,
    )
    run.fit(
        Validated(),
        DataLoader(batches, batch_size=None),
        DataLoader(batches[:1], batch_size=None),
    )
    assert callback.changes == plain.changes and len(plain.changes) == 1


def test_guard_callback_without_the_plugin_says_what_to_pass(tmp_path):
    run = pl.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[GuardCallback()],
    )
    with pytest.raises(GuardError, match=r"precision plugin is .*PolicyPrecision\(policy, guard"):
        run.fit(Fragile(), DataLoader(fragile_batches(1), batch_size=None))


# -- transformers' Trainer --------------------------------------------------------------------


class FragileWithLoss(nn.Module):
    """The fragile zoo task's model as the Trainer calls a model: keyword inputs and labels
    in, the loss out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = zoo_task(FRAGILE).model()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits.float(), labels), "logits": logits}


class Rows(torch.utils.data.IterableDataset):
    """The batches' rows in order, for the Trainer to batch again exactly as they were."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __iter__(self):
        for x, labels in self.batches:
            for i in range(len(labels)):
                yield {"x": x[i], "labels": labels[i]}


def trainer_arguments(tmp_path, steps: int, batch_size: int, **kwargs):
    """AdamW at lr 1e-3, constant, unclipped: the plain loop's optimizer, in the Trainer."""
    defaults = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": batch_size,
        "learning_rate": 1e-3,
        "lr_scheduler_type": "constant",
        "optim": "adamw_torch",
        "max_grad_norm": 0.0,
        "max_steps": steps,
        "logging_steps": 50,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
    }
    return transformers.TrainingArguments(**{**defaults, **kwargs})


def plain_adamw_loop(batches: list, guard: Guard, replay: bool = True):
    """The guarded plain loop over `FragileWithLoss`, with the Trainer's optimizer."""
    model = FragileWithLoss()
    prec = Policy.uniform("fp16").apply(model, guard=guard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    model.train()
    for x, labels in prec.guarded(batches) if replay else batches:
        optimizer.zero_grad(set_to_none=True)
        with prec.autocast():
            loss = model(x, labels)["loss"]
        prec.backward(loss)
        prec.step(optimizer)
    prec.summary()
    return prec


def guarded_trainer(tmp_path, batches: list, guard: Guard, **kwargs) -> PolicyTrainer:
    args = trainer_arguments(tmp_path, len(batches), len(batches[0][1]), **kwargs)
    return PolicyTrainer(
        model=FragileWithLoss(),
        args=args,
        train_dataset=Rows(batches),
        policy=Policy.uniform("fp16"),
        guard=guard,
    )


def test_trainer_guard_makes_the_plain_loops_change_at_the_same_step(tmp_path, capsys):
    batches = fragile_batches(PROMOTED_AT + 50)
    prec = plain_adamw_loop(batches, Guard())
    trainer = guarded_trainer(tmp_path, batches, Guard())
    trainer.train()

    [promotion] = prec.changes
    assert promotion.step == PROMOTED_AT and promotion.layer == "net.head"
    assert trainer.precision.changes == prec.changes  # every field: step, layer, reason
    assert promotion.describe() in capsys.readouterr().out  # the summary, printed at the end
    logged = [entry for entry in trainer.state.log_history if "guard_changes" in entry]
    assert [e["guard_changes"] for e in logged if e["step"] <= PROMOTED_AT] == [0] * 7
    assert logged[-1]["guard_changes"] == 1 and logged[-1]["guard_rollbacks"] == 0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_trainer_resume_continues_with_the_promoted_policy(tmp_path):
    batches = fragile_batches(PROMOTED_AT + 25)
    saved_at = PROMOTED_AT + 20
    size = len(batches[0][1])
    args = trainer_arguments(tmp_path, saved_at, size, save_strategy="steps", save_steps=saved_at)
    first = PolicyTrainer(
        model=FragileWithLoss(),
        args=args,
        train_dataset=Rows(batches),
        policy=Policy.uniform("fp16"),
        guard=Guard(),
    )
    first.train()
    checkpoint = tmp_path / "out" / f"checkpoint-{saved_at}"
    saved = torch.load(checkpoint / "scaler.pt", weights_only=True)["guard"]
    assert [c["step"] for c in saved["changes"]] == [PROMOTED_AT]

    model = FragileWithLoss()
    head_dtypes: set[torch.dtype] = set()
    model.net.head.register_forward_hook(lambda m, args, out: head_dtypes.add(out.dtype))
    resumed = PolicyTrainer(
        model=model,
        args=trainer_arguments(tmp_path, len(batches), size),
        train_dataset=Rows(batches),
        policy=Policy.uniform("fp16"),
        guard=Guard(),
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert head_dtypes == {torch.bfloat16}  # fp16 before the promotion
    assert [c.step for c in resumed.precision.changes] == [PROMOTED_AT]
    assert resumed.state.global_step == len(batches)


def test_trainer_rollback_restores_and_promotes_without_replay(tmp_path):
    guard = Guard(check_every=1000, snapshot_every=1000)  # see the Lightning test
    batches = fragile_batches(1050)
    prec = plain_adamw_loop(batches, guard, replay=False)
    trainer = guarded_trainer(tmp_path, batches, guard)
    trainer.train()

    [rollback] = prec.changes
    assert rollback.action == "rollback" and rollback.replayed is False
    assert "the loss was not finite" in rollback.reason
    assert trainer.precision.changes == prec.changes
    guard_steps = trainer.precision.step_count
    assert trainer.state.global_step == len(batches) and guard_steps == prec.step_count
    assert trainer.lr_scheduler.last_epoch == guard_steps  # restored with the weights
    assert trainer.state.log_history[-2]["guard_rollbacks"] == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
