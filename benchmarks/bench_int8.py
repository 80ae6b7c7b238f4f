"""Which int8 implementation to serve Linear layers with on this CPU: latency against fp32.

Run by hand: ``python benchmarks/bench_int8.py [--threads 1] [--rounds 8] [--norms]``.
A Linear-heavy model (1024 -> 4096 -> 1024, twice, with GELU: 16.8M parameters) is
converted by ``autoprec.serving.convert`` to fp32, bf16, fp16 and int8 by each method
(torch's dynamic quantization, torchao's dynamic-activation and weight-only configs), then
timed at each batch size with ``time_models_side_by_side``: the variants alternate in short
blocks, so that drift of a shared machine hits them alike; each figure is the median of
all timed forwards. Printed per variant: latency, its ratio to fp32, weight MB
(``weight_bytes``) and the largest relative output deviation from fp32 over the batch.

``--norms`` adds the measurement behind keeping or casting BatchNorm's and LayerNorm's
statistics: low-precision inputs through norms with fp32 parameters and statistics,
against norms cast to the input's dtype.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from autoprec.devices import get_backend
from autoprec.serving import INT8_METHODS, convert, int8_available, weight_bytes
from autoprec.tasks.base import Batch
from autoprec.trials.serving import time_models_side_by_side

WIDTH, HIDDEN = 1024, 4096


def linear_heavy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, WIDTH),
        nn.GELU(),
        nn.Linear(WIDTH, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, WIDTH),
    ).eval()


def variants(model: nn.Module) -> dict[str, nn.Module]:
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    found = {dtype: convert(model, dict.fromkeys(linears, dtype)) for dtype in ("fp32", "bf16")}
    found["fp16"] = convert(model, dict.fromkeys(linears, "fp16"))
    for method in INT8_METHODS:
        if int8_available("cpu", method):
            found[f"int8 {method}"] = convert(model, dict.fromkeys(linears, "int8"), int8=method)
    return found


def max_deviation(model: nn.Module, reference: nn.Module, x: torch.Tensor) -> float:
    with torch.inference_mode():
        expected, got = reference(x), model(x)
    return float(((got - expected).norm(dim=1) / expected.norm(dim=1)).max())


def int8_table(batch_sizes: list[int], rounds: int, block: int) -> None:
    backend = get_backend("cpu")
    models = variants(linear_heavy())
    names = list(models)
    columns: dict[int, list[float]] = {}
    deviations: dict[str, float] = {}
    for size in batch_sizes:
        x = torch.randn(size, WIDTH, generator=torch.Generator().manual_seed(size))
        batch = Batch.of((x, None))
        columns[size] = time_models_side_by_side(
            list(models.values()), batch, backend, rounds, block
        )
        for name in names:
            deviation = max_deviation(models[name], models["fp32"], x)
            deviations[name] = max(deviations.get(name, 0.0), deviation)
    header = "| variant | weight MB | max rel deviation |"
    header += "".join(f" b{s} ms | b{s} x fp32 |" for s in batch_sizes)
    print(header)
    print("|---" * (3 + 2 * len(batch_sizes)) + "|")
    for i, name in enumerate(names):
        row = f"| {name} | {weight_bytes(models[name]) / 2**20:.1f} | {deviations[name]:.4f} |"
        for size in batch_sizes:
            ms = columns[size][i]
            row += f" {ms:.2f} | {ms / columns[size][0]:.2f} |"
        print(row)


def _alternating_ms(
    cases: list[tuple[nn.Module, torch.Tensor]], rounds: int, block: int
) -> list[float]:
    """Median ms per call of each (module, input), timed in alternating blocks after an
    untimed round."""
    times: list[list[float]] = [[] for _ in cases]
    with torch.inference_mode():
        for round_index in range(rounds + 1):
            for spent, (module, x) in zip(times, cases, strict=True):
                for _ in range(block):
                    started = time.perf_counter()
                    module(x)
                    if round_index:
                        spent.append(time.perf_counter() - started)
    return [statistics.median(spent) * 1000.0 for spent in times]


def norms_table(rounds: int, block: int) -> None:
    """BatchNorm2d (64 channels, 64x16x16) and LayerNorm (256, 64x32x256) on fp16/bf16
    inputs: parameters and statistics cast with the layer, or kept in fp32."""
    torch.manual_seed(0)
    batchnorm = nn.BatchNorm2d(64).eval()
    batchnorm.running_mean.normal_()
    batchnorm.running_var.uniform_(0.5, 2.0)
    layernorm = nn.LayerNorm(256)
    nn.init.uniform_(layernorm.weight, 0.5, 1.5)
    nn.init.normal_(layernorm.bias)
    cases = [("BatchNorm2d", batchnorm, (64, 64, 16, 16)), ("LayerNorm", layernorm, (64, 32, 256))]
    print("| norm | dtype | fp32 ms | cast ms | fp32 stats ms | cast max err | fp32 stats err |")
    print("|---|---|---|---|---|---|---|")
    for name, norm, shape in cases:
        x = torch.randn(*shape) * 3 + 1
        with torch.inference_mode():
            expected = norm(x)
        for dtype in (torch.float16, torch.bfloat16):
            cast, low = copy.deepcopy(norm).to(dtype), x.to(dtype)
            with torch.inference_mode():
                err_cast = float((cast(low).float() - expected).abs().max())
                err_kept = float((norm(low).float() - expected).abs().max())
            fp32_ms, cast_ms, kept_ms = _alternating_ms(
                [(norm, x), (cast, low), (norm, low)], rounds, block
            )
            print(
                f"| {name} | {str(dtype)[6:]} | {fp32_ms:.3f} | {cast_ms:.3f} | {kept_ms:.3f} | "
                f"{err_cast:.4f} | {err_kept:.4f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    parser.add_argument("--norms", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"quantized engine {torch.backends.quantized.engine}, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )
    int8_table([int(s) for s in args.batch_sizes.split(",")], args.rounds, args.block)
    if args.norms:
        norms_table(args.rounds, 4 * args.block)


if __name__ == "__main__":
    main()
