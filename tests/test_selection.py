"""Choosing the best policy: Pareto front, preferences, ties within timing noise."""

from __future__ import annotations

from autoprec.selection import Candidate, pareto_front, select_best

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
