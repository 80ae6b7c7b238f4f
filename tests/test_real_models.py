"""Real models in: transformers models as they are, structured batches and outputs, the
training-loop parts real tasks have, and the loop's correctness with several optimizers.
Every model here is a real transformers model, randomly initialised from a config."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import autoprec
from autoprec import LossScale, Policy, Rule
from autoprec.devices import get_backend
from autoprec.errors import TaskError
from autoprec.space import load_space
from autoprec.tasks import check_task, check_task_data, load_task
from autoprec.trials.training import Budget, run_trial

transformers = pytest.importorskip("transformers")


def _gpt2(n_layer: int = 2) -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=48, n_positions=16, n_embd=32, n_layer=n_layer, n_head=2, use_cache=False
    )
    return transformers.GPT2LMHeadModel(config)


def _tokens(seed: int, batch: int = 8, length: int = 16) -> torch.Tensor:
    return torch.randint(0, 48, (batch, length), generator=torch.Generator().manual_seed(seed))


def _stream(make):
    def train_data(seed):
        step = 0
        while True:
            yield make(seed * 100_003 + step)
            step += 1

    return train_data


def test_gpt2_passed_as_is_with_a_loss_on_its_logits():
    # The model returns a ModelOutput; the loss reads its logits (cast to fp32, still a
    # ModelOutput). Inputs are a tensor, targets the next tokens.
    def make(seed):
        tokens = _tokens(seed)
        return tokens, tokens

    def loss(outputs, targets):
        assert isinstance(outputs, transformers.modeling_outputs.ModelOutput)
        assert outputs.logits.dtype == torch.float32
        return F.cross_entropy(outputs.logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten())

    task = autoprec.Task(
        "gpt2-as-is",
        lambda: _gpt2(),
        _stream(make),
        lambda: [make(7)],
        loss,
        metric="next_token_accuracy",
    )
    check_task_data(task, check_task(task), steps=3, seed=0)
    for dtype in ("fp32", "bf16", "fp16"):
        result = run_trial(task, Policy.uniform(dtype), get_backend("cpu"), Budget(steps=6))
        assert result.state == "complete", result.reason
        assert 0.0 <= result.accuracy <= 1.0 and math.isfinite(result.final_loss)


def _bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=48,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(config)


def _bert_inputs(seed):
    tokens = _tokens(seed)
    mask = torch.ones_like(tokens)
    mask[:, 12:] = 0  # padding
    labels = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": tokens, "attention_mask": mask}, labels


def test_bert_with_dict_inputs_and_targets_apart():
    # (inputs, targets) with the inputs a mapping: model(**inputs), the task's loss on logits.
    task = autoprec.Task(
        "bert-dicts",
        _bert,
        _stream(_bert_inputs),
        lambda: [_bert_inputs(9)],
        lambda outputs, targets: F.cross_entropy(outputs.logits, targets),
    )
    check_task_data(task, check_task(task), steps=3, seed=0)
    result = run_trial(task, Policy.uniform("bf16"), get_backend("cpu"), Budget(steps=5))
    assert result.state == "complete", result.reason


def test_bert_with_trainer_style_batches_computes_its_own_loss():
    # One mapping per batch, labels inside: model(**batch), outputs.loss, targets = labels.
    def make(seed):
        inputs, labels = _bert_inputs(seed)
        return {**inputs, "labels": labels}

    task = autoprec.Task("bert-trainer", _bert, _stream(make), lambda: [make(9)], loss=None)
    result = run_trial(task, Policy.uniform("fp16"), get_backend("cpu"), Budget(steps=5))
    assert result.state == "complete", result.reason
    assert result.accuracy is not None


def test_a_batch_the_model_cannot_take_is_one_line_naming_the_structure():
    task = autoprec.Task(
        "wrong-structure",
        lambda: nn.Linear(16, 2),  # forward(input)
        _stream(_bert_inputs),  # dict inputs: model(**inputs) cannot bind
        lambda: [_bert_inputs(9)],
        F.cross_entropy,
    )
    with pytest.raises(TaskError) as caught:
        check_task_data(task, check_task(task), steps=2, seed=0)
    message = str(caught.value)
    assert "\n" not in message
    assert "inputs is a dict with keys [input_ids, attention_mask]" in message
    assert "the model's forward takes (input)" in message

    odd = autoprec.Task(
        "odd-batch", lambda: nn.Linear(4, 2), lambda seed: iter([42] * 5), lambda: [42], None
    )
    with pytest.raises(TaskError, match=r"a batch must be \(inputs, targets\) or a mapping"):
        check_task_data(odd, check_task(odd), steps=2, seed=0)


class Wrapped(nn.Module):
    """GPT-2 behind a wrapper that returns logits: a child returns a ModelOutput, and the
    parent reads a field of it."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = _gpt2(n_layer=2)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.lm.transformer(input_ids=input_ids).last_hidden_state
        return self.lm.lm_head(hidden)


