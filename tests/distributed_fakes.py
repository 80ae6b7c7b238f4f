"""A rank program for the launcher's tests, run by the real torchrun as
``python -m tests.distributed_fakes SPEC RESULT``: its ranks join a real gloo process
group, then behave as the spec's ``fake`` says, so that the launcher is tested against
torch's own agent with ranks that die, crash or hang on purpose.

- ``ok``: an all-reduce, then rank 0 writes a result (the sum shows both ranks took part);
- ``die``: rank ``fake_rank`` kills itself with SIGKILL while the others wait in a barrier;
- ``crash``: rank ``fake_rank`` raises RuntimeError while the others wait;
- ``hang``: rank ``fake_rank`` ignores SIGTERM and sleeps; the others wait in a barrier;
- ``silent``: every rank exits 0 and none writes a result;
- ``abort-at-exit``: as ``ok``, then rank ``fake_rank`` aborts (SIGABRT) once it has
  written ``done-<rank>``, as a C++ destructor's ``terminate`` at exit does.
Every rank writes its pid to ``pids/<rank>`` beside the result, so that a test can check
that none is left, ``ready-<rank>`` once the process group is up and ``done-<rank>`` once
it is destroyed, as the real ranks do.
Where ``$AUTOPREC_TEST_ABORT_DIR`` is set, rank 1 of the first launch that counts itself
there aborts (SIGABRT, as a C++ ``terminate`` does) before it joins the process group: a
launch that fails setting up.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

ABORT_DIR_ENV = "AUTOPREC_TEST_ABORT_DIR"  # where rank 1 counts launches (main's docstring)


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    result_path = Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    pids = result_path.parent / "pids"
    pids.mkdir(exist_ok=True)
    (pids / str(rank)).write_text(str(os.getpid()))  # before the slow imports
    aborts = os.environ.get(ABORT_DIR_ENV)
    if aborts and rank == 1:
        Path(aborts).mkdir(parents=True, exist_ok=True)
        (Path(aborts) / str(os.getpid())).touch()
        if len(list(Path(aborts).iterdir())) == 1:
            os.abort()
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_run)(spec, result_path, rank, world)


def _run(spec: dict, result_path: Path, rank: int, world: int) -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    (result_path.parent / f"ready-{rank}").touch()
    behaviour, chosen = spec.get("fake", "ok"), rank == spec.get("fake_rank", 1)
    if behaviour == "die" and chosen:
        time.sleep(float(spec.get("after_s", 0.5)))
        os.kill(os.getpid(), signal.SIGKILL)
    if behaviour == "crash" and chosen:
        raise RuntimeError(f"rank {rank} crashed on purpose")
    if behaviour == "hang" and chosen:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(1)
    if behaviour in ("die", "crash", "hang"):
        dist.barrier()  # waits for the chosen rank, which never comes
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    if rank == 0 and behaviour in ("ok", "abort-at-exit"):
        result = {
            "state": "complete",
            "accuracy": 0.5,
            "final_loss": 1.0,
            "step_time_ms": float(total.item()),  # 1 + 2 + ... + world
            "peak_memory_mb": 1.0,
            "steps_run": 3,
            "nproc": world,
            "parallel": spec.get("parallel"),
            "backend": dist.get_backend(),
        }
        result_path.write_text(json.dumps(result))
    dist.destroy_process_group()
    (result_path.parent / f"done-{rank}").touch()
    if behaviour == "abort-at-exit" and chosen:
        os.abort()
    return 0


if __name__ == "__main__":
    sys.exit(main())


# -- a real task whose rank 1 dies in one launch, for the search's tests ------------------

KILL_DIR_ENV = "AUTOPREC_TEST_KILL_DIR"  # where rank 1 counts its launches
KILL_AT_ENV = "AUTOPREC_TEST_KILL_AT"  # the launches (1: the baseline's) whose rank 1 dies


def killed_blocks() -> object:
    """tests/distributed_tasks.py's ``blocks``, whose rank 1 kills itself (SIGKILL) after
    two batches of the launches ``$AUTOPREC_TEST_KILL_AT`` names (``2`` or ``2,3``; counted
    in ``$AUTOPREC_TEST_KILL_DIR``, one file a launch): a rank that dies mid-trial.
    Loaded as ``tests.distributed_fakes:killed_blocks`` by the search and the ranks."""
    import dataclasses
    import importlib.util

    here = Path(__file__).with_name("distributed_tasks.py")
    loader = importlib.util.spec_from_file_location("_distributed_tasks", here)
    assert loader is not None and loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    task = module.blocks()
    inner = task.train_data

    def train_data(seed: int):  # type: ignore[no-untyped-def]
        if os.environ.get("RANK") != "1" or KILL_DIR_ENV not in os.environ:
            yield from inner(seed)
            return
        launches = Path(os.environ[KILL_DIR_ENV])
        launches.mkdir(parents=True, exist_ok=True)
        (launches / str(os.getpid())).touch()
        doomed_at = {int(n) for n in os.environ.get(KILL_AT_ENV, "2").split(",")}
        doomed = len(list(launches.iterdir())) in doomed_at
        for drawn, batch in enumerate(inner(seed)):
            if doomed and drawn == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            yield batch

    return dataclasses.replace(task, name="killed-blocks", train_data=train_data)


def refused_on_ranks() -> object:
    """``killed_blocks``'s task in the search's process; on a rank, a task autoprec
    refuses (a TaskError), as a task file that only loads where it was written would."""
    if "RANK" in os.environ:
        from autoprec.errors import TaskError

        raise TaskError("task refused on the ranks, on purpose")
    return killed_blocks()
