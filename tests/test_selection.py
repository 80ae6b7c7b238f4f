"""Choosing the best policy: Pareto front, preferences, ties within timing noise."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from autoprec.policy import Policy
from autoprec.selection import (
    HEADROOM_TIE_BITS,
    MEMORY_TIE,
    TIME_TIE,
    Candidate,
    pareto_front,
    select_best,
)

BASE = Candidate("baseline", 0.95, 100.0, 10.0, True)
FAST = Candidate(1, 0.95, 90.0, 6.0, True)
LIGHT = Candidate(2, 0.94, 50.0, 9.0, True)
BROKEN = Candidate(3, 0.50, 40.0, 5.0, False)  # fastest and lightest, but infeasible
DOMINATED = Candidate(4, 0.93, 95.0, 9.5, True)


def test_front_leaves_out_dominated():
    front = pareto_front([BASE, FAST, LIGHT, BROKEN, DOMINATED])
    assert DOMINATED not in front
    assert {c.key for c in front} == {1, 2, 3}  # BASE is dominated by FAST


def test_preferences_choose_among_feasible_only():
    pool = [BASE, FAST, LIGHT, BROKEN, DOMINATED]
    assert select_best(pool, "speed") == FAST
    assert select_best(pool, "memory") == LIGHT
    # balanced: FAST 0.6 + 0.9 = 1.5, LIGHT 0.9 + 0.5 = 1.4
    assert select_best(pool, "balanced", reference=BASE) == LIGHT
    assert select_best([BROKEN], "speed") is None


def test_speed_within_noise_is_a_tie_broken_by_memory():
    noisy = Candidate(5, 0.95, 120.0, 9.9, True)  # 1% faster than the baseline, heavier
    assert select_best([BASE, noisy], "speed") == BASE
    clearly = Candidate(6, 0.95, 120.0, 9.0, True)  # 10% faster
    assert select_best([BASE, clearly], "speed") == clearly


# -- one rule for ties, whatever the order (issue 27 item 5) --------------------------------


def _tied_pair(bf16_key=7, fp16_key=9):
    """The issue's case: uniform bf16 and uniform fp16 without loss scaling, both at
    0.05 MB, their step times within noise; bf16's headroom is fp32's, fp16's 13 bits."""
    bf16 = Candidate(bf16_key, 0.91, 0.05, 4.1, True, '{"default": "bf16"}', 127.8)
    fp16 = Candidate(fp16_key, 0.91, 0.05, 4.0, True, '{"default": "fp16"}', 13.0)
    return bf16, fp16


@pytest.mark.parametrize("prefer", ["memory", "speed", "balanced"])
def test_a_tie_goes_to_more_headroom_in_any_order(prefer):
    bf16, fp16 = _tied_pair()
    base = Candidate("baseline", 0.91, 0.10, 4.0, True, '{"default": "fp32"}', 127.9)
    if prefer == "memory":
        pools = [[bf16, fp16, base], [fp16, bf16, base], [base, fp16, bf16]]
        assert {select_best(p, prefer, base).identity for p in pools} == {bf16.identity}
    else:  # fp32 ties on time and has the headroom of bf16: the lighter bf16 wins
        pools = [list(p) for p in itertools.permutations([bf16, fp16, base])]
        assert {select_best(p, prefer, base).identity for p in pools} == {bf16.identity}


def test_trial_numbers_do_not_break_a_tie():
    """Two runs that measured the same policies in another order number them otherwise;
    with equal figures the policy's identity decides, not the number."""
    a = Candidate(1, 0.9, 50.0, 5.0, True, '{"default": "bf16"}', None)
    b = Candidate(2, 0.9, 50.0, 5.0, True, '{"default": "fp16"}', None)
    renumbered = [replace(a, key=2), replace(b, key=1)]
    for prefer in ("memory", "speed", "balanced"):
        assert select_best([a, b], prefer).identity == select_best(renumbered, prefer).identity


