"""The built-in ResNet task: ResNet-50's layout at tiny widths, and it learns."""

from __future__ import annotations

import statistics

import torch
from torch import nn

from autoprec.tasks import load_task


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
