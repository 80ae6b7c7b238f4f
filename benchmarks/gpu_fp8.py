"""fp8 on a GPU: a GPT-2-small-shaped model trained compiled in bf16 autocast, uniform
float8 (torchao's tensorwise and rowwise recipes) and a searched per-layer policy, side by
side, against issue 20's targets and torchao's published float8 speed-ups.

Issue 20's prepared device check, for an H100 or H200 (CUDA compute capability 8.9+):

    python benchmarks/gpu_fp8.py                       # a short autoprec search finds the policy
    python benchmarks/gpu_fp8.py --policy best_policy.yaml   # or time a policy found before

- The model: GPT-2 small's shape (12 layers, d_model 768, 12 heads, vocabulary 50257,
  sequence 1024) in plain torch, at batch 8 x 1024 tokens, trained with AdamW. Its 48
  block Linear layers can take fp8; the head's 50257 outputs are no multiple of 16, so it
  stays bf16 under every policy, as torchao's filter would keep it.
- The data: a synthetic induction language (each sequence's second half repeats its
  first), so that a few hundred steps learn something and losses can be compared.
- Each policy is applied with ``Policy.apply`` (fp8 layers swapped for torchao's
  ``Float8Linear``) and its model ``torch.compile``-d. Compiling and warming up are
  timed apart; then all four train in interleaved blocks (the order rotated every round)
  and each one's step time is the median over the blocks. All four start from the same
  weights and see the same batches.
- Feasible: the validation loss after the same steps within ``--tolerance`` (relative) of
  bf16's. Targets: where a uniform fp8 recipe is feasible, the searched policy is at least
  0.95x the faster feasible one's speed; where none is, the searched policy is feasible.
  Exit status 1 when a target is missed.
- Without ``--policy``, a short guided search (the shipped ``fp8`` space: bf16 or fp8 per
  group of layers, tensorwise or rowwise) runs first, on this GPU, in a fresh folder, its
  trials compiled (``SearchConfig(compile=True)``; eager under ``--smoke``).

Refused in one line, exit status 2, without CUDA compute capability 8.9. On the CPU,
``--smoke`` runs the same code on a tiny model, emulated (``--emulate fp8``: torchao's
float8 numerics without its speed), uncompiled: it exercises the script, its figures mean
nothing. Never run on a GPU yet: no device was lent to the session that wrote it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# torchao's published float8 *training* speed-ups over bf16 (not measured here), from
# pytorch/ao torchao/float8/README.md, "Training benchmarks" (commit 9519bebb): torchtitan,
# Llama3-8B, 8x H100, batch 1, sequence 8192, torch.compile, FSDP2, median tokens/second.
PUBLISHED = (
    ("Llama3-8B, 8x H100, tensorwise + float8 all-gather", "tensorwise", 7689.5 / 6150),
    ("Llama3-8B, 8x H100, rowwise + bf16 all-gather", "rowwise", 6768 / 6150),
)
PUBLISHED_SOURCE = "pytorch/ao torchao/float8/README.md (Training benchmarks, commit 9519bebb)"
# The same README (commit 0cf1281a) on single Linear layers on an H100: M,K,N =
# 1024,2048,1024 runs 0.80x bf16's speed (too small for float8), 4096,8192,16384 1.39x.
# GPT-2 small's K is 768 or 3072: small shapes, where fp8 may well be slower than bf16.
PUBLISHED_LINEAR = ((1024, 2048, 1024, 0.80), (4096, 8192, 16384, 1.39))
FP8_MIN_CAPABILITY = (8, 9)
TARGET_OF_UNIFORM = 0.95  # the searched policy's speed, at least this share of uniform fp8's
POOL_BATCHES = 8
VAL_BATCHES = 4


@dataclass(frozen=True)
class Shape:
    layers: int
    d_model: int
    heads: int
    vocab: int
    seq: int
    batch: int


GPT2_SMALL = Shape(layers=12, d_model=768, heads=12, vocab=50257, seq=1024, batch=8)
# Tiny, with a vocabulary that is no multiple of 16 either (the head stays bf16 too).
SMOKE = Shape(layers=2, d_model=64, heads=2, vocab=500, seq=32, batch=2)


class Attention(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.heads = shape.heads
        self.qkv = nn.Linear(shape.d_model, 3 * shape.d_model)
        self.proj = nn.Linear(shape.d_model, shape.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.fc = nn.Linear(shape.d_model, 4 * shape.d_model)
        self.proj = nn.Linear(4 * shape.d_model, shape.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(shape.d_model)
        self.attn = Attention(shape)
        self.ln2 = nn.LayerNorm(shape.d_model)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2's layout (pre-norm blocks, learned positions, GELU MLP), untied head."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.tok = nn.Embedding(shape.vocab, shape.d_model)
        self.pos = nn.Embedding(shape.seq, shape.d_model)
        self.blocks = nn.Sequential(*(Block(shape) for _ in range(shape.layers)))
        self.ln_f = nn.LayerNorm(shape.d_model)
        self.head = nn.Linear(shape.d_model, shape.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        return self.head(self.ln_f(self.blocks(x)))


def batches(shape: Shape, seed: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of the induction language: inputs and next-token targets."""
    generator = torch.Generator().manual_seed(seed)
    half = (shape.seq + 1) // 2 + 1
    found = []
    for _ in range(count):
        first = torch.randint(0, min(shape.vocab, 4096), (shape.batch, half), generator=generator)
        sequence = torch.cat([first, first], dim=1)[:, : shape.seq + 1]
        found.append((sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous()))
    return found


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def refusal(smoke: bool) -> str | None:
    """Why this machine cannot run the check (None: it can)."""
    if smoke:
        return None
    if not torch.cuda.is_available():
        return (
            "gpu_fp8.py: needs a CUDA GPU with compute capability 8.9+ (H100, H200, L40, "
            "B200); none here (--smoke runs a tiny emulated version on the CPU)"
        )
    capability = torch.cuda.get_device_capability()
    if capability < FP8_MIN_CAPABILITY:
        return (
            f"gpu_fp8.py: needs CUDA compute capability 8.9+ (H100, H200, L40, B200); "
            f"{torch.cuda.get_device_name()} has {capability[0]}.{capability[1]}"
        )
    return None