def test_the_profile_never_scores_its_own_instrumentation_as_risk():
    def make(seed):
        tokens = _tokens(seed)
        return tokens, tokens

    def loss(logits, targets):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten())

    task = autoprec.Task("wrapped-gpt2", Wrapped, _stream(make), lambda: [make(7)], loss)
    profile = autoprec.profile_task(task, "cpu")
    by_name = {m.name: m for m in profile.modules}
    assert all(math.isfinite(m.risk) for m in profile.modules), profile.table(5)
    assert not any(m.error for m in profile.modules), [m.error for m in profile.modules]
    assert by_name["lm.transformer"].reason.startswith(("fp16", "bf16"))
    fitted = load_space("default").fit(Wrapped(), profile)
    assert len(fitted.groups) >= 6


class Unprofilable(nn.Module):
    """A block with an op that refuses fp16 (on its layer's fp16 output, as a policy runs
    it: the block's own input arrives in fp32): a profile error, not a risk."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.dtype == torch.float16:
            raise TypeError("no fp16 kernel for this op")
        return h


def test_a_forward_that_fails_under_profiling_is_a_profile_error():
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    labels = (data[:, 0] > 0).long()

    def model():
        return nn.Sequential(Unprofilable(), nn.ReLU(), nn.Linear(8, 2))

    task = autoprec.Task(
        "unprofilable",
        model,
        lambda seed: iter([(data, labels)] * 10),
        lambda: [(data, labels)],
        F.cross_entropy,
    )
    profile = autoprec.profile_task(task, "cpu")
    failing = next(m for m in profile.modules if m.name == "0")
    assert failing.error.startswith("fp16: profile error") and "TypeError" in failing.error
    assert math.isfinite(failing.risk)  # bf16 measured; fp16's failure is not counted
    assert failing.reason.startswith("bf16: ")  # the risk is bf16's; fp16's error follows


Pair = namedtuple("Pair", "main aux")


@dataclass
class Out:
    main: torch.Tensor
    aux: dict


class Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return Pair(y, {"sum": y.sum(-1), "list": [y * 2]}), Out(y, {"k": (y,)})


def test_regions_keep_nested_outputs_intact():
    model = nn.Sequential(Structured())

    class Head(nn.Module):
        def forward(self, pair_and_out):
            pair, out = pair_and_out
            assert isinstance(pair, Pair) and isinstance(out, Out)
            assert isinstance(pair.aux["list"], list) and isinstance(out.aux["k"], tuple)
            return pair.main + out.main

    model.append(Head())
    model.append(nn.Linear(4, 16))
    policy = Policy(rules=(Rule("bf16", patterns=("0",)),))  # a low region in fp32
    assert policy.plan(model).outer_dtype == "fp32"
    seen = []
    model[1].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    prec = policy.apply(model, "cpu")
    with prec.autocast():
        out = model(torch.randn(2, 4))
    prec.remove()
    pair, structured = seen[0]
    assert pair.main.dtype == structured.aux["k"][0].dtype == torch.float32  # handed on in fp32
    assert out.dtype == torch.float32


def test_two_optimizers_update_the_scale_once_per_iteration():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[1].parameters(), lr=0.1)
    policy = Policy.uniform("fp16", LossScale("dynamic", init_scale=1024.0, growth_interval=1))
    prec = policy.apply(model, "cpu")
    x = torch.randn(8, 4)
    for iteration in range(3):
        for optimizer in (first, second):
            optimizer.zero_grad()
        with prec.autocast():
            loss = model(x).float().pow(2).mean()
        prec.backward(loss)
        scale_used = prec.scaler.scale
        assert prec.step(first) and prec.step(second)
        # Both optimizers were unscaled by the scale the loss was scaled with.
        assert prec.scaler.scale == scale_used
        assert prec.loss_scale == 1024.0 * 2 ** (iteration + 1)  # grew once, not twice
    # An overflow in either optimizer's gradients backs the scale off once.
    model[1].weight.grad = None
    with prec.autocast():
        loss = model(x).float().pow(2).mean() * float("inf")
    prec.backward(loss)
    before = prec.scaler.scale
    assert not prec.step(first) and not prec.step(second)
    assert prec.loss_scale == before * 0.5
    prec.remove()


def _counting_task(accumulate: int, clip: float | None, scheduler_log: list):
    data = torch.randn(512, 16, generator=torch.Generator().manual_seed(0)) * 10
    labels = (data[:, 0] > 0).long()
    drawn = []

    def train_data(seed):
        for i in range(0, 512, 16):
            drawn.append(i)
            yield data[i : i + 16], labels[i : i + 16]

    norms = []

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
            return super().step(closure)

    def scheduler(optimizer):
        calls: list = []  # one list per scheduler made: the trial's is the first
        scheduler_log.append(calls)

        def factor(step):
            calls.append(step)
            return 1.0

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    task = autoprec.Task(
        "counting",
        lambda: nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2)),
        train_data,
        lambda: [(data[:64], labels[:64])],
        F.cross_entropy,
        optimizer=lambda params: Recording(params, lr=0.01),
        scheduler=scheduler,
        clip_grad_norm=clip,
        accumulate=accumulate,
    )
    return task, drawn, norms


def test_accumulation_clipping_and_the_scheduler():
    log: list = []
    task, drawn, norms = _counting_task(accumulate=3, clip=0.05, scheduler_log=log)
    policy = Policy.uniform("fp16", LossScale("static", init_scale=2.0**12))
    result = run_trial(task, policy, get_backend("cpu"), Budget(steps=6, warmup_steps=1))
    assert result.state == "complete", result.reason
    assert len(drawn) == 18  # 3 batches per optimizer step
    assert len(norms) == 6 and all(n <= 0.05 * 1.001 for n in norms)  # clipped, unscaled
    assert max(norms) > 0.04  # not clipped to clip / scale: unscaled before clipping
    trial = log[0]  # later ones: the forecast reading the schedule ahead, on a throwaway
    assert len(trial) == 1 + 6  # LambdaLR calls it once at creation, then once per step


def test_the_scheduler_is_not_stepped_on_skipped_steps():
    log: list = []
    task, _, _ = _counting_task(accumulate=1, clip=None, scheduler_log=log)
    # A static scale of 2**40 overflows fp16 gradients: every step is skipped.
    policy = Policy.uniform("fp16", LossScale("static", init_scale=2.0**40))
    result = run_trial(task, policy, get_backend("cpu"), Budget(steps=4, warmup_steps=0))
    assert result.overflow_steps == 4
    assert log[0] == [0]  # the trial's: created, never stepped


def test_the_device_index_is_the_current_device_for_the_whole_trial(monkeypatch):
    """CUDA is not on this machine: torch.cuda's device calls are replaced by recorders,
    and the backend's own code decides which device each call acts on."""
    from autoprec.devices import CUDABackend

    current = [0]
    calls = []

    class Device:
        def __init__(self, device):
            self.index = torch.device(device).index

        def __enter__(self):
            self.previous, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.previous

    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: calls.append(current[0]) or True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty", current[0])))
    backend = CUDABackend(3)
    assert backend.supports("bf16") and calls == [3]
    backend.empty_cache()
    assert calls[-1] == ("empty", 3) and current[0] == 0
    with backend.selected():
        assert current[0] == 3


