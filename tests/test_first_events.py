"""What the telemetry saw first (`autoprec.numerics.first_events`): the rules on plain counts, and
one real forward."""

from __future__ import annotations

import torch
from torch import nn

from autoprec.numerics.first_events import (
    FLUSH,
    OVERFLOW,
    SCALE_COLLAPSE,
    FirstEvents,
    diagnose_forward,
)


def test_a_flush_is_half_of_what_was_nonzero_gone_to_zero_in_low_precision():
    events = FirstEvents()
    events.activation("relu", 0, 100, 0, 50, "fp16", 0)  # a ReLU: half zero from the start
    events.activation("relu", 10, 100, 0, 70, "fp16", 0)  # 40% of the rest: not yet
    assert events.earliest() is None
    events.activation("relu", 20, 100, 0, 80, "fp16", 0)  # 60% of the rest
    first = events.earliest()
    assert (first.mechanism, first.layer, first.step) == (FLUSH, "relu", 20)
    assert "80% of its outputs zero (50% at step 0)" in first.describe()


def test_a_flush_in_fp32_or_bf16_or_also_in_the_fp32_run_is_not_blamed_on_precision():
    """fp32's range and bf16's reach as far toward zero: a flush there is no dtype's."""
    events = FirstEvents()
    for layer, dtype in (("a", "fp32"), ("b", "fp16"), ("c", "bf16")):
        events.activation(layer, 0, 10, 0, 0, dtype, 0)
        events.activation(layer, 10, 10, 0, 10, dtype, 0)
    assert events.earliest().layer == "b"
    assert events.earliest(also_in_fp32={"b": 10}) is None  # fp32 flushed it as early
    assert events.earliest(also_in_fp32={"b": 4}) is None
    assert events.flushed_layers() == {"a": 10, "b": 10, "c": 10}


def test_a_flush_that_fp32_shows_only_later_is_blamed_on_the_dtype():
    """An annealed kernel's values pass fp16's smallest subnormal long before fp32's: the
    fp32 run flushes the same layer, but later; the low-precision run's flush is its
    dtype's."""
    events = FirstEvents()
    events.activation("kernel", 0, 10, 0, 0, "fp16", 0)
    events.activation("kernel", 540, 10, 0, 8, "fp16", 0)
    first = events.earliest(also_in_fp32={"kernel": 1970})
    assert (first.mechanism, first.layer, first.step) == (FLUSH, "kernel", 540)


def test_the_earliest_is_by_step_then_by_order_of_completion():
    events = FirstEvents()
    events.activation("late", 0, 10, 0, 0, "fp16", 0)
    events.activation("late", 30, 10, 0, 9, "fp16", 0)  # flushed at step 30
    events.activation("head", 20, 10, 3, 0, "fp16", 5)  # overflowed at 20, late in order
    events.activation("embed", 20, 10, 1, 0, "fp16", 1)  # overflowed at 20, earlier
    first = events.earliest()
    assert (first.mechanism, first.layer) == (OVERFLOW, "embed")
    restored = FirstEvents.from_list(events.to_list())
    assert restored.earliest() == first


def test_a_dynamic_scale_that_falls_to_its_floor_has_collapsed():
    events = FirstEvents()
    for step, scale in enumerate([65536.0, 1024.0, 2.0, 1.0]):
        events.loss_scale(step, scale, dynamic=True, floor=1.0)
    first = events.earliest()
    assert (first.mechanism, first.step) == (SCALE_COLLAPSE, 3)
    static = FirstEvents()
    static.loss_scale(0, 1.0, dynamic=False, floor=1.0)
    assert static.earliest() is None


def test_one_forward_gives_every_module_in_order_of_completion():
    """Values that flush in fp16 before a division: the division's inf follows."""

    class Tiny(nn.Module):
        def forward(self, x):
            return x * 1e-9

    class Divide(nn.Module):
        def forward(self, x):
            return x / x.sum()

    model = nn.Sequential(nn.Identity(), Tiny(), Divide())
    x = torch.ones(4, dtype=torch.float16)
    events = FirstEvents()
    events.activation("1", 0, 4, 0, 0, "fp16", 1)  # what the layer held at the start
    first_nonfinite = diagnose_forward(model, lambda: model(x), events, step=5)
    assert first_nonfinite == "2"
    first = events.earliest()
    assert (first.mechanism, first.layer, first.step) == (FLUSH, "1", 5)


def test_a_gradient_flush_is_named_only_where_nothing_broke_the_run():
    """A head whose logits grow saturates its softmax: its fp16 gradients flush (step
    310), then its outputs overflow (step 869). The flush stalled the layer; the overflow
    broke the run, and is what the reason names. A run that only flushed names the
    flush."""
    events = FirstEvents()
    events.gradient("head", 0, 10, 0, "fp16", 2)
    events.gradient("head", 310, 10, 9, "fp16", 2)
    first = events.earliest()
    assert (first.mechanism, first.values, first.step) == (FLUSH, "gradients", 310)
    events.activation("head", 869, 10, 4, 0, "fp16", 2)
    first = events.earliest()
    assert (first.mechanism, first.layer, first.step) == (OVERFLOW, "head", 869)
    assert FirstEvents.from_list(events.to_list()).earliest() == first