@dataclass
class Timed:
    """One policy's figures in this run."""

    name: str
    fp8_share: float  # of the Linear layers' parameters
    compile_and_warmup_s: float
    step_ms: float = math.nan
    val_loss: float = math.nan
    feasible: bool = False


class Runner:
    """One policy on its own copy of the model: compiled, trained step by step."""

    def __init__(self, name: str, policy: Any, shape: Shape, backend: Any, compile: bool):
        torch.manual_seed(0)  # the same initial weights for every policy
        self.name = name
        self.model = GPT(shape).to(backend.device)
        self.prec = policy.apply(self.model, backend)
        self.forward = torch.compile(self.model) if compile else self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
        self.data = itertools.cycle(
            [(x.to(backend.device), y.to(backend.device)) for x, y in batches(shape, 1, 8)]
        )
        self.backend = backend
        linear = {n: m for n, m in self.model.named_modules() if isinstance(m, nn.Linear)}
        total = sum(m.weight.numel() for m in linear.values())
        fp8 = sum(m.weight.numel() for m in linear.values() if type(m).__name__ == "Float8Linear")
        self.fp8_share = fp8 / total

    def step(self) -> None:
        x, y = next(self.data)
        with self.prec.autocast():
            loss = lm_loss(self.forward(x), y)
        self.prec.backward(loss)
        self.prec.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)

    def steps(self, count: int) -> float:
        """Seconds for ``count`` steps, the device synchronised at both ends."""
        self.backend.synchronize()
        started = time.perf_counter()
        for _ in range(count):
            self.step()
        self.backend.synchronize()
        return time.perf_counter() - started

    def val_loss(self, shape: Shape) -> float:
        """The mean loss over the validation batches, under the policy."""
        device = self.backend.device
        losses = []
        with torch.no_grad(), self.prec.autocast():
            for x, y in batches(shape, 10_000, VAL_BATCHES):
                losses.append(float(lm_loss(self.forward(x.to(device)), y.to(device))))
        return statistics.fmean(losses)