def _random_pool(rng: random.Random, size: int) -> list[Candidate]:
    """Candidates crowded around a few values, so that most stages see ties near their
    bounds (within and just past the tolerances)."""
    pool = []
    for i in range(size):
        memory = 50.0 * (1 + rng.choice([0, 0, 0.5, 1, 1.5, 3]) * MEMORY_TIE)
        time_ms = 5.0 * (1 + rng.choice([0, 0.5, 1, 1.2, 3]) * TIME_TIE)
        headroom = rng.choice([None, 13.0, 13.0 + HEADROOM_TIE_BITS * 0.9, 15.0, 127.0])
        accuracy = rng.choice([0.90, 0.90, 0.91])
        pool.append(
            Candidate(i, accuracy, memory, time_ms, rng.random() > 0.1, f"policy-{i}", headroom)
        )
    return pool


@pytest.mark.parametrize("prefer", ["speed", "memory", "balanced"])
def test_the_same_candidates_give_the_same_choice_in_any_order(prefer):
    """Many crowded pools, each shuffled many times: one choice per pool."""
    rng = random.Random(0)
    for _ in range(60):
        pool = _random_pool(rng, rng.randint(2, 9))
        base = Candidate("baseline", 0.91, 60.0, 5.0, True, "fp32", 127.9)
        first = select_best(pool, prefer, base)
        for _ in range(40):
            shuffled = rng.sample(pool, len(pool))
            chosen = select_best(shuffled, prefer, base)
            assert (chosen and chosen.identity) == (first and first.identity)


TIE_SPACE = """\
name: tie
accuracy_tolerance: 0.05
dtypes: [fp16, bf16]
groups:
  - {name: all, patterns: [fc1, head]}
loss_scale:
  modes: [none]
"""


@pytest.mark.slow
def test_a_real_search_chooses_the_same_in_any_order(tmp_path, monkeypatch):
    """A real search under --prefer memory: uniform fp16 and uniform bf16 use the same
    memory (CPU estimates count 2 bytes for both), so between them the tie rule decides:
    bf16, with the headroom. The records, shuffled and renumbered, give the same choice
    (between the two, and the search's own, which on a model this small may be fp32)."""
    import optuna

    import autoprec
    from autoprec.study._records import TrialRecord, record_of, result_of
    from autoprec.study._studies import finished
    from autoprec.study.summary import best_record, candidates
    from autoprec.trials.base import Feasibility
    from autoprec.trials.training import TrialResult
    from tests.contract_tasks import make_tiny_task

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tie.yaml").write_text(TIE_SPACE)
    result = autoprec.search(
        make_tiny_task(),
        tmp_path / "tie.yaml",
        trials=2,
        steps=12,
        device="cpu",
        prefer="memory",
        study="tie",
        sampler="random",
    )
    summary = result.typed
    trials = {e.number: e for e in summary.trials if e.feasible}
    assert {e.params["dtype.all"] for e in trials.values()} == {"fp16", "bf16"}
    assert len({e.peak_memory_mb for e in trials.values()}) == 1  # the tie

    study = optuna.load_study(study_name="tie", storage="sqlite:///runs/optuna.db")
    feasibility = Feasibility(summary.accuracy_tolerance)
    records = [record_of(t, feasibility, TrialResult) for t in finished(study)]
    baseline = TrialRecord(
        "baseline",
        Policy.from_dict(summary.baseline.policy),
        result_of(study.user_attrs["baseline"]["result"], TrialResult),
        0.0,
        True,
    )
    between = select_best(candidates(records), "memory")  # the two tied trials alone
    assert trials[between.key].params["dtype.all"] == "bf16"  # more headroom
    rng = random.Random(0)
    for _ in range(30):
        shuffled = rng.sample(records, len(records))
        numbers = rng.sample(range(100), len(records))
        renumbered = [replace(r, number=n) for r, n in zip(shuffled, numbers, strict=True)]
        assert best_record(renumbered, baseline, "memory").policy.to_dict() == summary.best.policy
        again = select_best(candidates(renumbered), "memory")
        assert again.identity == between.identity
