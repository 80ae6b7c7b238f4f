"""The guided and fallback strategies against synthetic oracles: pure and fast."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from autoprec.errors import SpaceError
from autoprec.profile.guided import FallbackStrategy, GuidedStrategy, Observation
from autoprec.space import SearchSpace

NAMES = list("abcdefgh")


def make_space(
    dtypes: tuple[str, ...] = ("fp32", "fp16"), names: list[str] = NAMES, **groups: list[str]
) -> SearchSpace:
    """A space of one group per name (never fitted to a model: patterns do not matter);
    ``groups`` overrides the dtypes of single groups."""
    return SearchSpace.from_dict(
        {
            "name": "synthetic",
            "dtypes": list(dtypes),
            "groups": [
                {"name": n, "patterns": [n], **({"dtypes": groups[n]} if n in groups else {})}
                for n in names
            ],
            "loss_scale": {"modes": ["none", "dynamic"], "init_scale_log2": [8, 24]},
        },
        "<synthetic>",
    )


Oracle = Callable[[Mapping[str, Any]], Observation]


def fragile(*needed: str, bf16_ok: bool = True) -> Oracle:
    """Infeasible (pruned) iff one of ``needed`` runs in fp16 (or in bf16 too, unless
    ``bf16_ok``); memory falls with every low-precision group."""

    def oracle(params: Mapping[str, Any]) -> Observation:
        dtypes = {k.removeprefix("dtype."): v for k, v in params.items() if k.startswith("dtype.")}
        bad = {"fp16"} if bf16_ok else {"fp16", "bf16"}
        if any(dtypes[n] in bad for n in needed):
            return Observation(dict(params), "pruned", False, {})
        memory = 100.0 - 10 * sum(d != "fp32" for d in dtypes.values())
        kept = sum(dtypes[n] == "fp32" for n in needed)
        metrics = {"accuracy": 0.9, "peak_memory_mb": memory, "step_time_ms": 10.0 + kept}
        return Observation(dict(params), "complete", True, metrics)

    return oracle


def run(strategy: Any, oracle: Oracle, limit: int = 100) -> list[tuple[dict[str, Any], str]]:
    """Propose and measure until the strategy is done; the proposals in order."""
    history: list[Observation] = []
    proposals = []
    while (proposal := strategy.propose(history)) is not None:
        proposals.append(proposal)
        history.append(oracle(proposal[0]))
        assert len(proposals) <= limit, "the strategy does not stop"
    return proposals


def dtypes_of(params: Mapping[str, Any]) -> dict[str, str]:
    return {k.removeprefix("dtype."): v for k, v in params.items() if k.startswith("dtype.")}


def kept_fp32(params: Mapping[str, Any]) -> set[str]:
    return {n for n, d in dtypes_of(params).items() if d == "fp32"}


def best_feasible(proposals: list[tuple[dict[str, Any], str]], oracle: Oracle) -> dict[str, Any]:
    measured = [oracle(p) for p, _ in proposals]
    return min(
        (o for o in measured if o.feasible), key=lambda o: o.metrics["peak_memory_mb"]
    ).params


def key(params: Mapping[str, Any]) -> str:
    return json.dumps(dict(params), sort_keys=True)


# -- bisection ------------------------------------------------------------------------


def test_bisection_finds_the_minimal_set_when_the_risk_order_is_right():
    space = make_space()
    oracle = fragile("a", "c")
    proposals = run(GuidedStrategy(space, ["c", "a", "h", "b", "d", "e", "f", "g"]), oracle)
    phases = [phase for _, phase in proposals]
    # seed (all fp16), k=1 (infeasible), k=2 (feasible), then one refine: drop c.
    assert phases == ["seed", "bisect", "bisect", "refine"]
    assert [kept_fp32(p) for p, _ in proposals] == [set(), {"c"}, {"a", "c"}, {"a"}]
    assert kept_fp32(best_feasible(proposals, oracle)) == {"a", "c"}


@pytest.mark.parametrize("seed", range(20))
def test_bisection_needs_about_log2_n_trials_whatever_the_order(seed):
    rng = random.Random(seed)
    names = [f"g{i}" for i in range(16)]
    space = make_space(names=names)
    needed = rng.sample(names, rng.randint(1, 4))
    order = names[:]
    rng.shuffle(order)
    proposals = run(GuidedStrategy(space, order), fragile(*needed))
    best = best_feasible(proposals, fragile(*needed))
    # The bisection's set is minimal along the order; refining drops what was not needed.
    assert kept_fp32(best) == set(needed)
    bisection = [p for p, phase in proposals if phase in ("seed", "bisect")]
    assert len(bisection) <= 1 + 2 * math.ceil(math.log2(16)) + 1
    position = max(order.index(n) for n in needed) + 1  # the prefix that holds them all
    assert len([p for p, phase in proposals if phase == "refine"]) == position - 1


def test_an_exact_risk_order_costs_about_log2_k_trials():
    names = [f"g{i}" for i in range(64)]
    space = make_space(names=names)
    oracle = fragile("g0")
    proposals = run(GuidedStrategy(space, names), oracle)
    assert [phase for _, phase in proposals] == ["seed", "bisect"]
    oracle = fragile("g0", "g1", "g2", "g3", "g4")
    proposals = run(GuidedStrategy(space, names), oracle)
    # 1, 2, 4 infeasible, 8 feasible, then 6, 5 by halving; then 4 refine trials.
    bisect = [len(kept_fp32(p)) for p, phase in proposals if phase == "bisect"]
    assert bisect == [1, 2, 4, 8, 6, 5]
    assert len(proposals) == 1 + 6 + 4


def test_a_feasible_seed_ends_the_guided_phases_for_that_dtype():
    space = make_space()
    proposals = run(GuidedStrategy(space, NAMES), fragile())
    assert [phase for _, phase in proposals] == ["seed"]


def test_all_groups_needed_is_found_without_proposing_all_fp32():
    space = make_space()
    oracle = fragile(*NAMES)
    proposals = run(GuidedStrategy(space, NAMES), oracle)
    assert all(kept_fp32(p) != set(NAMES) for p, _ in proposals)
    assert not any(oracle(p).feasible for p, _ in proposals)
    assert len(proposals) <= 1 + 2 * 3 + 1 + 7


# -- what is proposed -------------------------------------------------------------------


class Recorder:
    """A Suggester that answers from fixed params and records what was asked."""

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.params = params
        self.asked: list[str] = []

    def suggest_categorical(self, name: str, choices: Any) -> Any:
        self.asked.append(name)
        assert self.params[name] in choices
        return self.params[name]

    def suggest_int(self, name: str, low: int, high: int, *, log: bool = False) -> int:
        self.asked.append(name)
        assert low <= self.params[name] <= high
        return self.params[name]


def test_proposals_are_the_params_the_space_would_suggest():
    space = make_space(("fp32", "fp16", "bf16"))
    proposals = run(GuidedStrategy(space, NAMES), fragile("a", "c", bf16_ok=False))
    assert proposals[0][0] == space.uniform_params("fp16")  # the anchor's dynamic scaling
    assert proposals[1][0] == space.uniform_params("bf16")  # no loss-scale params
    for params, _ in proposals:
        recorder = Recorder(params)
        space.suggest(recorder)
        assert sorted(recorder.asked) == sorted(params)


def test_proposals_never_repeat_and_skip_what_history_holds():
    space = make_space(("fp32", "fp16", "bf16"))
    oracle = fragile("b", "e", "g")
    strategy = GuidedStrategy(space, ["e", "a", "b", "c", "g", "d", "f", "h"])
    proposals = run(strategy, oracle)
    assert len({key(p) for p, _ in proposals}) == len(proposals)
    # Anchors measured before (the same policies) are not proposed again.
    anchors = [oracle(params) for params in space.anchors().values()]
    again = []
    history = list(anchors)
    while (proposal := strategy.propose(history)) is not None:
        again.append(proposal)
        history.append(oracle(proposal[0]))
    assert {key(p) for p, _ in again}.isdisjoint(key(a.params) for a in anchors)
    assert len(again) == len(proposals) - 2  # both seeds were anchors


def test_history_order_does_not_matter():
    space = make_space(("fp32", "fp16", "bf16"))
    oracle = fragile("a", "d", "f")
    strategy = GuidedStrategy(space, ["d", "b", "a", "c", "e", "f", "g", "h"], prefer="memory")
    proposals = run(strategy, oracle)
    rng = random.Random(0)
    for end in range(len(proposals) + 1):
        history = [oracle(p) for p, _ in proposals[:end]]
        expected = strategy.propose(history)
        for _ in range(5):
            rng.shuffle(history)
            assert strategy.propose(history) == expected


def test_a_pending_proposal_is_skipped_for_the_next_useful_one():
    space = make_space()
    oracle = fragile("a", "c")
    strategy = GuidedStrategy(space, ["c", "h", "g", "a", "b", "d", "e", "f"])
    history = [oracle(space.uniform_params("fp16"))]
    first, phase = strategy.propose(history)
    assert phase == "bisect" and kept_fp32(first) == {"c"}
    # While k=1 runs elsewhere, a second worker probes what follows either outcome.
    second, _ = strategy.propose(history, pending=[first])
    assert key(second) != key(first)
    third, _ = strategy.propose(history, pending=[first, second])
    assert key(third) not in {key(first), key(second)}


def test_two_workers_sharing_a_history_find_the_same_set_without_duplicates():
    space = make_space()
    oracle = fragile("b", "f")
    strategy = GuidedStrategy(space, ["f", "a", "b", "c", "d", "e", "g", "h"])
    history: list[Observation] = []
    running: list[dict[str, Any]] = []
    proposed = []
    while True:
        while len(running) < 2 and (proposal := strategy.propose(history, running)) is not None:
            running.append(proposal[0])
            proposed.append(key(proposal[0]))
        if not running:
            break
        history.append(oracle(running.pop(0)))  # the oldest finishes first
    assert len(set(proposed)) == len(proposed)
    assert kept_fp32(best_feasible([(o.params, "") for o in history], oracle)) == {"b", "f"}


def test_none_when_done_and_for_a_space_with_nothing_to_search():
    space = make_space()
    oracle = fragile("a")
    strategy = GuidedStrategy(space, NAMES)
    history = [oracle(p) for p, _ in run(strategy, oracle)]
    assert strategy.propose(history) is None
    assert strategy.propose(list(reversed(history))) is None
    fixed = make_space(("fp32",), names=["a", "b"])
    assert GuidedStrategy(fixed, ["a", "b"]).propose([]) is None


def test_groups_with_a_single_dtype_are_left_as_they_are():
    space = make_space(c=["fp16"], e=["fp32"])
    proposals = run(GuidedStrategy(space, NAMES), fragile("a", "b"))
    assert all(dtypes_of(p)["c"] == "fp16" and dtypes_of(p)["e"] == "fp32" for p, _ in proposals)
    # c and e do not count as prefix positions: a, b are the first two searchable groups.
    assert [len(kept_fp32(p) - {"e"}) for p, ph in proposals if ph == "bisect"] == [1, 2]


def test_serving_groups_that_offer_only_int8_or_no_fp32_are_searched_without_error():
    space = make_space(("fp32", "fp16", "int8"), a=["int8"], b=["fp16", "int8"])
    proposals = run(GuidedStrategy(space, NAMES), fragile("c"))
    assert proposals and all(dtypes_of(p)["a"] == "int8" for p, _ in proposals)
    assert {dtypes_of(p)["b"] for p, _ in proposals} <= {"fp16", "int8"}


# -- low dtypes and refine --------------------------------------------------------------


def test_kept_groups_are_tried_in_bf16_where_the_space_has_it():
    space = make_space(("fp32", "fp16", "bf16"))
    oracle = fragile("a", "c")  # overflow in fp16 only: bf16 has fp32's range
    proposals = run(GuidedStrategy(space, ["c", "a", *"bdefgh"]), oracle)
    refine = [dtypes_of(p) for p, phase in proposals if phase == "refine"]
    assert {n: d for n, d in refine[-1].items() if d != "fp16"} == {"a": "bf16", "c": "bf16"}
    assert oracle(proposals[-1][0]).feasible


def test_bf16_swaps_one_group_at_a_time_when_all_together_fail():
    space = make_space(("fp32", "fp16", "bf16"))

    def oracle(params: Mapping[str, Any]) -> Observation:
        dtypes = dtypes_of(params)
        if dtypes["a"] != "fp32" or dtypes["c"] == "fp16":  # a needs fp32, c only range
            return Observation(dict(params), "pruned", False, {})
        return fragile()(params)

    proposals = run(GuidedStrategy(space, ["a", "c", *"bdefgh"]), oracle)
    best = dtypes_of(best_feasible(proposals, oracle))
    assert best["a"] == "fp32" and best["c"] == "bf16"


def test_the_dtype_whose_seed_does_better_for_the_preference_is_bisected_first():
    space = make_space(("fp32", "fp16", "bf16"))

    def oracle(params: Mapping[str, Any]) -> Observation:
        dtypes = set(dtypes_of(params).values())
        slow = 50.0 if "fp16" in dtypes else 10.0  # as on a CPU: fp16 far slower
        accurate = dtypes_of(params)["a"] == "fp32"
        metrics = {"accuracy": 0.9 if accurate else 0.5, "peak_memory_mb": 1.0 + slow / 100}
        return Observation(dict(params), "complete", accurate, {**metrics, "step_time_ms": slow})

    first_bisect = {}
    for prefer in ("speed", "memory"):
        proposals = run(GuidedStrategy(space, NAMES, prefer=prefer), oracle)
        bisect = next(p for p, phase in proposals if phase == "bisect")
        first_bisect[prefer] = set(dtypes_of(bisect).values()) - {"fp32"}
    assert first_bisect == {"speed": {"bf16"}, "memory": {"bf16"}}


def test_an_unknown_group_in_the_risk_order_is_an_error():
    with pytest.raises(SpaceError, match="zz"):
        GuidedStrategy(make_space(), ["a", "zz"])


def test_groups_missing_from_the_risk_order_count_as_least_risky():
    strategy = GuidedStrategy(make_space(), ["h", "b"])
    assert strategy.risk_order == ["h", "b", "a", "c", "d", "e", "f", "g"]


# -- fallback ---------------------------------------------------------------------------


def ranked_fragile(*needed: str) -> Oracle:
    """As `fragile`, with an accuracy that rises with each needed group kept in fp32."""
    base = fragile(*needed)

    def oracle(params: Mapping[str, Any]) -> Observation:
        observation = base(params)
        kept = sum(dtypes_of(params)[n] == "fp32" for n in needed)
        return Observation(
            observation.params,
            "complete",
            observation.feasible,
            {**observation.metrics, "accuracy": 0.5 + 0.1 * kept},
        )

    return oracle


def test_fallback_tries_each_group_alone_then_accumulates_by_accuracy():
    space = make_space()
    proposals = run(FallbackStrategy(space), ranked_fragile("c", "f"))
    phases = [phase for _, phase in proposals]
    assert phases == ["seed", *["single"] * 8, "accumulate"]
    assert [kept_fp32(p) for p, _ in proposals[1:9]] == [{n} for n in NAMES]  # model order
    assert kept_fp32(proposals[-1][0]) == {"c", "f"}  # the two best singles


def test_fallback_accumulates_until_feasible():
    space = make_space()
    oracle = ranked_fragile("a", "d", "g")
    proposals = run(FallbackStrategy(space), oracle)
    accumulated = [kept_fp32(p) for p, phase in proposals if phase == "accumulate"]
    # Singles tie at 0.6: model order decides, so a, d, g rank first.
    assert accumulated == [{"a", "d"}, {"a", "d", "g"}]
    assert oracle(proposals[-1][0]).feasible


def test_fallback_stops_at_the_first_feasible_single():
    space = make_space()
    proposals = run(FallbackStrategy(space), fragile("c"))
    assert [kept_fp32(p) for p, _ in proposals] == [set(), {"a"}, {"b"}, {"c"}]


def test_fallback_is_done_when_all_low_is_feasible():
    assert [ph for _, ph in run(FallbackStrategy(make_space()), fragile())] == ["seed"]


def test_fallback_with_pruned_singles_falls_back_in_model_order_and_never_repeats():
    space = make_space()
    oracle = fragile("b", "h")  # every single is pruned: no accuracy to rank them by
    proposals = run(FallbackStrategy(space), oracle)
    assert len({key(p) for p, _ in proposals}) == len(proposals)
    accumulated = [kept_fp32(p) for p, phase in proposals if phase == "accumulate"]
    assert accumulated == [set(NAMES[:k]) for k in range(2, 8)]
    assert not any(oracle(p).feasible for p, _ in proposals)  # only all-fp32 would do


def test_a_dtype_whose_uniform_seed_was_feasible_is_bisected_first():
    """fp16 and bf16 tie on memory; uniform fp16 was infeasible (a scaler's start-up, say),
    uniform bf16 feasible: the bisection goes to bf16, not through fp16 probes first."""
    space = make_space(("fp32", "fp16", "bf16"))
    strategy = GuidedStrategy(space, NAMES, prefer="memory")
    metrics = {"accuracy": 0.9, "peak_memory_mb": 50.0, "step_time_ms": 10.0}
    history = [
        Observation(space.uniform_params("bf16"), "complete", True, metrics),
        Observation(strategy._params(strategy._assign("fp16", set())), "complete", False, metrics),
    ]
    history.insert(
        0, Observation(strategy._params(strategy._assign("bf16", set())), "complete", True, metrics)
    )
    known = {strategy._key(o.params): _outcome(o) for o in history}
    assert strategy._dtype_order(known)[0] == "bf16"


def _outcome(observation: Observation):
    from autoprec.profile.guided import _Outcome

    return _Outcome(bool(observation.feasible), dict(observation.metrics))


@pytest.mark.parametrize(
    ("max_gradient", "expected"),
    [
        (None, None),  # no profile: the space's default start
        (1e-9, 16),  # tiny gradients: torch's 2**16 at most
        (1.0, 11),  # 65504 / 1 = 2**15.99: 2**15, less 2**4 of headroom
        (1e6, 8),  # huge gradients: the space's lowest start
    ],
)
def test_fp16_probes_start_their_scale_where_the_profiles_gradients_allow(max_gradient, expected):
    from autoprec.profile.guided import fp16_start_scale_log2

    space = make_space(("fp32", "fp16"))
    assert fp16_start_scale_log2(space, max_gradient) == expected
    strategy = GuidedStrategy(space, NAMES, max_gradient=max_gradient)
    seed = strategy._params(strategy._assign("fp16", set()))
    if expected is not None:
        assert seed["loss_scale.init_scale_log2"] == expected


# -- optimizer states -------------------------------------------------------------------


def state_space(names: list[str] = NAMES[:4]) -> SearchSpace:
    """Layers in fp32 only; optimizer states per group: fp32, bf16 or 8-bit."""
    return SearchSpace.from_dict(
        {
            "name": "states",
            "dtypes": ["fp32"],
            "groups": [{"name": "all", "patterns": ["*"]}],
            "optimizer_states": {
                "states": ["fp32", "bf16", "8bit"],
                "groups": [{"name": n, "patterns": [n]} for n in names],
            },
        },
        "<states>",
    )


def states_of(params: Mapping[str, Any]) -> dict[str, str]:
    return {k.removeprefix("state."): v for k, v in params.items() if k.startswith("state.")}


def fragile_states(*needed: str) -> Oracle:
    """Infeasible iff one of ``needed`` keeps 8-bit states; memory falls with each byte."""
    size = {"fp32": 8, "bf16": 4, "8bit": 2}

    def oracle(params: Mapping[str, Any]) -> Observation:
        states = states_of(params)
        if any(states[n] == "8bit" for n in needed):
            return Observation(dict(params), "pruned", False, {})
        memory = float(sum(size[s] for s in states.values()))
        metrics = {"accuracy": 0.9, "peak_memory_mb": memory, "step_time_ms": 10.0}
        return Observation(dict(params), "complete", True, metrics)

    return oracle


def losses(collapsed: dict[str, float], error: dict[str, float]) -> list[Any]:
    from autoprec.numerics.state_health import GroupStateLoss

    return [
        GroupStateLoss(n, "8bit", 4096, 4096, error.get(n, 0.01), collapsed.get(n, 0.0))
        for n in NAMES[:4]
    ]


def test_state_groups_are_ranked_by_collapse_then_relative_error():
    space = state_space()
    # c has the largest error but no collapse: a and b, whose second moments become zero
    # under a live first moment, rank before it, the larger share first.
    ranked = space.optimizer_states.risk_order(
        losses({"b": 0.01, "a": 0.001}, {"c": 0.3, "d": 0.2}), "8bit"
    )
    assert ranked == ["b", "a", "c", "d"]
    assert space.optimizer_states.risk_order([], "8bit") == ["a", "b", "c", "d"]


def test_the_group_whose_states_lose_most_is_kept_high_first_then_tried_in_bf16():
    space, oracle = state_space(), fragile_states("c")
    right = GuidedStrategy(space, [], prefer="memory", state_losses=losses({"c": 0.01}, {}))
    proposals = run(right, oracle)
    phases = [phase for _, phase in proposals]
    assert [states_of(p) for p, _ in proposals] == [
        dict.fromkeys("abcd", "8bit"),  # the seed
        {"a": "8bit", "b": "8bit", "c": "fp32", "d": "8bit"},  # c, ranked first, kept high
        {"a": "8bit", "b": "8bit", "c": "bf16", "d": "8bit"},  # and tried in bf16
    ]
    assert phases == ["seed", "bisect", "refine"]
    assert all(dtypes_of(p) == {"all": "fp32"} for p, _ in proposals)
    # Ranked last (no figures), c is found all the same, in more trials.
    blind = run(GuidedStrategy(space, [], prefer="memory"), oracle)
    assert len(blind) > len(proposals)
    assert states_of(best_feasible(blind, oracle)) == states_of(best_feasible(proposals, oracle))


def test_the_best_layers_and_the_best_states_are_then_tried_together():
    """Each lever is searched with the other at its highest; once both have a feasible
    answer, the search tries them at once ("combine"), which here weighs least. Of layers
    that weigh alike (fp16, bf16), the faster are combined."""
    space = SearchSpace.from_dict(
        {
            "name": "both",
            "dtypes": ["fp32", "fp16", "bf16"],
            "groups": [{"name": n, "patterns": [n]} for n in ("x", "y")],
            "optimizer_states": {
                "states": ["fp32", "8bit"],
                "groups": [{"name": n, "patterns": [n]} for n in ("a", "b")],
            },
        },
        "<both>",
    )
    layer_mb = {"fp32": 10.0, "fp16": 5.0, "bf16": 5.0}
    state_mb = {"fp32": 8.0, "8bit": 2.0}

    def oracle(params: Mapping[str, Any]) -> Observation:
        dtypes, states = dtypes_of(params), states_of(params)
        if dtypes["y"] != "fp32" or states["b"] == "8bit":  # y and b must stay high
            return Observation(dict(params), "pruned", False, {})
        memory = sum(layer_mb[d] for d in dtypes.values())
        memory += sum(state_mb[s] for s in states.values())
        step_ms = 50.0 if "fp16" in dtypes.values() else 10.0  # as on a CPU without fp16
        metrics = {"peak_memory_mb": memory, "step_time_ms": step_ms}
        return Observation(dict(params), "complete", True, metrics)

    proposals = run(GuidedStrategy(space, ["y", "x"], prefer="memory"), oracle)
    combined = [p for p, phase in proposals if phase == "combine"]
    assert [(dtypes_of(p), states_of(p)) for p in combined] == [
        ({"x": "bf16", "y": "fp32"}, {"a": "8bit", "b": "fp32"})
    ]
    best = best_feasible(proposals, oracle)
    assert (dtypes_of(best), states_of(best)) == (dtypes_of(combined[0]), states_of(combined[0]))