@pytest.mark.slow
def test_tiny_transformers_tasks_search_and_the_policy_trains_in_a_plain_loop(tmp_path):
    """`autoprec search --task tiny-bert`, then the chosen policy in a transformers-style
    loop of one's own: model(**batch), outputs.loss."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "autoprec.cli",
            "search",
            "--task",
            "tiny-bert",
            "--trials",
            "4",
            "--steps",
            "40",
            "--device",
            "cpu",
            "--prefer",
            "memory",
            "--no-progress",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    summary = json.loads((tmp_path / "runs/tiny-bert/summary.json").read_text())
    assert all(
        isinstance(p["risk"], float) and math.isfinite(p["risk"]) for p in summary["profile"]
    )
    groups = [k.removeprefix("dtype.") for k in summary["trials"][0]["params"] if "dtype." in k]
    assert any(g.endswith(".attention") for g in groups) and "head" in groups, groups
    policy = autoprec.load_policy(tmp_path / "runs/tiny-bert/best_policy.yaml")

    task = load_task("tiny-bert")

    def train(policy):
        torch.manual_seed(0)
        model = task.model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        prec = policy.apply(model, "cpu")
        batches = iter(task.train_data(0))
        for _ in range(40):
            batch = next(batches)
            optimizer.zero_grad()
            with prec.autocast():
                outputs = model(**batch)
            prec.backward(outputs.loss)
            prec.step(optimizer)
        model.eval()
        hits = total = 0
        with torch.no_grad(), prec.autocast():
            for batch in task.val_data():
                logits = model(**batch).logits.float()
                hits += int((logits.argmax(-1) == batch["labels"]).sum())
                total += len(batch["labels"])
        prec.remove()
        return hits / total

    fp32, chosen = train(Policy.uniform("fp32")), train(policy)
    assert chosen >= fp32 - summary["accuracy_tolerance"] - 1e-9


@pytest.mark.slow
def test_tiny_gpt2_search_follows_blocks_and_roles(tmp_path):
    result = autoprec.search(
        "tiny-gpt2",
        trials=4,
        steps=30,
        device="cpu",
        prefer="memory",
        study="gpt2",
        storage=f"sqlite:///{tmp_path}/optuna.db",
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
        runs_dir=tmp_path / "runs",
    )
    summary = result.summary
    profile = autoprec.Profile.load(tmp_path / "runs/gpt2/profile.json")
    assert not any(m.error for m in profile.modules)
    groups = [k.removeprefix("dtype.") for k in summary["trials"][0]["params"] if "dtype." in k]
    assert len(groups) >= 6 and "head" in groups
    assert any(".attn" in g for g in groups) and any(".mlp" in g for g in groups)
    assert summary["best"]["feasible"]
