"""The serving core: converting a model per layer for serving, and measuring it against
fp32 (agreement, latency, memory)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from autoprec.devices import get_backend
from autoprec.errors import AutoprecError, DeviceError, PolicyError
from autoprec.precision.plan import parameterised_leaves
from autoprec.precision.resolution import int8_capable
from autoprec.serving import (
    INT8_METHODS,
    Reference,
    ServingResult,
    convert,
    int8_available,
    int8_unavailable_reason,
    measure_serving,
    peak_memory_bytes,
    tied_leaves,
    timing_batch,
    weight_bytes,
    weight_dtypes,
)
from autoprec.tasks import load_task
from autoprec.trials.serving import time_models_side_by_side as time_side_by_side

CPU = get_backend("cpu")
QUICK = {"timed_calls": 3, "warmup_calls": 1}  # timing is checked for shape, not speed
INT8_HERE = [m for m in INT8_METHODS if int8_available("cpu", m)]


def _trained(name: str, steps: int) -> tuple:
    """A task and its model trained in fp32 for a few steps, so that accuracy means
    something."""
    task = load_task(name)
    torch.manual_seed(0)
    model = task.model()
    optimizer = task.make_optimizer(model.parameters())
    data = iter(task.train_data(0))
    for _ in range(steps):
        batch = task.batch(next(data))
        loss = task.compute_loss(batch.run(model), batch.targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return task, model.eval()


@pytest.fixture(scope="module")
def mlp():
    return _trained("digits-mlp", 60)


@pytest.fixture(scope="module")
def cnn():
    return _trained("digits-cnn", 30)


@pytest.fixture(scope="module")
def bert():
    pytest.importorskip("transformers")
    task = load_task("tiny-bert")
    torch.manual_seed(0)
    return task, task.model().eval()  # untrained: only agreement matters here


def _leaves(model: nn.Module) -> list[str]:
    return [name for name, _ in parameterised_leaves(model)]


def _outputs(task, model) -> torch.Tensor:
    batch = task.batch(next(iter(task.val_data())))
    with torch.inference_mode():
        return batch.run(model)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_weights_really_change_dtype_and_halve(mlp, dtype):
    task, model = mlp
    converted = convert(model, dict.fromkeys(_leaves(model), dtype))
    assert set(weight_dtypes(converted).values()) == {dtype}
    assert {p.dtype for p in converted.parameters()} == {getattr(torch, dtype_name(dtype))}
    assert weight_bytes(converted) * 2 == weight_bytes(model)
    out = _outputs(task, converted)
    assert out.dtype == torch.float32
    assert torch.allclose(out, _outputs(task, model), atol=0.1, rtol=0.05)


def dtype_name(dtype: str) -> str:
    return {"fp16": "float16", "bf16": "bfloat16"}[dtype]


def test_batchnorm_statistics_are_cast_too(cnn):
    task, model = cnn
    converted = convert(model, dict.fromkeys(_leaves(model), "fp16"))
    assert converted.bn1.running_mean.dtype == torch.float16
    assert converted.bn1.running_var.dtype == torch.float16
    assert converted.bn1.num_batches_tracked.dtype == torch.int64  # integers stay
    assert weight_bytes(converted) / weight_bytes(model) == pytest.approx(0.5, abs=0.01)
    assert _outputs(task, converted).dtype == torch.float32


def test_a_mixed_mapping_runs_and_returns_fp32(cnn, bert):
    task, model = cnn
    mixed = {"conv1": "bf16", "bn1": "fp16", "conv2": "fp32", "bn2": "bf16", "head": "fp16"}
    out = _outputs(task, convert(model, mixed))
    assert out.dtype == torch.float32
    assert (out.argmax(-1) == _outputs(task, model).argmax(-1)).float().mean() > 0.9

    task, model = bert
    cycle = ("fp16", "bf16", "fp32")
    mapping = {name: cycle[i % 3] for i, name in enumerate(_leaves(model))}
    converted = convert(model, mapping)
    assert weight_dtypes(converted) == mapping
    out = _outputs(task, converted)
    assert type(out).__name__ == "SequenceClassifierOutput"  # the container is kept
    assert out.logits.dtype == torch.float32
    assert torch.allclose(out.logits, _outputs(task, model).logits, atol=0.05)


def test_the_fp32_model_is_never_touched(mlp):
    task, model = mlp
    before = copy.deepcopy(model.state_dict())
    expected = _outputs(task, model)
    model.train()
    mapping = {"fc1": "int8", "fc2": "fp16", "head": "bf16"} if INT8_HERE else {"fc2": "fp16"}
    converted = convert(model, mapping)
    assert model.training and not converted.training
    model.eval()
    assert isinstance(model.fc1, nn.Linear)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert torch.equal(_outputs(task, model), expected)  # no hooks left behind


@pytest.mark.parametrize("method", INT8_HERE)
def test_int8_linear_runs_and_shrinks_weights(mlp, method):
    task, model = mlp
    linears = [name for name, leaf in parameterised_leaves(model) if int8_capable(leaf)]
    converted = convert(model, dict.fromkeys(linears, "int8"), int8=method)
    assert {weight_dtypes(converted)[name] for name in linears} == {"int8"}
    assert weight_bytes(converted) < 0.3 * weight_bytes(model)
    out = _outputs(task, converted)
    assert out.dtype == torch.float32
    agree = (out.argmax(-1) == _outputs(task, model).argmax(-1)).float().mean()
    assert agree > 0.95


def test_int8_covers_transformers_conv1d():
    pytest.importorskip("transformers")
    if "dynamic" not in INT8_HERE:
        pytest.skip("no dynamic int8 kernels here")
    task = load_task("tiny-gpt2")
    torch.manual_seed(0)
    model = task.model().eval()
    conv1d = [name for name, leaf in parameterised_leaves(model) if type(leaf).__name__ == "Conv1D"]
    converted = convert(model, dict.fromkeys(conv1d, "int8"))
    assert {weight_dtypes(converted)[name] for name in conv1d} == {"int8"}
    expected, out = _outputs(task, model).logits, _outputs(task, converted).logits
    assert torch.allclose(out, expected, atol=0.1)


def test_int8_on_a_conv_is_refused_in_one_line(cnn):
    _, model = cnn
    with pytest.raises(
        PolicyError, match=r"layer 'conv1': cannot be served in int8: a Conv2d is not"
    ) as e:
        convert(model, {"conv1": "int8", "head": "int8"})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_blocks_in_a_module_list_are_served_in_their_dtype(dtype):
    from tests.test_dtype_truth import ListOfBlocks

    torch.manual_seed(0)
    model = ListOfBlocks().eval()
    ran = {}
    for name in ("inp", "blocks.0", "blocks.1", "head"):  # hooks copied with the model
        model.get_submodule(name).register_forward_hook(
            lambda module, args, output, name=name: ran.setdefault(name, output.dtype) and None
        )
    converted = convert(model, {"blocks.0": dtype, "blocks.1": dtype}, CPU)
    x = torch.randn(3, 64)
    with torch.no_grad():
        served, reference = converted(x), model(x)
    low = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    assert ran == {"inp": torch.float32, "blocks.0": low, "blocks.1": low, "head": torch.float32}
    assert served.dtype == torch.float32
    assert torch.allclose(served, reference, atol=0.05, rtol=0.05)


def test_parameters_of_a_non_leaf_follow_its_leaves():
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.fc = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.attn(x, x, x)[0])

    model, x = Attention().eval(), torch.randn(2, 5, 16)
    converted = convert(model, {"attn.out_proj": "fp16", "fc": "bf16"})
    assert converted.attn.in_proj_weight.dtype == torch.float16  # held by the non-leaf
    assert torch.allclose(converted(x), model(x), atol=0.02)
    # MultiheadAttention reads out_proj's weight itself: it cannot be quantized.
    with pytest.raises(PolicyError, match="NonDynamicallyQuantizableLinear"):
        convert(model, {"attn.out_proj": "int8"})


def test_bad_mappings_are_refused(mlp):
    _, model = mlp
    with pytest.raises(PolicyError, match="'fc9': not a leaf module"):
        convert(model, {"fc9": "fp16"})
    # fp8 is a serving dtype now (autoprec.serving.fp8): an unknown one is still refused.
    with pytest.raises(PolicyError, match="unknown dtype 'fp9'"):
        convert(model, {"fc1": "fp9"})
    with pytest.raises(PolicyError, match="unknown method 'fast'"):
        convert(model, {"fc1": "int8"}, int8="fast")


def test_tied_layers_must_share_a_dtype():
    pytest.importorskip("transformers")
    task = load_task("tiny-gpt2")
    model = task.model()
    assert tied_leaves(model) == [("transformer.wte", "lm_head")]
    with pytest.raises(PolicyError, match=r"'transformer.wte' .* and 'lm_head' .* share"):
        convert(model, {"transformer.wte": "fp16", "lm_head": "bf16"})
    both = convert(model, {"transformer.wte": "bf16", "lm_head": "bf16"})
    assert both.lm_head.weight is both.transformer.wte.weight  # still one tensor


def test_int8_availability_says_why_not():
    assert int8_available("cpu") == bool(INT8_HERE)
    assert not int8_available("npu")
    assert "npu" in int8_unavailable_reason("npu")
    assert "CPU only" in int8_unavailable_reason("cuda", "dynamic")
    with pytest.raises(DeviceError, match="int8"):
        convert(nn.Sequential(nn.Linear(2, 2)), {"0": "int8"}, int8=None, device=_NoInt8())


class _NoInt8(type(CPU)):
    """A CPU backend that says it is an NPU, to see int8 refused where it has no kernels."""

    kind = "npu"

    def __init__(self) -> None:
        self.index = None
        self.device = torch.device("cpu")


def test_an_all_fp32_conversion_agrees_exactly(mlp):
    task, model = mlp
    reference = Reference.of(task, model, CPU)
    assert reference.accuracy > 0.8  # trained: accuracy means something
    result = measure_serving(task, convert(model, {}), reference, CPU, 8, **QUICK)
    assert result.state == "complete", result.reason
    assert result.top1_agreement == 1.0
    assert result.max_rel_deviation == 0.0 and result.mean_rel_deviation == 0.0
    assert result.accuracy == reference.accuracy and result.accuracy_drop == 0.0
    assert result.samples == reference.samples == 359


def test_low_precision_is_measured_against_fp32(mlp):
    task, model = mlp
    reference = Reference.of(task, model, CPU)
    result = measure_serving(
        task, convert(model, dict.fromkeys(_leaves(model), "bf16")), reference, CPU, 8, **QUICK
    )
    assert result.state == "complete", result.reason
    assert 0.95 < result.top1_agreement <= 1.0
    assert 0 < result.mean_rel_deviation <= result.max_rel_deviation < 0.1
    assert abs(result.accuracy_drop) < 0.03
    assert result.weight_mb == pytest.approx(weight_bytes(model) / 2 / 2**20)
    metrics = result.metrics()
    assert "top1_agreement" in metrics and "latency_p50_ms" in metrics
    assert ServingResult.from_dict(result.to_dict()) == result


@pytest.mark.parametrize("batch_size", [1, 7, 300])
def test_latency_and_throughput_at_an_exact_batch_size(mlp, batch_size):
    task, model = mlp
    batch = timing_batch(task, batch_size, CPU)
    assert batch.size == batch_size  # 300 joins two validation batches
    assert batch.args[0].untyped_storage().nbytes() == batch_size * 64 * 4
    reference = Reference.of(task, model, CPU)
    result = measure_serving(task, convert(model, {}), reference, CPU, batch_size, **QUICK)
    assert result.state == "complete", result.reason
    assert result.batch_size == batch_size
    assert 0 < result.latency_p50_ms <= result.latency_p90_ms
    assert result.throughput_sps > 0
    assert result.peak_memory_is_estimate
    assert result.peak_memory_mb > result.weight_mb  # weights plus live activations


def test_the_cpu_memory_estimate_counts_weights_and_activations(mlp):
    task, model = mlp
    small, large = (timing_batch(task, n, CPU) for n in (1, 256))
    fp32, bf16 = convert(model, {}), convert(model, dict.fromkeys(_leaves(model), "bf16"))
    peak_small, estimate = peak_memory_bytes(fp32, small, CPU)
    peak_large, _ = peak_memory_bytes(fp32, large, CPU)
    assert estimate
    # An MLP 256 wide keeps two 256-wide activations alive at once, plus its input.
    activations = peak_large - weight_bytes(fp32)
    assert 2 * 256 * 256 * 4 <= activations <= 4 * 256 * 256 * 4
    assert peak_small < peak_large
    assert peak_memory_bytes(bf16, large, CPU)[0] < peak_large


class _Allocator(type(CPU)):
    """A CPU backend with an allocator's statistics: 1000 bytes held by others before the
    forward, 1500 at its peak."""

    kind = "cuda"

    def __init__(self) -> None:
        self.index, self.device = None, torch.device("cpu")
        self.readings = iter([1000, 1500])

    def reset_peak_memory(self) -> None:
        pass

    def max_memory_allocated_bytes(self) -> int:
        return next(self.readings)


def test_the_allocator_peak_counts_this_model_only(mlp):
    task, model = mlp
    batch = timing_batch(task, 2, CPU)
    peak, estimate = peak_memory_bytes(model, batch, _Allocator())
    assert not estimate
    assert peak == weight_bytes(model) + 2 * 64 * 4 + 500


def test_tied_weights_count_once():
    pytest.importorskip("transformers")
    model = load_task("tiny-gpt2").model()
    assert model.lm_head.weight is model.transformer.wte.weight
    unique = {id(p): p.numel() * 4 for p in model.parameters()}  # parameters() dedupes too
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert weight_bytes(model) == sum(unique.values()) + buffers


def test_a_non_finite_output_fails_the_measurement_with_the_layer():
    task = load_task("digits-overflow")  # its quadratic features pass fp16's 65504
    torch.manual_seed(0)
    model = task.model().eval()
    reference = Reference.of(task, model, CPU)
    converted = convert(model, dict.fromkeys(_leaves(model), "fp16"))
    result = measure_serving(task, converted, reference, CPU, 4, **QUICK)
    assert result.state == "failed"
    assert "non-finite outputs" in result.reason and "features" in result.reason
    assert result.batch_size == 4


def test_bad_measurement_input_raises(mlp):
    task, model = mlp
    reference = Reference.of(task, model, CPU)
    with pytest.raises(AutoprecError, match="batch_size"):
        measure_serving(task, model, reference, CPU, 0)
    other = Reference(reference.logits[:1], reference.accuracy, 10)
    with pytest.raises(AutoprecError, match="the reference holds 1 batches"):
        measure_serving(task, convert(model, {}), other, CPU, 1, **QUICK)


def test_side_by_side_times_each_model(mlp):
    task, model = mlp
    models = [convert(model, {}), convert(model, dict.fromkeys(_leaves(model), "bf16"))]
    times = time_side_by_side(models, timing_batch(task, 4, CPU), CPU, rounds=2, block=2)
    assert len(times) == 2 and all(t > 0 for t in times)


def test_agreement_on_a_transformers_model(bert):
    task, model = bert
    reference = Reference.of(task, model, CPU)
    converted = convert(model, dict.fromkeys(_leaves(model), "fp16"))
    result = measure_serving(task, converted, reference, CPU, 2, **QUICK)
    assert result.state == "complete", result.reason
    assert result.top1_agreement > 0.95
    assert result.max_rel_deviation < 0.05
    assert result.peak_memory_mb > result.weight_mb
