"""A trial's ranks (`autoprec.distributed.rank`) under DDP and FSDP2: the data split, the
FSDP2 units, the combined result; and, run by torchrun on 2 CPU ranks over gloo (slow:
each launch starts three Python processes), the equivalence of 2 DDP ranks with 1 rank,
a mixed bf16/fp32 policy under FSDP2, an overflow on one rank only, a crashed rank, and a
user's own loop with ``policy.apply`` under DDP and ``autoprec.apply_fsdp2``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autoprec
from autoprec.devices import get_backend
from autoprec.distributed.data import rank_train_data, shard, takes_rank
from autoprec.distributed.fsdp import ShardUnit, shard_units
from autoprec.distributed.launch import result_from_json
from autoprec.distributed.rank import combine
from autoprec.distributed.telemetry import reduce_telemetry
from autoprec.errors import TaskError
from autoprec.policy import Policy
from autoprec.tasks.loading import load_task
from autoprec.trials.base import TrialState
from autoprec.trials.training import Budget, TrialResult, run_trial
from tests.distributed_tasks import Net

ROOT = Path(__file__).resolve().parent.parent
TASKS = "tests/distributed_tasks.py"
BUDGET = {"steps": 6, "warmup_steps": 1, "seed": 0}
MIXED = {
    "default": "bf16",
    "rules": [
        {"patterns": ["blocks.1"], "dtype": "fp32"},
        {"patterns": ["head"], "dtype": "fp32"},
    ],
    "loss_scale": {"mode": "none"},
}


# -- the data contract -------------------------------------------------------------------


def test_shard_gives_each_rank_its_slice_of_the_global_batch():
    inputs, targets = torch.arange(12.0).reshape(6, 2), torch.arange(6)
    parts = [shard((inputs, targets), rank, 3) for rank in range(3)]
    assert torch.equal(torch.cat([p[0] for p in parts]), inputs)
    assert torch.equal(torch.cat([p[1] for p in parts]), targets)
    mapping = shard({"input_ids": inputs, "labels": targets}, 1, 2)
    assert torch.equal(mapping["labels"], targets[3:])


def test_shard_refuses_a_batch_that_does_not_split_evenly():
    with pytest.raises(TaskError, match="does not split into 4 equal parts"):
        shard((torch.zeros(6, 2), torch.zeros(6)), 0, 4)
    with pytest.raises(TaskError, match="differ in their first dimension"):
        shard((torch.zeros(4, 2), torch.zeros(2)), 0, 2)


def test_a_task_that_takes_the_rank_yields_its_own_batches():
    def own(seed, rank, world):
        yield (torch.full((2, 1), float(rank)), torch.zeros(2))

    def single(seed):
        yield (torch.arange(4.0).reshape(4, 1), torch.zeros(4))

    assert takes_rank(own) and not takes_rank(single)
    assert next(rank_train_data(own, 0, 1, 2))[0].tolist() == [[1.0], [1.0]]
    assert next(rank_train_data(single, 0, 1, 2))[0].tolist() == [[2.0], [3.0]]


# -- FSDP2 units -------------------------------------------------------------------------


def test_fsdp2_units_follow_blocks_and_cast_at_dtype_boundaries():
    model = Net()
    leaf_dtypes = Policy.from_dict(MIXED).plan(model, "cpu").leaf_dtypes
    assert leaf_dtypes == {
        "inp": "bf16",
        "blocks.0.fc": "bf16",
        "blocks.1.fc": "fp32",
        "head": "fp32",
    }
    assert shard_units(model, leaf_dtypes) == [
        # a bf16 block before an fp32 one hands on fp32 (the mat1/mat2 failure otherwise)
        ShardUnit("blocks.0", "bf16", "fp32"),
        ShardUnit("blocks.1", "fp32", "bf16"),  # into the bf16 root's head
        ShardUnit("head", "fp32", "bf16"),  # an fp32 layer in the bf16 root: a unit of its own
        ShardUnit("", "bf16", "fp32"),
    ]
    uniform = Policy.uniform("bf16").plan(model, "cpu").leaf_dtypes
    assert [u.output_dtype for u in shard_units(model, uniform)] == [None, None, "fp32"]


# -- the combined result -----------------------------------------------------------------


def _record(rank, step_ms, memory_mb, scale=1.0):
    return {
        "rank": rank,
        "state": "complete",
        "step_time_ms": step_ms,
        "peak_memory_mb": memory_mb,
        "grad_underflow_ratio": 0.0,
        "loss_scale_final": scale,
        "run_time_s": 1.0 + rank,
    }


def test_the_slowest_rank_and_the_largest_memory_are_the_trial_s(tmp_path):
    result = TrialResult(TrialState.COMPLETE, accuracy=0.5, step_time_ms=1.0)
    records = [_record(0, 3.0, 10.0), _record(1, 5.0, 7.0)]
    combined = combine(result, records, {"nproc": 2, "ranks": records})
    assert (combined.step_time_ms, combined.peak_memory_mb, combined.run_time_s) == (5.0, 10.0, 2.0)
    assert combined.telemetry["distributed"]["nproc"] == 2
    path = tmp_path / "result.json"
    path.write_text(json.dumps({**combined.to_dict(), "nproc": 2}))
    assert result_from_json(path, TrialResult) == combined


def test_ranks_that_disagree_on_the_loss_scale_fail_the_trial():
    result = TrialResult(TrialState.COMPLETE, accuracy=0.5)
    records = [_record(0, 3.0, 1.0, scale=128.0), _record(1, 3.0, 1.0, scale=256.0)]
    combined = combine(result, records, {"ranks": records})
    assert combined.state == TrialState.FAILED and "disagree" in combined.reason
    assert combined.accuracy is None


def test_telemetry_counts_shards_once_each_and_every_rank_s_activations():
    def report(flushed, act_max):
        layer = {
            "name": "fc",
            "grad_elements": 10,
            "grad_nonzero": 8,
            "grad_zero": 2,
            "grad_flushed": flushed,
            "grad_nonfinite": 0,
            "act_elements": 4,
            "act_nonfinite": 0,
            "act_at_fp16_max": 0,
            "act_overflow_origin": 0,
            "act_max_abs": act_max,
        }
        return {"observed_steps": 1, "layers": [layer], "warnings": [f"w{flushed}"]}

    reports = [report(0, 3.0), report(4, 5.0)]
    ddp, fsdp2 = reduce_telemetry(reports, "ddp"), reduce_telemetry(reports, "fsdp2")
    assert ddp["layers"][0]["grad_elements"] == 10  # the same all-reduced gradient
    assert fsdp2["layers"][0]["grad_elements"] == 20  # two shards
    assert fsdp2["grad_underflow_ratio"] == 4 / 16
    for reduced in (ddp, fsdp2):
        assert reduced["layers"][0]["act_elements"] == 8
        assert reduced["layers"][0]["act_max_abs"] == 5.0
        assert reduced["warnings"] == ["w0", "w4"]


# -- 2 ranks under torchrun (gloo, CPU) --------------------------------------------------


def _torchrun(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return subprocess.run(
        [*command, "--nproc-per-node", "2", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _trial(tmp_path: Path, **spec) -> tuple[subprocess.CompletedProcess, dict]:
    spec = {"budget": BUDGET, "backend": "gloo", "devices": ["cpu", "cpu"], **spec}
    spec_path, result_path = tmp_path / "spec.json", tmp_path / "result.json"
    spec_path.write_text(json.dumps(spec))
    done = _torchrun(tmp_path, "-m", "autoprec.distributed.rank", str(spec_path), str(result_path))
    data = json.loads(result_path.read_text()) if result_path.exists() else {}
    return done, data


def _elements(telemetry: dict, kind: str) -> dict[str, int]:
    return {layer["name"]: layer[f"{kind}_elements"] for layer in telemetry["layers"]}


def _telemetry_covers_the_whole_model_and_batch(data: dict) -> None:
    """Gradients counted once over the whole of each layer's parameters, activations over
    the whole global batch, as on one device."""
    telemetry, modules = data["telemetry"], dict(Net().named_modules())
    linears = {name for name, module in modules.items() if isinstance(module, torch.nn.Linear)}
    steps, observed = telemetry["gradient_steps"], telemetry["observed_steps"]
    assert steps >= 1 and linears <= set(_elements(telemetry, "grad"))
    for name, elements in _elements(telemetry, "grad").items():
        assert elements == steps * sum(p.numel() for p in modules[name].parameters(recurse=False))
    for name in linears:
        width = modules[name].out_features
        assert _elements(telemetry, "act")[name] == 8 * observed * width


def _finite_from_both_ranks(data: dict) -> None:
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    for record in data["ranks"]:
        assert math.isfinite(record["step_time_ms"]) and record["step_time_ms"] > 0
        assert math.isfinite(record["peak_memory_mb"]) and record["peak_memory_mb"] > 0
        assert record["dtypes_hold"], record["dtype_mismatches"]
    assert data["step_time_ms"] == max(r["step_time_ms"] for r in data["ranks"])
    assert data["peak_memory_mb"] == max(r["peak_memory_mb"] for r in data["ranks"])


@pytest.mark.slow
def test_two_ddp_ranks_train_as_one_rank_on_the_same_global_batch(tmp_path):
    policy = Policy.uniform("fp32")
    one = run_trial(load_task(f"{TASKS}:blocks"), policy, get_backend("cpu"), Budget(**BUDGET))
    spec = {"policy": policy.to_dict(), "parallel": "ddp", "baseline": one.to_dict()}
    done, data = _trial(tmp_path, task=f"{TASKS}:blocks", **spec)  # judged against itself
    assert done.returncode == 0, done.stderr[-3000:]
    result = result_from_json(tmp_path / "result.json", TrialResult)
    assert result.state == TrialState.COMPLETE
    assert result.losses == pytest.approx(one.losses, rel=1e-5)
    assert result.accuracy == pytest.approx(one.accuracy)
    assert (data["nproc"], data["parallel"], data["backend"]) == (2, "ddp", "gloo")
    assert result.telemetry["distributed"]["nproc"] == 2
    assert _elements(result.telemetry, "act") == _elements(one.telemetry, "act")
    assert _elements(result.telemetry, "grad") == _elements(one.telemetry, "grad")
    _telemetry_covers_the_whole_model_and_batch(data)
    _finite_from_both_ranks(data)


@pytest.mark.slow
def test_a_mixed_policy_trains_under_fsdp2_in_its_dtypes_on_every_rank(tmp_path):
    policy = {**MIXED, "reduce_dtype": "bf16"}  # the policy's, over the spec's fp32
    done, data = _trial(
        tmp_path, task=f"{TASKS}:blocks", policy=policy, parallel="fsdp2", reduce_dtype="fp32"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert data["state"] == "complete", data["reason"]
    assert data["reduce_dtype"] == "bf16"
    assert {"name": "blocks.0", "param_dtype": "bf16", "output_dtype": "fp32"} in data["units"]
    for record in data["ranks"]:  # forward hooks on each rank's first training step
        assert record["observed_dtypes"] == {
            "inp": "bf16",
            "blocks.0.fc": "bf16",
            "blocks.1.fc": "fp32",
            "head": "fp32",
        }
    assert 0 < data["low_precision_share"] < 1
    _telemetry_covers_the_whole_model_and_batch(data)  # the shards' counts add up
    _finite_from_both_ranks(data)


@pytest.mark.slow
def test_an_overflow_on_one_rank_skips_the_step_on_both(tmp_path):
    policy = {"default": "fp32", "loss_scale": {"mode": "dynamic", "init_scale": 256.0}}
    done, data = _trial(tmp_path, task=f"{TASKS}:poisoned", policy=policy, parallel="fsdp2")
    assert done.returncode == 0, done.stderr[-3000:]
    # Rank 1 puts an inf in a row of the gradient that rank 0's shard holds: only rank 0
    # finds it locally, and both must skip that step and back off alike.
    assert data["state"] == "complete", data["reason"]
    assert [r["overflow_steps"] for r in data["ranks"]] == [1, 1]
    assert [r["loss_scale_final"] for r in data["ranks"]] == [128.0, 128.0]
    assert data["loss_scales"].count(256.0) == 3  # the inf came on the third step


@pytest.mark.slow
def test_a_crashed_rank_exits_non_zero_with_a_failed_result(tmp_path):
    policy = Policy.uniform("fp32").to_dict()
    done, data = _trial(tmp_path, task=f"{TASKS}:no_such_task", policy=policy, parallel="ddp")
    assert done.returncode != 0
    assert data["bad_input"] and data["error"] == "TaskError"
    result = result_from_json(tmp_path / "result.json", TrialResult)
    assert result.state == TrialState.FAILED and "no_such_task" in result.reason


@pytest.mark.slow
def test_a_user_loop_applies_the_policy_under_ddp_and_fsdp2(tmp_path):
    done = _torchrun(tmp_path, "tests/distributed_loop.py", str(tmp_path))
    if done.returncode != 0:
        # gloo's threads can abort a process at exit after its group was destroyed
        # ("terminate called without an active exception"), as autoprec's own launch
        # tolerates (`autoprec.distributed.launch`): only after every rank finished.
        finished = all((tmp_path / f"done{r}").exists() for r in (0, 1))
        assert finished and "terminate called without an active exception" in done.stderr, (
            done.stderr[-3000:]
        )
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for report in reports:
        for mode in ("ddp", "fsdp2"):
            assert report[mode]["seen"] == report[mode]["resolved"]
            assert set(report[mode]["seen"].values()) == {"bf16", "fp32"}
            assert all(math.isfinite(v) for v in report[mode]["losses"])
        assert report["fsdp2"]["sharded"]
        assert math.isfinite(report["bare"]["loss"])  # FSDP2's casts alone at the boundary
        assert "mat1 and mat2 must have the same dtype" in report["bare"]["naive_failure"]
    # DDP and FSDP2 train the same model on the same batches alike
    assert reports[0]["ddp"]["losses"] == pytest.approx(reports[0]["fsdp2"]["losses"], rel=1e-2)


def test_the_public_names_are_the_distributed_ones():
    assert autoprec.shard is shard
    from autoprec.distributed.fsdp import apply_fsdp2

    assert autoprec.apply_fsdp2 is apply_fsdp2


# -- the reduce dtype, a searched setting ------------------------------------------------


def test_a_policy_carries_its_reduce_dtype_and_is_measured_apart_by_it():
    plain = Policy.from_dict(MIXED)
    reduced = Policy.from_dict({**MIXED, "reduce_dtype": "bf16"})
    assert "reduce_dtype" not in plain.to_dict()  # other policies read and hash as before
    assert Policy.from_yaml(reduced.to_yaml()) == reduced
    assert reduced.identity() != plain.identity()
    fp16 = Policy.from_dict({**MIXED, "reduce_dtype": "fp16"})  # DDP's fp16 hook
    assert Policy.from_yaml(fp16.to_yaml()) == fp16 and fp16.identity() != reduced.identity()
    with pytest.raises(
        autoprec.PolicyError, match="reduce_dtype: expected one of fp32, bf16, fp16, got 'fp8'"
    ):
        Policy.from_dict({**MIXED, "reduce_dtype": "fp8"})


def test_a_space_for_fsdp2_searches_the_reduce_dtype():
    import dataclasses

    import optuna

    from autoprec.space import load_space

    space = load_space("default").fit(Net())
    params = {f"dtype.{g.name}": "fp32" for g in space.groups}
    assert "fsdp.reduce_dtype" not in space.flat_params(space.policy(params))
    assert space.policy(params).reduce_dtype is None
    fsdp = dataclasses.replace(space, reduce_dtypes=("fp32", "bf16"))
    policy = fsdp.suggest(optuna.trial.FixedTrial({**params, "fsdp.reduce_dtype": "bf16"}))
    assert policy.reduce_dtype == "bf16"
    assert fsdp.flat_params(policy)["fsdp.reduce_dtype"] == "bf16"
    assert fsdp.policy(params).reduce_dtype == "fp32"  # the anchors reduce in fp32
    assert fsdp.fingerprint() != space.fingerprint()


def test_a_space_for_ddp_searches_its_compression_hook_as_its_own_parameter():
    import dataclasses

    import optuna

    from autoprec.space import DDP_REDUCE_PARAM, load_space

    space = load_space("default").fit(Net())
    params = {f"dtype.{g.name}": "fp32" for g in space.groups}
    fsdp = dataclasses.replace(space, reduce_dtypes=("fp32", "fp16"))
    ddp = dataclasses.replace(fsdp, reduce_param=DDP_REDUCE_PARAM)
    policy = ddp.suggest(optuna.trial.FixedTrial({**params, "ddp.reduce_dtype": "fp16"}))
    assert policy.reduce_dtype == "fp16"
    flat = ddp.flat_params(policy)
    assert flat["ddp.reduce_dtype"] == "fp16" and "fsdp.reduce_dtype" not in flat
    assert ddp.policy(params).reduce_dtype == "fp32"  # the anchors communicate in fp32
    assert len({space.fingerprint(), fsdp.fingerprint(), ddp.fingerprint()}) == 3


def test_ddp_communicates_in_the_dtypes_torch_has_a_hook_for_here():
    from autoprec.distributed.ddp import (
        bf16_hook_supported,
        check_ddp_reduce_dtype,
        ddp_reduce_dtypes,
    )

    for dtype in ("fp32", "fp16"):
        check_ddp_reduce_dtype(dtype)
    if bf16_hook_supported():  # a CUDA build with NCCL 2.10+ (never run here)
        assert ddp_reduce_dtypes() == ("fp32", "bf16", "fp16")
        return
    assert ddp_reduce_dtypes() == ("fp32", "fp16")  # the CPU wheel: torch refuses bf16's hook
    with pytest.raises(autoprec.PolicyError) as refused:
        check_ddp_reduce_dtype("bf16")
    message = str(refused.value)
    assert message.startswith("reduce_dtype bf16 under DDP: torch registers bf16_compress_hook")
    assert "\n" not in message


def test_fsdp2_refuses_only_the_optimizer_states_that_fail_under_it_on_the_cpu():
    from autoprec.distributed.fsdp import fsdp2_state_refusal

    for kinds in ({"fp32"}, {"8bit", "fp8"}, {"bf16", "fp8-bf16"}):
        assert fsdp2_state_refusal(kinds, "cpu") is None
    refusal = fsdp2_state_refusal({"fp32", "4bit"}, "cpu")
    assert refusal is not None and "4bit under --parallel fsdp2" in refusal
    assert fsdp2_state_refusal({"4bit"}, "cuda") is None  # not known to fail there


def test_the_public_comm_hook_is_the_distributed_one():
    from autoprec.distributed.ddp import register_comm_hook

    assert autoprec.register_comm_hook is register_comm_hook


# -- launched: the gradient communication dtype and per-group optimizer states -----------


@pytest.mark.slow
def test_the_policys_hook_gives_the_gradients_of_torchs_own_hook(tmp_path):
    from autoprec.distributed.ddp import bf16_hook_supported

    done = _torchrun(tmp_path, "tests/distributed_comm.py", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["hooks"] == {"fp16": "fp16_compress_hook", "fp32": None, "none": None}
        assert report["equal_to_torch_hook"] == [True, True, True]  # bit for bit, each step
        assert all(diff > 0 for diff in report["max_abs_diff_to_fp32"])  # the hook ran
        assert report["grads_dtype"] == "torch.float32"  # decompressed, as torch's does
        if not bf16_hook_supported():
            assert report["bf16"].startswith("reduce_dtype bf16 under DDP:")


@pytest.mark.slow
def test_a_ddp_trial_communicates_its_gradients_in_the_policys_dtype(tmp_path):
    policy = {**MIXED, "reduce_dtype": "fp16"}
    done, data = _trial(tmp_path, task=f"{TASKS}:blocks", policy=policy, parallel="ddp")
    assert done.returncode == 0, done.stderr[-3000:]
    assert data["state"] == "complete", data["reason"]
    assert (data["reduce_dtype"], data["comm_hook"]) == ("fp16", "fp16_compress_hook")
    assert data["telemetry"]["distributed"]["comm_hook"] == "fp16_compress_hook"
    _finite_from_both_ranks(data)


def _adam_state_bytes(elements: int, quantised: bool) -> int:
    """One parameter's Adam state as stored: a step tensor (4 bytes) and two moments, in
    fp32 or as torchao's 8-bit state (uint8 codes, an fp32 scale per block of 256 and its
    own 256-entry fp32 code map)."""
    moment = elements + elements // 256 * 4 + 256 * 4 if quantised else elements * 4
    return 4 + 2 * moment


@pytest.mark.slow
def test_an_fsdp2_trial_builds_the_policys_per_group_optimizer_and_counts_its_shard(tmp_path):
    # torchao compiles its 8-bit step on each rank (tens of seconds on a loaded machine).
    optimizer = {"state": "fp32", "groups": [{"patterns": ["blocks"], "state": "8bit"}]}
    policy = {"default": "fp32", "loss_scale": {"mode": "none"}, "optimizer": optimizer}
    done, data = _trial(tmp_path, task=f"{TASKS}:wide", policy=policy, parallel="fsdp2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert data["state"] == "complete", data["reason"]
    # Each rank holds half of every parameter's rows: the blocks' 128x128 weights keep
    # 8-bit states over their 64x128 shards, the rest (and the blocks' biases, under
    # torchao's 4,096 elements) fp32 states.
    shards = {"inp.weight": 64 * 8, "inp.bias": 64, "head.weight": 2 * 128, "head.bias": 2}
    expected = sum(_adam_state_bytes(n, False) for n in shards.values())
    expected += 2 * (_adam_state_bytes(64 * 128, True) + _adam_state_bytes(64, False))
    assert expected == 45104
    for record in data["ranks"]:
        assert record["optimizer_state_mb"] * 2**20 == expected
    assert data["optimizer_state_mb"] * 2**20 == expected
    assert data["telemetry"]["memory_split_mb"]["optimizer_state"] * 2**20 == expected
    _finite_from_both_ranks(data)