def searched_policy(args: argparse.Namespace, shape: Shape, backend: Any) -> Any:
    """The policy file given, else the best policy of a short guided autoprec search of
    the shipped fp8 space on this device (in a fresh folder: fresh stores)."""
    import autoprec

    if args.policy is not None:
        return autoprec.load_policy(args.policy)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _fresh import fresh_folder

    def train_data(seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return itertools.cycle(batches(shape, seed, POOL_BATCHES))

    task = autoprec.Task(
        "gpt2-small-synthetic",
        lambda: GPT(shape),
        train_data,
        lambda: batches(shape, 10_000, VAL_BATCHES),
        lm_loss,
    )
    started = time.perf_counter()
    with fresh_folder():
        result = autoprec.search(
            task,
            "fp8",
            trials=args.trials,
            steps=args.search_steps,
            device=backend,
            emulate=tuple(backend.emulated()),
            study="gpu-fp8",
            prefer="speed",
            compile=not args.smoke,  # the trials compiled, as the figures below are
        )
    best = result.summary["best"]
    print(
        f"search: {time.perf_counter() - started:.0f} s, {len(result.summary['trials'])} "
        f"trials x {args.search_steps} steps; best: trial {best['number']}"
    )
    return autoprec.Policy.from_dict(best["policy"])


def time_side_by_side(runners: list[Runner], rounds: int, block: int) -> dict[str, float]:
    """Each runner's median step time (ms) over ``rounds`` interleaved blocks of ``block``
    steps, the order rotated every round so that none always runs first."""
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    for round_ in range(rounds):
        order = runners[round_ % len(runners) :] + runners[: round_ % len(runners)]
        for runner in order:
            times[runner.name].append(runner.steps(block) / block * 1000)
    return {name: statistics.median(found) for name, found in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default=None, help="a policy YAML to time (else: search)")
    parser.add_argument("--trials", type=int, default=8, help="the search's trials")
    parser.add_argument("--search-steps", type=int, default=30, help="steps per search trial")
    parser.add_argument("--warmup", type=int, default=5, help="steps per policy, untimed")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timed blocks")
    parser.add_argument("--block", type=int, default=10, help="steps per timed block")
    parser.add_argument("--tolerance", type=float, default=0.02, help="relative val-loss slack")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_fp8.json")
    parser.add_argument("--smoke", action="store_true", help="tiny, emulated, on the CPU")
    args = parser.parse_args(argv)
    reason = refusal(args.smoke)
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2

    from autoprec import Policy
    from autoprec.devices import get_backend
    from autoprec.policy import Quantization

    shape = SMOKE if args.smoke else GPT2_SMALL
    backend = get_backend("cpu", emulate="fp8") if args.smoke else get_backend("cuda")
    compiled = not args.smoke
    print(
        f"{'smoke (emulated, not compiled)' if args.smoke else backend.name}: {shape}, "
        f"torch {torch.__version__}"
    )
    policies = {
        "bf16": Policy.uniform("bf16"),
        "fp8-tensorwise": Policy(default="fp8", quantization=Quantization(fp8="tensorwise")),
        "fp8-rowwise": Policy(default="fp8", quantization=Quantization(fp8="rowwise")),
        "searched": searched_policy(args, shape, backend),
    }
    runners, rows = [], {}
    for name, policy in policies.items():
        started = time.perf_counter()
        runner = Runner(name, policy, shape, backend, compiled)
        runner.steps(args.warmup)  # compiles on the first step
        runners.append(runner)
        rows[name] = Timed(name, runner.fp8_share, time.perf_counter() - started)
    for name, step_ms in time_side_by_side(runners, args.rounds, args.block).items():
        rows[name].step_ms = step_ms
    for runner in runners:
        rows[runner.name].val_loss = runner.val_loss(shape)
    bf16 = rows["bf16"]
    for row in rows.values():
        row.feasible = row.val_loss <= bf16.val_loss * (1 + args.tolerance)

    print(
        f"{'policy':<16} {'fp8 share':>9} {'compile+warm s':>14} {'step ms':>9} "
        f"{'vs bf16':>8} {'val loss':>9} feasible"
    )
    for row in rows.values():
        print(
            f"{row.name:<16} {row.fp8_share:>9.0%} {row.compile_and_warmup_s:>14.1f} "
            f"{row.step_ms:>9.2f} {bf16.step_ms / row.step_ms:>7.2f}x {row.val_loss:>9.4f} "
            f"{'yes' if row.feasible else 'no'}"
        )
    uniform = [rows[n] for n in ("fp8-tensorwise", "fp8-rowwise") if rows[n].feasible]
    searched = rows["searched"]
    if uniform:
        fastest = min(uniform, key=lambda row: row.step_ms)
        ratio = fastest.step_ms / searched.step_ms
        met = ratio >= TARGET_OF_UNIFORM
        target = (
            f"searched {ratio:.2f}x {fastest.name}'s speed (target: at least "
            f"{TARGET_OF_UNIFORM}x, uniform fp8 being feasible)"
        )
    else:
        met = searched.feasible
        target = "no uniform fp8 is feasible; the searched policy is " + (
            "feasible (target met)" if met else "infeasible too"
        )
    print(f"target: {'MET' if met else 'MISSED'}: {target}")
    print(f"torchao's published float8 training speed-ups over bf16 ({PUBLISHED_SOURCE}):")
    for where, recipe, speedup in PUBLISHED:
        here = bf16.step_ms / rows[f"fp8-{recipe}"].step_ms
        print(f"  {where}: {speedup:.2f}x (here, {recipe}: {here:.2f}x)")
    for m, k, n, speedup in PUBLISHED_LINEAR:
        print(f"  one Linear on an H100, M,K,N = {m},{k},{n}: {speedup:.2f}x")
    if args.smoke:
        print("smoke: emulated on the CPU, not compiled: these figures are no GPU's")
    if args.out:
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        figures = {
            "device": "smoke-cpu-emulated" if args.smoke else torch.cuda.get_device_name(),
            "shape": asdict(shape),
            "compiled": compiled,
            "rows": [asdict(row) for row in rows.values()],
            "target_met": met,
            "target": target,
            "searched_policy": policies["searched"].to_dict(),
        }
        (folder / "gpu_fp8.json").write_text(json.dumps(figures, indent=2))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
