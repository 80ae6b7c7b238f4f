"""The task of the fp8 guided-against-random benchmark: seven Linear layers, one of them
fed an outlier channel, each its own group over {bf16, fp8}.

As the built-in ``fp8-outliers`` task (`autoprec.tasks.builtin.SinkMLP`): marker rows,
one in 16 and not scored, add a massive activation (2**20) to one hidden channel, here
in front of ``wide``, the largest layer (64 to 3x64 features, summed back to 64: about
35% of the Linear weights).
Tensorwise float8 scales ``wide``'s whole input by the outlier, the digit rows' values
flush to zero in e4m3, and accuracy drops; the other layers see ordinary ranges and
train in fp8 as in bf16. To hold at least half of the Linear weights in fp8 with
``wide`` in bf16, all the other layers but one of the small ones must be in fp8 as well:
11 of the space's 2**7 = 128 policies, which is what makes the search's question hard
for a blind sampler. All Linear dimensions are multiples of 16, as torchao's float8 needs.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F

from autoprec.space import SearchSpace
from autoprec.tasks import Task
from autoprec.tasks.base import IGNORE_INDEX
from autoprec.tasks.builtin import MARKER_CHANNELS, MARKER_EVERY, SINK_SCALE, digits_data

HIDDEN = 64
WIDE = 3 * HIDDEN  # summed back to HIDDEN features: the layer's own weights are large
OUTPUTS = 16  # 10 classes, padded to a multiple of 16
# A short trial's accuracy moves by a few points between bf16 and fp32 already; the
# outlier's damage is tens of points (the trial is stopped early).
ACCURACY_TOLERANCE = 0.05
LEARNING_RATE = 5e-3  # Adam: trains within a short trial
GROUPS = ["fc1", "fc2", "wide", "fc4", "fc5", "fc6", "head"]
OUTLIER_LAYER = "wide"


class DeepSinkMLP(nn.Module):
    """Seven Linear layers; marker rows carry a massive activation into ``wide``."""

    sink: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64 + MARKER_CHANNELS, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.wide = nn.Linear(HIDDEN, WIDE)
        self.fc4 = nn.Linear(HIDDEN, HIDDEN)
        self.fc5 = nn.Linear(HIDDEN, HIDDEN)
        self.fc6 = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUTPUTS)
        self.norms = nn.ModuleList([nn.LayerNorm(n) for n in (HIDDEN, HIDDEN, WIDE, HIDDEN)])
        sink = torch.zeros(HIDDEN)
        sink[0] = SINK_SCALE
        self.register_buffer("sink", sink)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        marker = x[:, 64:65]  # 1 on marker rows, 0 on digit rows
        h = F.relu(self.norms[0](self.fc1(x)))
        h = F.relu(self.norms[1](self.fc2(h))) + marker * self.sink.to(h.dtype)
        h = F.relu(self.norms[2](self.wide(h))).reshape(len(h), WIDE // HIDDEN, HIDDEN).sum(1)
        h = F.relu(self.norms[3](self.fc4(h)))
        h = F.relu(self.fc5(h))
        h = F.relu(self.fc6(h))
        return self.head(h)


def _with_markers(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat digits with a zero marker block; every MARKER_EVERY-th row a marker row
    (pixels 0, marker 1) whose target is not scored."""
    x = torch.cat([x, torch.zeros(len(x), MARKER_CHANNELS)], 1)
    y = y.clone()
    x[::MARKER_EVERY] = 0.0
    x[::MARKER_EVERY, 64] = 1.0
    y[::MARKER_EVERY] = IGNORE_INDEX
    return x, y


def deep_sink_mlp() -> Task:
    train, val = digits_data(flatten=True)

    def train_data(seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for x, y in train(seed):
            yield _with_markers(x, y)

    def val_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [_with_markers(x, y) for x, y in val()]

    return Task(
        "fp8-deep-sink", DeepSinkMLP, train_data, val_data, F.cross_entropy, optimizer=_adam
    )


def _adam(params: object) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LEARNING_RATE)  # type: ignore[arg-type]


def fp8_space() -> SearchSpace:
    """Each Linear its own group, bf16 or fp8 (tensorwise, the recipe the outlier breaks);
    the LayerNorms in bf16."""
    return SearchSpace.from_dict(
        {
            "name": "fp8-bench",
            "accuracy_tolerance": ACCURACY_TOLERANCE,
            "dtypes": ["bf16", "fp8"],
            "fp8_recipes": ["tensorwise"],
            "groups": [{"name": g, "patterns": [g]} for g in GROUPS]
            + [{"name": "norms", "types": ["LayerNorm"]}],
        },
        "<fp8-bench>",
    )
