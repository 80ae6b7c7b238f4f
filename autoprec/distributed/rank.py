"""One rank of a trial across several devices: the program torchrun starts on each.

The interface between the launcher (`autoprec.distributed.launch`) and the ranks:

- **Command**: ``python -m torch.distributed.run --nproc-per-node N ... -m
  autoprec.distributed.rank SPEC_JSON_PATH RESULT_JSON_PATH``; torchrun sets ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``.
- **SPEC_JSON_PATH** holds one JSON object:

  - ``task``: the task spec string, as `autoprec.tasks.loading.load_task` takes it;
  - ``rank_trial`` (optional): what the rank runs to measure the policy, the mode's
    `Mode.rank_trial` (``"module:function"``, called with the spec once the process group
    is up, giving the result and the ranks' record); default `run_rank`, the training
    trial's, which the keys below describe;
  - ``policy``: the policy's dict form (`Policy.to_dict`);
  - ``budget``: the fields of `autoprec.trials.training.Budget` (``steps``,
    ``warmup_steps``, ``seed``);
  - ``parallel``: ``"ddp"`` or ``"fsdp2"``;
  - ``backend``: the process group's backend, ``"gloo"``, ``"nccl"`` or ``"hccl"``;
  - ``devices``: one device per local rank, ``["cpu", "cpu"]`` or ``["cuda:0",
    "cuda:1"]``; rank ``i`` of the host uses ``devices[LOCAL_RANK]``;
  - ``reduce_dtype`` (optional): ``"fp32"`` (default), ``"bf16"`` or ``"fp16"``, the
    dtype gradients are communicated in where the policy does not say (its
    ``reduce_dtype``, a searched setting, wins): FSDP2's ``reduce_dtype``, or under DDP
    torch's compression hook of that dtype (`autoprec.distributed.ddp`);
  - ``emulate`` (optional): the dtypes the backend may emulate (``["fp8"]``), as
    ``--emulate`` says;
  - ``timeout_s`` (optional, default 1800): the process group's collective timeout;
  - ``baseline`` (optional): the fp32 baseline's `TrialResult` as a dict, to stop a
    hopeless trial early against it (`EarlyStopping.from_baseline`), as
    ``TrainingTrials.judged_against`` does on one device.

- **RESULT_JSON_PATH**: rank 0 writes one JSON object, the `TrialResult` as a dict
  (``TrialResult.to_dict``: state, reason, losses, accuracy, ...), with the figures of all
  ranks combined: ``step_time_ms`` is the slowest rank's median step, ``peak_memory_mb``
  (and ``optimizer_state_mb``, where the policy names optimizer states) the largest
  rank's; and beside them ``nproc``, ``parallel``, ``backend``,
  ``reduce_dtype`` (the dtype gradients were communicated in), ``comm_hook`` (DDP's
  compression hook, or None) and ``ranks``, one record per rank (its device, step time, peak
  memory, final loss scale, and whether its layers ran in the dtypes the policy resolves
  for them, with the mismatches). The same record is in the result's
  ``telemetry["distributed"]``. `autoprec.distributed.launch.read_result` reads
  the file back.
- **Exit code**: 0 when the trial ran to a result on every rank, whatever that result
  (complete, pruned on a non-finite loss, failed by its metric). Non-zero when a rank
  raised or could not start: that rank writes a failed result with its reason to
  RESULT_JSON_PATH first where no rank has written one yet (with ``crashed_rank``,
  ``error``, the exception's type, and ``bad_input``, true where autoprec refused its
  input, an `AutoprecError`, which a single-device trial raises rather than records), so
  the launcher should read the file whenever it exists, and fail the trial as crashed
  where it does not.
- **Ready files**: once its process group is up (every rank has joined a barrier), each
  rank writes an empty ``ready-RANK`` beside RESULT_JSON_PATH (`READY_PREFIX`). A launch
  that failed before every rank wrote one failed setting up, before the policy ran.
  Once its process group is destroyed at the end, each rank writes ``done-RANK``
  (`DONE_PREFIX`): a launch whose every rank wrote one has its result, whatever
  happens to a process after that (an abort in a C++ destructor at exit).

Every rank runs the single-device trial's loop (`autoprec.trials.training`) with
`RankTraining`: the same losses, loss scaling, early stops and measurements, with the
model wrapped (DDP, or FSDP2 units from the policy's dtypes), the rank's slice of the data
(`autoprec.distributed.data`), losses averaged over the ranks and the loss scaler's
overflow decision all-reduced, so that every rank takes every decision alike.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autoprec._util.files import write_atomic
from autoprec.devices import get_backend
from autoprec.distributed.collectives import gather_records
from autoprec.distributed.fsdp import fsdp2_state_refusal
from autoprec.distributed.launch import AGENT_PID_ENV, DONE_PREFIX, READY_PREFIX
from autoprec.distributed.parallel import RankTraining
from autoprec.distributed.telemetry import reduce_telemetry
from autoprec.errors import AutoprecError, PolicyError, first_line
from autoprec.modes import load
from autoprec.policy import Policy
from autoprec.tasks.loading import load_task
from autoprec.trials.base import Result, TrialState
from autoprec.trials.training import Budget, EarlyStopping, TrialResult, train_and_evaluate

DEFAULT_TIMEOUT_S = 1800.0
PR_SET_PDEATHSIG = 1  # prctl(2)
MAX_LISTED_LEAVES = 64  # of the observed dtypes, per rank, in the result


def run_rank(spec: dict[str, Any]) -> tuple[TrialResult, dict[str, Any]]:
    """This rank's part of the trial ``spec`` describes (the process group initialised):
    the combined result (the same on every rank) and the distributed record."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    devices = spec["devices"]
    backend = get_backend(devices[local_rank], spec.get("emulate") or ())
    task = load_task(spec["task"])
    policy = Policy.from_dict(spec["policy"], "spec.policy")
    budget = Budget(**spec.get("budget", {}))
    stopping = (
        None
        if spec.get("baseline") is None
        else EarlyStopping.from_baseline(TrialResult.from_dict(spec["baseline"]))
    )
    reduce_dtype = policy.reduce_dtype or spec.get("reduce_dtype") or "fp32"
    if spec["parallel"] == "fsdp2":
        kinds = policy.optimizer_states.kinds()
        refusal = fsdp2_state_refusal(kinds, backend.device.type)
        if refusal is not None:
            raise PolicyError(refusal)
    ranks = RankTraining(spec["parallel"], backend.device, reduce_dtype)
    started = time.perf_counter()
    with backend.selected():
        result = train_and_evaluate(task, policy, backend, budget, stopping, ranks=ranks)
    ranks.stop_watching()
    result.run_time_s = time.perf_counter() - started
    mine = {
        "rank": dist.get_rank(),
        "device": str(backend.device),
        "state": str(result.state),
        "step_time_ms": result.step_time_ms,
        "peak_memory_mb": result.peak_memory_mb,
        "optimizer_state_mb": result.optimizer_state_mb,
        "accuracy": result.accuracy,
        "final_loss": result.final_loss,
        "loss_scale_final": result.loss_scales[-1] if result.loss_scales else None,
        "overflow_steps": result.overflow_steps,
        "grad_underflow_ratio": result.grad_underflow_ratio,
        "run_time_s": result.run_time_s,
        "dtypes_hold": not ranks.dtype_mismatches() and bool(ranks.observed_dtypes),
        "dtype_mismatches": ranks.dtype_mismatches()[:5],
        "observed_dtypes": dict(list(ranks.observed_dtypes.items())[:MAX_LISTED_LEAVES]),
    }
    records = gather_records(mine)
    telemetry = reduce_telemetry(gather_records(result.telemetry or {}), spec["parallel"])
    record = {
        "nproc": dist.get_world_size(),
        "parallel": spec["parallel"],
        "backend": dist.get_backend(),
        "reduce_dtype": reduce_dtype,
        "comm_hook": ranks.comm_hook,
        "ranks": records,
        "units": [asdict(unit) for unit in ranks.units],
    }
    return combine(result, records, record, telemetry), record


