"""A guarded run that checkpoints as a user's loop does, can kill itself with SIGKILL
part-way through a step, and can resume from its checkpoint in a new process.

zoo-norm-drift under uniform fp16: the guard promotes fc1 at its first check and, late in
the run, rolls back a forward that overflowed. Every ``EVERY`` batches drawn from the data
the loop saves ``{"model", "optimizer", "precision", "rng", "step"}`` (``step``: the
batches drawn, so that a resumed run recreates the data and skips them); a replayed batch
after a rollback is not a new one.

Usage: ``python tests/guard_resume_loop.py OUT_DIR STEPS [--kill-after N] [--resume]``.
At the end it writes ``OUT_DIR/final.pt`` (the model's state) and ``OUT_DIR/changes.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from autoprec import Guard, Policy
from autoprec.devices import get_backend
from autoprec.tasks.zoo import zoo_task
from autoprec.trials.training import draw_batch, train_step

TASK = "zoo-norm-drift"
EVERY = 300  # batches drawn between checkpoints
GUARD = Guard(check_every=50, snapshot_every=400)


def save(path: Path, state: dict[str, Any]) -> None:
    """Whole or not at all: a kill mid-write leaves the previous checkpoint."""
    temporary = path.with_suffix(".tmp")
    torch.save(state, temporary)
    os.replace(temporary, path)


def main(out_dir: Path, steps: int, kill_after: int | None, resume: bool) -> None:
    torch.set_num_threads(1)
    task = zoo_task(TASK)
    torch.manual_seed(0)
    model = task.model()
    model.train()
    prec = Policy.uniform("fp16").apply(model, guard=GUARD)
    optimizer = task.make_optimizer(model.parameters())
    backend = get_backend("cpu")
    checkpoint_path = out_dir / "checkpoint.pt"
    drawn_before = 0
    if resume:
        checkpoint = torch.load(checkpoint_path, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        prec.load_state_dict(checkpoint["precision"])
        torch.set_rng_state(checkpoint["rng"])
        drawn_before = checkpoint["step"]

    source = iter(task.train_data(0))
    for step in range(drawn_before):  # the batches the checkpointed run had drawn
        draw_batch(task, source, step, steps, backend)

    def batches() -> Iterator[tuple[int, Any]]:
        for step in range(drawn_before, steps):
            yield step, draw_batch(task, source, step, steps, backend)

    drawn_count = drawn_before
    for step, drawn in prec.guarded(batches()):
        fresh = step >= drawn_count  # not a replayed batch
        drawn_count = max(drawn_count, step + 1)
        if kill_after is not None and step == kill_after:
            with prec.autocast():
                drawn[0].run(model)
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step, long after the checkpoint
        train_step(task, model, optimizer, prec, drawn)
        if fresh and drawn_count % EVERY == 0:
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "precision": prec.state_dict(),
                "rng": torch.get_rng_state(),
                "step": drawn_count,
            }
            save(checkpoint_path, state)

    torch.save(model.state_dict(), out_dir / "final.pt")
    changes = [change.to_dict() for change in prec.changes]
    (out_dir / "changes.json").write_text(
        json.dumps({"changes": changes, "summary": prec.summary()})
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--kill-after", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    main(args.out_dir, args.steps, args.kill_after, args.resume)
