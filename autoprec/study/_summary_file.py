"""Reading a study's summary.json back (``autoprec report``, ``export``, ``compare``) as a
typed `Summary` (or, for an export, its `Header`).

The file sits in a runs folder anyone may have edited, truncated or replaced, so its
shape is checked before anything is drawn or exported from it: one line naming the
file and the field, instead of a KeyError half-way through writing a report.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoprec._util.files import read_text
from autoprec.errors import AutoprecError
from autoprec.errors import SummaryError as _Shape
from autoprec.study.summary_schema import SCHEMA_VERSION, Header, Summary
from autoprec.trials import MODES, canonical

MAX_SUMMARY_BYTES = 256 * 1024 * 1024  # a 10 000-trial study's summary is about 100 MB
STATES = ("complete", "pruned", "failed", "running", "interrupted")
NUMBER = (int, float)
NON_FINITE = ("nan", "inf", "-inf")  # strict JSON's spelling of them (summary_schema.finite)


def read_summary(path: Path, study: str) -> Summary:
    """summary.json of ``study`` at ``path``, checked (see `check_summary`), typed."""
    return Summary.from_json(_load(path, study, check_summary))


def read_header(path: Path, study: str) -> Header:
    """Only what an export reads of summary.json: the mode and the settings."""
    return Header.from_json(_load(path, study, _check_header))


def _load(path: Path, study: str, check: Callable[[Any], None]) -> dict[str, Any]:
    if not path.exists():
        raise AutoprecError(f"study {study!r}: no {path} (run autoprec search first)")
    text = read_text(path, AutoprecError, MAX_SUMMARY_BYTES)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise AutoprecError(f"{path}: not valid JSON (line {error.lineno})") from None
    except RecursionError:
        raise AutoprecError(f"{path}: nested too deeply to be a summary") from None
    try:
        check(data)
    except _Shape as error:
        raise AutoprecError(f"{path}: {error} (not a summary autoprec search wrote)") from None
    return data


def _check_header(data: Any) -> None:
    """The top level, the mode and the settings: what every reader of a summary reads."""
    expect(data, dict, "the top level")
    version = data.get("schema_version", 0)
    _check_count(version, "schema_version")
    if version > SCHEMA_VERSION:
        raise _Shape(
            f"schema_version: {version}, newer than this autoprec reads ({SCHEMA_VERSION}); "
            "upgrade autoprec"
        )
    mode = data.get("mode")
    if not isinstance(mode, str) or canonical(mode) not in MODES:
        raise _Shape(f"mode: expected {' or '.join(MODES)}, got {data.get('mode')!r}")
    expect(data.get("settings"), dict, "settings")
    for key in ("task_spec", "checkpoint", "int8", "device", "device_name", "tracking_uri"):
        expect(data["settings"].get(key), (str, type(None)), f"settings.{key}")


def check_summary(data: Any) -> None:
    """Raise with the first field of a summary that the report or an export would trip
    on: the top-level fields, every row (baseline, trials, best) and the settings."""
    _check_header(data)
    expect(data.get("study"), str, "study")
    mode = MODES[canonical(data["mode"])]
    dtypes, time_metric = mode.dtypes, mode.time_metric()
    expect(data.get("accuracy_tolerance"), NUMBER, "accuracy_tolerance")
    expect(data.get("prefer"), str, "prefer")
    expect(data.get("peak_memory_is_estimate", False), bool, "peak_memory_is_estimate")
    expect(data.get("advice", []), list, "advice")
    for i, line in enumerate(data.get("advice", [])):
        expect(line, str, f"advice[{i}]")
    expect(data.get("trials"), list, "trials")
    groups = _check_row(data.get("baseline"), "baseline", dtypes, time_metric, None)
    numbers = {"baseline"}
    for i, row in enumerate(data["trials"]):
        _check_row(row, f"trials[{i}]", dtypes, time_metric, groups)
        numbers.add(row["number"])
    _check_row(data.get("best"), "best", dtypes, time_metric, groups)
    if data["best"]["number"] not in numbers:
        raise _Shape(f"best.number: {data['best']['number']!r} is no trial of the summary")
    expect(data["best"].get("policy"), dict, "best.policy")
    if data["best"]["number"] != "baseline":
        for key in ("speedup_vs_fp32", "memory_saving_vs_fp32"):
            if not _finite(data["best"].get(key)) or data["best"]["speedup_vs_fp32"] <= 0:
                raise _Shape(f"best.{key}: expected a finite number")
    expect(data["best"].get("layers", []), list, "best.layers")
    for i, layer in enumerate(data["best"].get("layers", [])):
        expect(layer, dict, f"best.layers[{i}]")
        for key in ("name", "type", "dtype"):
            expect(layer.get(key), str, f"best.layers[{i}].{key}")
        expect(layer.get("params"), int, f"best.layers[{i}].params")
    part = mode.summary_part_class()
    if part is not None:  # the mode's own part (serving: the scenario, the best by batch)
        part.check(part.block_of(data))
    if data.get("confirmation") is not None:  # --confirm-steps
        _check_confirmation(data["confirmation"])


def _check_confirmation(block: Any) -> None:
    expect(block, dict, "confirmation")
    _check_count(block.get("steps"), "confirmation.steps")
    expect(block.get("checks", []), list, "confirmation.checks")
    for i, check in enumerate(block.get("checks", [])):
        where = f"confirmation.checks[{i}]"
        expect(check, dict, where)
        expect(check.get("key"), (str, int), f"{where}.key")
        expect(check.get("label"), str, f"{where}.label")
        expect(check.get("held"), bool, f"{where}.held")
        expect(check.get("state"), str, f"{where}.state")


def _check_row(
    row: Any, where: str, dtypes: tuple[str, ...], time_metric: str, groups: list[str] | None
) -> list[str]:
    """A result row's fields (a complete one has its mode's ``time_metric``); returns its
    dtype groups, which every other row must have."""
    expect(row, dict, where)
    expect(row.get("number"), (str, int), f"{where}.number")
    if row.get("state") not in STATES:
        raise _Shape(
            f"{where}.state: expected one of {', '.join(STATES)}, got {row.get('state')!r}"
        )
    expect(row.get("metrics"), dict, f"{where}.metrics")
    for name, value in row["metrics"].items():
        if value in NON_FINITE:  # what the writer makes of a NaN or infinite metric
            continue
        if value is not None and (isinstance(value, bool) or not isinstance(value, NUMBER)):
            raise _Shape(f"{where}.metrics.{name}: expected a number, got {value!r}")
    if row["state"] == "complete":
        for name in ("accuracy", "peak_memory_mb"):
            if not _finite(row["metrics"].get(name)):
                raise _Shape(f"{where}.metrics.{name}: a complete trial needs a finite number")
        if time_metric not in row["metrics"]:
            raise _Shape(f"{where}.metrics: a complete trial needs its time, {time_metric}")
    by_batch = row.get("latency_by_batch_ms", {})
    expect(by_batch, dict, f"{where}.latency_by_batch_ms")
    for size, latency in by_batch.items():
        if not str(size).isdigit() or not _finite(latency):
            raise _Shape(f"{where}.latency_by_batch_ms: expected batch sizes and latencies")
    for key in ("feasible", "pareto"):
        expect(row.get(key), bool, f"{where}.{key}")
    for key in ("anchor", "reason"):
        expect(row.get(key), (str, type(None)), f"{where}.{key}")
    expect(row.get("retries", []), list, f"{where}.retries")
    for retry in row.get("retries", []):
        expect(retry, str, f"{where}.retries")
    expect(row.get("policy", {}), (dict, type(None)), f"{where}.policy")
    expect(row.get("params"), dict, f"{where}.params")
    found = [k.removeprefix("dtype.") for k in row["params"] if str(k).startswith("dtype.")]
    for group in found:
        dtype = row["params"][f"dtype.{group}"]
        if not isinstance(dtype, str) or dtype not in dtypes:
            raise _Shape(f"{where}.params.dtype.{group}: expected one of {dtypes}, got {dtype!r}")
    if groups is not None and sorted(found) != sorted(groups):
        raise _Shape(f"{where}.params: other layer groups than the baseline's")
    return found


def _check_count(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _Shape(f"{where}: expected a whole number, got {value!r}")


def check_batch_size(size: Any, where: str) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise _Shape(f"{where}: expected a positive integer, got {size!r}")


def expect(value: Any, kinds: type | tuple[type, ...], where: str) -> None:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(_NAMES.get(k, k.__name__) for k in kinds)
        got = "nothing" if value is None else f"{type(value).__name__} {_short(value)}"
        raise _Shape(f"{where}: expected {names}, got {got}")


_NAMES = {
    dict: "a mapping",
    list: "a list",
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    type(None): "null",
}


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _finite(value: Any) -> bool:
    return isinstance(value, NUMBER) and not isinstance(value, bool) and math.isfinite(value)