def combine(
    result: TrialResult,
    records: list[dict[str, Any]],
    record: dict[str, Any],
    telemetry: dict[str, Any] | None = None,
) -> TrialResult:
    """Rank 0's result with the figures of every rank: the slowest rank's median step, the
    largest rank's peak memory and optimizer state (under FSDP2 each rank holds its shard
    of it), the longest run, the telemetry of all ranks
    (`reduce_telemetry`; without it, the worst rank's underflow); a trial whose ranks
    disagree on how it ended failed (that is a bug of ours, not the policy's)."""
    times = [r["step_time_ms"] for r in records if r["step_time_ms"] is not None]
    memory = [r["peak_memory_mb"] for r in records if r["peak_memory_mb"] is not None]
    underflow = [
        r["grad_underflow_ratio"] for r in records if r["grad_underflow_ratio"] is not None
    ]
    state_mb = [r["optimizer_state_mb"] for r in records if r.get("optimizer_state_mb") is not None]
    result.step_time_ms = max(times) if times else None
    result.peak_memory_mb = max(memory) if memory else None
    result.optimizer_state_mb = max(state_mb) if state_mb else None
    result.grad_underflow_ratio = max(underflow) if underflow else None
    result.run_time_s = max(r["run_time_s"] for r in records)
    if telemetry:
        result.grad_underflow_ratio = telemetry["grad_underflow_ratio"]
    result.telemetry = {**(telemetry or result.telemetry or {}), "distributed": record}
    states = {r["state"] for r in records}
    scales = {r["loss_scale_final"] for r in records}
    if len(states) > 1 or len(scales) > 1:
        result.state = TrialState.FAILED
        result.reason = (
            f"the ranks disagree: states {sorted(states)}, loss scales {sorted(map(str, scales))}"
        )
        result.accuracy = None
    return result


