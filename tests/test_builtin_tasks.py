"""Built-in tasks are the models they say they are, and they learn: the ResNet task has
ResNet-50's layout at tiny widths; tiny-llama and tiny-t5 are their transformers families."""

from __future__ import annotations

import statistics

import pytest
import torch
from torch import nn

from autoprec import Policy
from autoprec.devices import get_backend
from autoprec.tasks import load_task
from autoprec.trials.training import Budget, run_trial


def test_digits_resnet_has_resnet50_layout_and_trains():
    task = load_task("digits-resnet")
    torch.manual_seed(0)
    model = task.model()
    assert len(list(model.named_modules())) >= 100
    assert [len(getattr(model, f"layer{i}")) for i in range(1, 5)] == [3, 4, 6, 3]
    first, second = model.layer2[0], model.layer2[1]
    for name in ("conv1", "bn1", "conv2", "bn2", "conv3", "bn3", "relu"):
        assert hasattr(first, name)
    assert isinstance(first.downsample, nn.Sequential)
    assert [type(m) for m in first.downsample] == [nn.Conv2d, nn.BatchNorm2d]
    assert second.downsample is None

    optimizer = task.make_optimizer(model.parameters())
    batches = iter(task.train_data(0))
    losses = []
    for _ in range(15):
        inputs, targets = next(batches)
        optimizer.zero_grad()
        loss = task.loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert statistics.fmean(losses[-5:]) < 0.8 * statistics.fmean(losses[:5])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "families"),
    [
        ("tiny-llama", ("LlamaRMSNorm", "LlamaRotaryEmbedding", "LlamaMLP")),
        ("tiny-t5", ("T5LayerNorm", "T5Stack", "T5Attention")),
    ],
)
def test_tiny_llama_and_t5_are_their_families_and_learn_in_60_fp32_steps(name, families):
    pytest.importorskip("transformers")
    task = load_task(name)
    torch.manual_seed(0)
    model = task.model()
    classes = {type(module).__name__ for module in model.modules()}
    assert set(families) <= classes
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.weight is embedding.weight  # the head is tied to the embedding
    backend = get_backend("cpu")
    budget = Budget(steps=3, warmup_steps=1, seed=0)
    before = run_trial(task, Policy.uniform("fp32"), backend, budget)
    after = run_trial(task, Policy.uniform("fp32"), backend, Budget(60, 1, 0))
    assert before.state == after.state == "complete"
    assert after.accuracy > before.accuracy + 0.25
