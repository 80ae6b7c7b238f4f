"""Built-in tasks on scikit-learn's bundled digits data (8x8 images, 10 classes).

No downloads: the data ships inside scikit-learn. The split and the batch order are
fixed by seeds, so every trial of a search sees the same data in the same order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from autoprec.tasks.base import IGNORE_INDEX, Task
from autoprec.tasks.digits import BATCH_SIZE, Batch, batches, digits, digits_data

RESNET_BATCH = 32
# BatchNorm statistics that follow the weights within a short trial, for evaluation.
RESNET_BN_MOMENTUM = 0.3


def mlp(hidden: int = 256) -> nn.Module:
    return nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(64, hidden),
            norm1=nn.LayerNorm(hidden),
            act1=nn.ReLU(),
            fc2=nn.Linear(hidden, hidden),
            norm2=nn.LayerNorm(hidden),
            act2=nn.ReLU(),
            head=nn.Linear(hidden, 10),
        )
    )


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head for 8x8 single-channel images."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(2 * width * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        return self.head(torch.flatten(x, 1))


def digits_mlp() -> Task:
    """The default task: a 3-layer MLP with LayerNorm on flattened digits."""
    train_data, val_data = digits_data(flatten=True)
    return Task("digits-mlp", mlp, train_data, val_data, F.cross_entropy)


def digits_cnn() -> Task:
    """A small CNN with BatchNorm on 8x8 digit images."""
    train_data, val_data = digits_data(flatten=False)
    return Task("digits-cnn", SmallCNN, train_data, val_data, F.cross_entropy)


class Bottleneck(nn.Module):
    """ResNet-50's bottleneck block: 1x1 reduce, 3x3 (strided), 1x1 expand by 4, plus the
    shortcut (a strided 1x1 conv and BatchNorm where the shape changes)."""

    expansion = 4

    def __init__(
        self, in_channels: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ) -> None:
        super().__init__()
        out_channels = planes * self.expansion
        self.conv1 = nn.Conv2d(in_channels, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes, momentum=RESNET_BN_MOMENTUM)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes, momentum=RESNET_BN_MOMENTUM)
        self.conv3 = nn.Conv2d(planes, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels, momentum=RESNET_BN_MOMENTUM)
        # Each residual branch starts at zero (torchvision's zero_init_residual): the deep
        # network starts as a shallow one and trains in a few dozen steps.
        nn.init.zeros_(self.bn3.weight)
        self.relu = nn.ReLU()
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet-50's layout (bottleneck blocks [3, 4, 6, 3], 150 modules) at tiny widths
    for 8x8 images: a 3x3 stem without pooling, stages at 8x8, 4x4, 2x2 and 1x1."""

    def __init__(
        self, layers: tuple[int, ...] = (3, 4, 6, 3), width: int = 4, num_classes: int = 10
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width, momentum=RESNET_BN_MOMENTUM)
        self.relu = nn.ReLU()
        channels = width
        stages = []
        for index, blocks in enumerate(layers):
            planes = width * 2**index
            stride = 1 if index == 0 else 2
            downsample = None
            if stride != 1 or channels != planes * Bottleneck.expansion:
                downsample = nn.Sequential(
                    nn.Conv2d(channels, planes * Bottleneck.expansion, 1, stride, bias=False),
                    nn.BatchNorm2d(planes * Bottleneck.expansion, momentum=RESNET_BN_MOMENTUM),
                )
            stage = [Bottleneck(channels, planes, stride, downsample)]
            channels = planes * Bottleneck.expansion
            stage += [Bottleneck(channels, planes) for _ in range(1, blocks)]
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _adam_resnet(params: object) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)  # type: ignore[arg-type]


def digits_resnet() -> Task:
    """A ResNet-50-style network (150 modules) on 8x8 digit images: the large-model case
    for automatic grouping and profiling. Width 4 and batch 32 keep a step cheap on a
    2-core CPU in every dtype; it reaches about 80% accuracy in 30 steps, 89% in 60."""
    train_data, val_data = digits_data(flatten=False, batch_size=RESNET_BATCH)
    return Task(
        "digits-resnet", ResNet, train_data, val_data, F.cross_entropy, optimizer=_adam_resnet
    )


# -- fragile tasks: real failure mechanisms of plain fp16, trainable in fp32 and bf16 ---