def _write(path: Path, result: Result, record: dict[str, Any]) -> None:
    data = {**result.to_dict(), **record}
    write_atomic(path, json.dumps(data, default=str, allow_nan=True))


def main(argv: list[str] | None = None) -> int:
    """Run this rank; the exit code as the module's docstring says."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(
            "usage: python -m autoprec.distributed.rank SPEC_JSON_PATH RESULT_JSON_PATH",
            file=sys.stderr,
        )
        return 2
    spec_path, result_path = Path(args[0]), Path(args[1])
    _die_with_agent()
    rank = int(os.environ.get("RANK", "0"))
    try:
        spec = json.loads(spec_path.read_text())
        _init_process_group(spec)
        dist.barrier()  # every rank has joined: the launch is set up
        write_atomic(result_path.parent / f"{READY_PREFIX}{rank}", "")
        measure = load(spec["rank_trial"]) if spec.get("rank_trial") else run_rank
        result, record = measure(spec)
    except BaseException as error:  # a crashed rank: say why, where no rank has yet
        reason = f"rank {rank}: {type(error).__name__}: {first_line(error, 400)}"[:500]
        if not result_path.exists():
            failed = TrialResult(TrialState.FAILED, reason)
            crash = {
                "crashed_rank": rank,
                "error": type(error).__name__,
                "bad_input": isinstance(error, AutoprecError),  # autoprec's own refusal
            }
            _write(result_path, failed, crash)
        traceback.print_exc()
        return 1
    if rank == 0:
        _write(result_path, result, record)
    dist.barrier()
    dist.destroy_process_group()
    write_atomic(result_path.parent / f"{DONE_PREFIX}{rank}", "")
    return 0


def _die_with_agent() -> None:
    """This rank is killed when torchrun's agent that started it dies (Linux:
    PR_SET_PDEATHSIG), and ends at once where the agent is already gone: a search killed
    while its ranks ran leaves none behind."""
    agent = os.environ.get(AGENT_PID_ENV)
    if agent is None:  # started by hand, or by a plain torchrun
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if str(os.getppid()) != agent:
        os._exit(1)


def _init_process_group(spec: dict[str, Any]) -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(spec["devices"][local_rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "npu":  # torch_npu's device module (never run here)
        torch.npu.set_device(device)  # type: ignore[attr-defined]
    timeout = timedelta(seconds=float(spec.get("timeout_s", DEFAULT_TIMEOUT_S)))
    dist.init_process_group(spec["backend"], timeout=timeout)


if __name__ == "__main__":
    sys.exit(main())
