"""The guard's cost on a GPU: a GPT-2-small-shaped model (12 layers, 768 wide, 12 heads,
GPT-2's vocabulary) trained under a policy, guarded and unguarded, side by side.

    python benchmarks/gpu_guard.py [--device cuda] [--dtype bf16] [--steps 300] [--batch 8]

The two copies start from the same weights and train on the same random tokens in
alternating blocks of ``check_every`` steps, so that clock drift and noise hit both alike;
each block is timed with the device synchronised at its ends only (the guard adds no
sync on the steps it does not watch, and the timing must not add one either). It prints
the median step time of each, their ratio (the issue's target: at most 1.03 at the
default ``check_every``), the allocator's peak memory of each, and the host bytes of the
guard's snapshot.

Needs transformers (pip install -e '.[hf]'); the weights are random (nothing is
downloaded). ``--device cpu --small`` is a dry run of the script itself.

Never ran on a GPU: no accelerator was lent to the session that wrote it (2026-12-07).
Its CPU dry run ran; its figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import autoprec


def build(small: bool) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    if small:
        config = GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=4,
            vocab_size=512,
            n_positions=128,
            bos_token_id=0,
            eos_token_id=0,
        )
    else:
        config = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    return GPT2LMHeadModel(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--small", action="store_true", help="a 2-layer model: a dry run")
    args = parser.parse_args()
    device = torch.device(args.device)
    guard = autoprec.Guard()
    torch.manual_seed(0)
    first = build(args.small).to(device)
    second = build(args.small).to(device)
    second.load_state_dict(first.state_dict())
    policy = autoprec.Policy.uniform(args.dtype)
    runs = []
    for model, guarded in ((first, False), (second, True)):
        model.train()
        prec = policy.apply(model, device=device, guard=guard if guarded else False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runs.append((model, prec, optimizer, [], guarded))
    vocab = first.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    tokens = [
        torch.randint(0, vocab, (args.batch, args.seq), generator=generator)
        for _ in range(guard.check_every)
    ]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def block(run: tuple) -> None:
        model, prec, optimizer, times, _ = run
        sync()
        started = time.perf_counter()
        for ids in tokens:
            ids = ids.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with prec.autocast():
                out = model(input_ids=ids, labels=ids)
            prec.backward(out.loss.float())
            prec.step(optimizer)
        sync()
        times.append((time.perf_counter() - started) / len(tokens))

    blocks = max(2, args.steps // guard.check_every)
    block(runs[0])  # warm-up: kernels, allocator, the guard's first snapshot
    block(runs[1])
    for run in runs:
        run[3].clear()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(blocks):
        for run in runs:
            block(run)
    plain, guarded = (statistics.median(run[3]) * 1000 for run in runs)
    prec = runs[1][1]
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'})")
    print(
        f"model: {sum(p.numel() for p in first.parameters()) / 1e6:.1f}M parameters, "
        f"batch {args.batch}x{args.seq}, {args.dtype}, {blocks} blocks of {guard.check_every}"
    )
    print(f"step ms: unguarded {plain:.2f}, guarded {guarded:.2f}, ratio {guarded / plain:.3f}")
    if device.type == "cuda":
        print(
            "peak allocator memory (both copies): "
            f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
        )
    print(f"guard snapshot on the host: {prec.snapshot_bytes / 2**20:.0f} MiB")
    print(prec.summary())


if __name__ == "__main__":
    main()
