"""Shared fixtures: a tiny task (tests/contract_tasks.py) and searches on it.

Every test process, and every process a test starts, computes with one thread: the suite
runs its files on as many workers as the machine has cores (pyproject.toml's addopts,
pytest-xdist), and OpenMP threads that outnumber the cores spin and wait on each other,
which made a 3 s test take 114 s on a loaded 2-core machine. No test's assertion may depend
on the thread count (a search of a few steps whose choice moved with it sets its
tolerance above that noise); its time does, and one thread a process is the same
everywhere."""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch starts OpenMP here and in subprocesses

import pytest
import torch

torch.set_num_threads(1)  # where a plugin imported torch before this file

import autoprec  # noqa: E402
from tests.contract_tasks import make_tiny_task  # noqa: E402

__all__ = ["make_tiny_task"]

MAX_WORKERS = 4  # each worker holds torch, transformers and a few stores: about 1-2 GiB


# Files whose tests start torchrun's ranks: run one after another on one worker, never two
# gloo jobs at once on the machine's two cores (once, under the full suite's load, a rank
# of one aborted while the other file's search ran).
RANKS_GROUP = (
    "test_distributed_rank.py",
    "test_distributed_search.py",
    "test_guard_distributed.py",
)


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: a worker a core, up to MAX_WORKERS."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


# Files with tests of a minute or more (whole searches run as typed, a transformers model
# exported, long confirmations, the zoo's tasks): a test that shares no module-scoped
# fixture is a unit of its own, and the tests that share one are a unit together (so it is
# built once), so that the workers share such a file rather than one worker running it.
A_UNIT_A_TEST = (
    "test_readme_commands.py",
    "test_serving_search.py",
    "test_search_guard.py",
    "test_confirmation.py",
    "test_zoo.py",
)

# The files whose tests take minutes are handed out first, so that the other workers share
# the rest meanwhile and none waits at the end.
LONGEST_FIRST = A_UNIT_A_TEST


def _module_fixtures(item) -> list[str]:
    """The fixtures ``item`` uses that live longer than one test (session-scoped ones are
    built once a worker anyway)."""
    found = item._fixtureinfo.name2fixturedefs.items()
    return sorted(name for name, defs in found if defs[-1].scope in ("module", "package", "class"))


def _unit(item) -> str:
    """The xdist group ``item`` runs in: the ranks', its own, its module fixtures', or its
    file's."""
    name = item.path.name
    if name in RANKS_GROUP:
        return "ranks"
    if name not in A_UNIT_A_TEST:
        return name
    shared = _module_fixtures(item)
    return f"{name}::{'+'.join(shared)}" if shared else item.nodeid


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """A test file is one unit of work for xdist's ``--dist loadgroup`` (pyproject.toml's
    addopts), so that its module-scoped searches run once; the files of RANKS_GROUP are
    one unit together, a test of A_UNIT_A_TEST is one with the tests that share its
    module-scoped fixtures (alone without one), and the files of LONGEST_FIRST come first."""
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)  # stable: else as found
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_unit(item)))


@pytest.fixture
def tiny_task() -> autoprec.Task:
    return make_tiny_task()


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in an empty folder, so the default stores land under tmp_path/runs."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="session")
def finished(tmp_path_factory):
    """A small real search (5 trials) on sqlite stores in its own folder."""
    folder = tmp_path_factory.mktemp("search")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        result = autoprec.search(make_tiny_task(), trials=5, steps=12, study="tiny", device="cpu")
    return folder, result