RAW_SENSOR_SCALE = 1023.0  # raw 10-bit sensor counts instead of values in [0, 1]
SMALL_LOSS_WEIGHT = 2.0**-20  # a loss weighted this low has gradients below fp16's range
FRAGILE_BATCH = 256


class QuadraticFeatures(nn.Module):
    """A projection followed by its square (an energy feature): on raw inputs in the
    hundreds, the squares reach ~1e5, past fp16's largest value 65504."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return h * h


def overflow_mlp(hidden: int = 256) -> nn.Module:
    """Quadratic features of unnormalised inputs, a LayerNorm, then an MLP."""
    return nn.Sequential(
        OrderedDict(
            features=QuadraticFeatures(64, 64),
            norm_in=nn.LayerNorm(64),
            fc1=nn.Linear(64, hidden),
            act1=nn.ReLU(),
            fc2=nn.Linear(hidden, hidden),
            act2=nn.ReLU(),
            head=nn.Linear(hidden, 10),
        )
    )


def digits_overflow() -> Task:
    """Overflow: on raw 10-bit inputs the quadratic features pass 65504.

    Uniform fp16 produces inf in ``features`` (its ``h * h``) and diverges whatever the scale
    (the overflow is in the forward pass); keeping that layer in fp32 or bf16 (fp32's
    range) fixes it while the layers behind the LayerNorm run in fp16.
    """
    train_data, val_data = digits_data(
        flatten=True, input_scale=RAW_SENSOR_SCALE, batch_size=FRAGILE_BATCH
    )
    return Task("digits-overflow", overflow_mlp, train_data, val_data, F.cross_entropy)


def _small_weight_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets) * SMALL_LOSS_WEIGHT


def _adam_small_eps(params: object) -> torch.optim.Optimizer:
    # Adam normalises gradient size away, so fp32 trains on a tiny loss as on a plain one
    # once eps is below the gradients' magnitude.
    return torch.optim.Adam(params, lr=1e-3, eps=1e-20)  # type: ignore[arg-type]


def digits_underflow() -> Task:
    """Underflow: a loss weighted by 2**-20 puts the gradients near 1e-9, under fp16's
    smallest subnormal (6e-8).

    Uniform fp16 without loss scaling flushes them to zero and stops learning; a loss
    scale of 2**10 or more, or bf16 (fp32's range), trains as fp32 does.
    """
    train_data, val_data = digits_data(flatten=True, batch_size=FRAGILE_BATCH)
    return Task(
        "digits-underflow",
        lambda: mlp(256),
        train_data,
        val_data,
        _small_weight_loss,
        optimizer=_adam_small_eps,
    )


# -- a fragile fp8 task: massive activations on marker rows, as LLMs' sink tokens carry --

MARKER_EVERY = 16  # one marker row (a BOS-like token) in every 16 rows of a batch
MARKER_CHANNELS = 16  # a marker block beside the 64 pixels: 80 inputs, a multiple of 16
SINK_CHANNEL = 0  # the hidden channel where marker rows carry the massive activation
SINK_SCALE = 2.0**20  # about 1e6 times the hidden state's typical value
FP8_HIDDEN = 256
FP8_OUTPUTS = 16  # 10 classes, padded to a multiple of 16 (torch._scaled_mm's)


class SinkMLP(nn.Module):
    """An MLP whose hidden state carries a massive activation on marker rows.

    As in large language models, where a few tokens (the first, a delimiter) carry one
    hidden channel thousands of times larger than the rest (Sun et al. 2024, "Massive
    activations in large language models"), marker rows here add ``SINK_SCALE`` to one
    fixed channel of the normalised hidden state, so that ``fc2`` alone takes inputs with
    an outlier channel. Marker rows are not scored (their targets are IGNORE_INDEX), so
    their gradients are exactly zero and fp32 and bf16 training are blind to them;
    but tensorwise float8 scales ``fc2``'s whole input by its largest value, and the
    ordinary rows, about 1e6 times smaller, flush to zero in e4m3 (whose range spans
    448 down to 2**-9).
    """

    sink: torch.Tensor

    def __init__(self, hidden: int = FP8_HIDDEN) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64 + MARKER_CHANNELS, hidden)
        self.norm1 = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc3 = nn.Linear(hidden, hidden)
        self.norm3 = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, FP8_OUTPUTS)
        sink = torch.zeros(hidden)
        sink[SINK_CHANNEL] = SINK_SCALE
        self.register_buffer("sink", sink)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        marker = x[:, 64:65]  # 1 on marker rows, 0 on digit rows
        h = F.relu(self.norm1(self.fc1(x))) + marker * self.sink.to(x.dtype)
        h = F.relu(self.norm2(self.fc2(h)))
        h = F.relu(self.norm3(self.fc3(h)))
        return self.head(h)


def _with_markers(images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat digits with a zero marker block, every MARKER_EVERY-th row replaced by a
    marker row (pixels 0, marker 1) whose target is not scored."""
    x = torch.cat([images.reshape(len(images), -1), torch.zeros(len(images), MARKER_CHANNELS)], 1)
    y = labels.clone()
    x[::MARKER_EVERY] = 0.0
    x[::MARKER_EVERY, 64] = 1.0
    y[::MARKER_EVERY] = IGNORE_INDEX
    return x, y


def fp8_outliers() -> Task:
    """Outlier channels for fp8: marker rows carry a massive activation into ``fc2``.

    Tensorwise float8 scaling of ``fc2``'s input crushes the digit rows' values to zero,
    so uniform fp8 loses accuracy while bf16 trains as fp32 does; fp8 everywhere but
    ``fc2`` holds (fc1, fc3 and the head see ordinary ranges). All Linear dimensions are
    multiples of 16, as torchao's float8 needs.
    """

    def train_data(seed: int) -> Iterator[Batch]:
        x, y, _, _ = digits()
        for batch_x, batch_y in batches(x, y, seed, BATCH_SIZE):
            yield _with_markers(batch_x, batch_y)

    def val_data() -> list[Batch]:
        _, _, x, y = digits()
        return [_with_markers(x[i : i + 256], y[i : i + 256]) for i in range(0, len(y), 256)]

    return Task("fp8-outliers", SinkMLP, train_data, val_data, F.cross_entropy)


# -- a fragile optimizer-state task: rare one-hot features beside raw-scale ones ---------

RARE_DENSE = 16  # raw measurements, about RARE_DENSE_SCALE in size (not normalised)
RARE_DENSE_SCALE = 10.0
RARE_CATEGORIES = 256  # one-hot codes: each row has one, each code ~1 row in a batch
RARE_OFFSET = 0.5  # the spread of a code's offset to the target
RARE_HIDDEN = 64
RARE_WIDTH = 4096
RARE_BATCH = 256
RARE_VAL_ROWS = 4096
RARE_WITHIN = 0.25  # a prediction counts as right within this of its target
RARE_VAL_SEED = 2**31  # beyond every training batch's seed (seed * 1_000_003 + step)


class RareFeatureMLP(nn.Module):
    """``inputs`` reads raw measurements and one-hot codes; a wide GELU MLP behind it."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs = nn.Linear(RARE_DENSE + RARE_CATEGORIES, RARE_HIDDEN)
        self.hidden = nn.Linear(RARE_HIDDEN, RARE_WIDTH)
        self.head = nn.Linear(RARE_WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.hidden(F.gelu(self.inputs(x))))
        return self.head(h).squeeze(-1)


def _rare_rows(seed: int, rows: int) -> Batch:
    """Rows of raw measurements and one code; the target is a linear read of the
    measurements plus the code's own offset (fixed across seeds)."""
    generator = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, RARE_DENSE, generator=generator)
    code = torch.randint(0, RARE_CATEGORIES, (rows,), generator=generator)
    fixed = torch.Generator().manual_seed(123)
    weights = torch.randn(RARE_DENSE, generator=fixed) / RARE_DENSE**0.5
    offsets = RARE_OFFSET * torch.randn(RARE_CATEGORIES, generator=fixed)
    x = torch.cat([RARE_DENSE_SCALE * z, F.one_hot(code, RARE_CATEGORIES).float()], 1)
    return x, z @ weights + offsets[code]


def _share_within(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    return float(((outputs.float() - targets).abs() < RARE_WITHIN).float().mean())


def _adamw_rare(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)  # type: ignore[arg-type]


def rare_features() -> Task:
    """Rare one-hot codes beside raw-scale measurements: 8-bit states fail in ``inputs``.

    A regression (mean squared error; the metric is the share of validation rows
    predicted within 0.25 of the target) on 16 raw measurements of scale ~10 and one of
    256 codes per row: each code is seen by about one row of a batch of 256 and is absent
    from about a third of the batches. ``inputs.weight`` (64 x 272) has both kinds of
    column in every 256-element block, and the measurements' gradients dwarf a code's.
    torchao's 8-bit second moment (dynamic map: the smallest code is 3.25e-7 of the
    block's largest) then stores a code's ``exp_avg_sq`` as 0 (one step adds
    ``(1 - beta2) * g**2``, below half that code) while its signed ``exp_avg`` lives on;
    on a batch without the code the gradient is exactly 0, the denominator is ``eps``
    and the update ``lr * exp_avg / eps``: the code's weights blow up, and a squared
    error pays for the overshoot (a cross-entropy would not: a blow-up along the descent
    direction only makes a classifier surer). The layers behind (``hidden``, ``head``)
    see GELU activations, never exactly zero gradients, and hold in 8 bits; bf16 states
    have fp32's range and hold in ``inputs`` too.

    Measured (``benchmarks/bench_rare_features.py``: AdamW lr 3e-3, 200 steps, seeds 0
    and 1, CPU, torch 2.13, torchao 0.18), share within 0.25 / validation MSE / largest
    ``|inputs.weight|``:
    fp32 states 0.999, 1.000 / 0.0035, 0.0036 / 0.40, 0.40;
    all 8-bit 0.872, 0.917 / 0.034, 0.028 / 1.2e3, 7.3e2;
    ``inputs`` in fp32, the rest 8-bit 0.999, 1.000 / 0.0035, 0.0036 / 0.40, 0.40;
    ``inputs`` in bf16, the rest 8-bit 0.999, 1.000 / 0.0035, 0.0036 / 0.39, 0.40.
    In a search (``search_spaces/rare-features.yaml``, seed 0) uniform 8-bit is pruned at
    step 39 (loss 9.3 against fp32's 0.25), its reason naming group ``inputs`` with 19%
    of ``inputs.weight``'s entries collapsed (so is ``inputs`` alone in 8 bits); the
    choice, ``inputs`` in bf16 and the rest in 8 bits, stores 0.596 MB of state against
    0.566 for all 8-bit and 2.196 for fp32 (``inputs`` in fp32: 0.663, 17% over).
    Those figures are from a CPU with AVX-512 FP16. With torch and oneDNN held to AVX2
    (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``), ``inputs`` in bf16 beside
    8-bit ``hidden`` collapsed ``hidden``'s states too (0.518), and the search answered
    ``inputs`` in fp32: how close to the edge the layers behind sit moves with the kernels.
    """

    def train_data(seed: int) -> Iterator[Batch]:
        step = 0
        while True:
            yield _rare_rows(seed * 1_000_003 + step, RARE_BATCH)
            step += 1

    def val_data() -> list[Batch]:
        x, y = _rare_rows(RARE_VAL_SEED, RARE_VAL_ROWS)
        return [(x[i : i + 1024], y[i : i + 1024]) for i in range(0, RARE_VAL_ROWS, 1024)]

    return Task(
        "rare-features",
        RareFeatureMLP,
        train_data,
        val_data,
        F.mse_loss,
        metric=_share_within,
        optimizer=_adamw_rare,
    )


def _late_overflow() -> Task:
    from autoprec.tasks.late import late_overflow

    return late_overflow()


def _tiny_gpt2() -> Task:
    from autoprec.tasks.hf import tiny_gpt2

    return tiny_gpt2()


def _tiny_bert() -> Task:
    from autoprec.tasks.hf import tiny_bert

    return tiny_bert()


def _tiny_llama() -> Task:
    from autoprec.tasks.hf import tiny_llama

    return tiny_llama()


def _tiny_t5() -> Task:
    from autoprec.tasks.hf import tiny_t5

    return tiny_t5()


BUILTIN_TASKS: dict[str, Callable[[], Task]] = {
    "digits-mlp": digits_mlp,
    "digits-cnn": digits_cnn,
    "digits-resnet": digits_resnet,
    "digits-overflow": digits_overflow,
    "digits-underflow": digits_underflow,
    "fp8-outliers": fp8_outliers,
    "rare-features": rare_features,
    "late-overflow": _late_overflow,
    # transformers models, behind the optional extra [hf]
    "tiny-gpt2": _tiny_gpt2,
    "tiny-bert": _tiny_bert,
    "tiny-llama": _tiny_llama,
    "tiny-t5": _tiny_t5,
}
DEFAULT_TASK = "digits-mlp"
