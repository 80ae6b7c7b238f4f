"""Shared fixtures: a tiny task (tests/contract_tasks.py) and searches on it."""

from __future__ import annotations

import pytest

import autoprec
from tests.contract_tasks import make_tiny_task

__all__ = ["make_tiny_task"]


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
