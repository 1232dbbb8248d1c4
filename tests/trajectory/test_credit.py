from __future__ import annotations

import pytest

from relayrl.errors import InvalidRequest
from relayrl.trajectory import (
    CallTree,
    credit_rule,
    discounted_tree,
    outcome_broadcast,
    returns_to_go,
    returns_to_go_paths,
)


def _tree(edges: list[tuple[str, str | None]], rewards: dict[str, float | None],
          final: float | None = None) -> CallTree:
    return CallTree(order=tuple(n for n, _ in edges), parents=dict(edges),
                    rewards={n: rewards.get(n) for n, _ in edges}, final_reward=final)


# A branching tree, recorded with branches interleaved:
#        A
#      /   \
#     B     C (own 0.5, leaf)
#    / \
#   D   E (own 1.0, leaf)
#   |
#   F (own 2.0, leaf)
BRANCHED = [("A", None), ("B", "A"), ("C", "A"), ("D", "B"), ("E", "B"), ("F", "D")]
BRANCHED_REWARDS: dict[str, float | None] = {"C": 0.5, "E": 1.0, "F": 2.0}


def test_seed_chain_example_discounts_leaves_first() -> None:
    tree = _tree([("A", None), ("B", "A"), ("C", "B")], {"C": 1.0})
    got = discounted_tree(tree, 0.9)
    assert got == pytest.approx({"A": 0.81, "B": 0.9, "C": 1.0})


def test_discount_on_a_branching_tree_averages_children() -> None:
    g = 0.5
    got = discounted_tree(_tree(BRANCHED, BRANCHED_REWARDS), g)
    f, e, c = 2.0, 1.0, 0.5
    d = 0 + g * f                 # 1.0
    b = 0 + g * (d + e) / 2       # 0.5
    a = 0 + g * (b + c) / 2       # 0.25
    assert got == pytest.approx({"A": a, "B": b, "C": c, "D": d, "E": e, "F": f})


def test_discount_does_not_depend_on_recording_order_across_branches() -> None:
    interleaved = _tree(BRANCHED, BRANCHED_REWARDS)
    grouped = _tree([("A", None), ("C", "A"), ("B", "A"), ("E", "B"), ("D", "B"), ("F", "D")],
                    BRANCHED_REWARDS)
    assert discounted_tree(interleaved, 0.7) == pytest.approx(discounted_tree(grouped, 0.7))


def test_own_rewards_of_inner_calls_add_to_their_discounted_children() -> None:
    tree = _tree([("A", None), ("B", "A"), ("C", "B")], {"A": 0.1, "B": -0.2, "C": 1.0})
    got = discounted_tree(tree, 0.5)
    assert got["B"] == pytest.approx(-0.2 + 0.5 * 1.0)
    assert got["A"] == pytest.approx(0.1 + 0.5 * 0.3)


def test_final_reward_is_credited_at_every_leaf() -> None:
    tree = _tree(BRANCHED, {}, final=1.0)
    assert tree.leaves() == ("C", "E", "F")
    got = discounted_tree(tree, 1.0)
    assert got["C"] == got["E"] == got["F"] == 1.0
    assert got["A"] == pytest.approx(1.0)


def test_outcome_broadcast_gives_every_call_the_final_reward() -> None:
    got = outcome_broadcast(_tree(BRANCHED, BRANCHED_REWARDS, final=0.75))
    assert got == dict.fromkeys("ABCDEF", 0.75)


def test_outcome_without_final_reward_is_the_last_calls_reward() -> None:
    chain = _tree([("A", None), ("B", "A")], {"B": 0.4})
    assert outcome_broadcast(chain) == {"A": 0.4, "B": 0.4}
    assert outcome_broadcast(_tree([("A", None)], {})) == {"A": 0.0}


def test_returns_to_go_on_a_chain() -> None:
    tree = _tree([("A", None), ("B", "A"), ("C", "B")], {"A": 0.1, "C": 1.0})
    got = returns_to_go(tree, 0.5)
    assert got == pytest.approx({"A": 0.1 + 0.5 * (0 + 0.5 * 1.0), "B": 0.5, "C": 1.0})


def test_returns_to_go_per_path_and_averaged_over_paths_on_a_branching_tree() -> None:
    g = 0.5
    tree = _tree(BRANCHED, BRANCHED_REWARDS)
    paths = returns_to_go_paths(tree, g)
    assert set(paths) == {"C", "E", "F"}
    assert paths["F"] == pytest.approx({"F": 2.0, "D": 1.0, "B": 0.5, "A": 0.25})
    assert paths["E"] == pytest.approx({"E": 1.0, "B": 0.5, "A": 0.25})
    assert paths["C"] == pytest.approx({"C": 0.5, "A": 0.25})
    got = returns_to_go(tree, g)
    # A lies on three paths, B on two: means over paths (not over children as in discount)
    assert got["A"] == pytest.approx((0.25 + 0.25 + 0.25) / 3)
    assert got["B"] == pytest.approx(0.5)
    unbalanced = _tree(BRANCHED, {"C": 1.0, "E": 0.0, "F": 0.0})
    assert returns_to_go(unbalanced, 1.0)["A"] == pytest.approx(1 / 3)
    assert discounted_tree(unbalanced, 1.0)["A"] == pytest.approx(0.5)


def test_a_discount_outside_zero_one_is_refused() -> None:
    tree = _tree([("A", None)], {})
    for rule in (discounted_tree, returns_to_go):
        with pytest.raises(InvalidRequest):
            rule(tree, 1.5)


def test_tree_refuses_a_child_recorded_before_its_parent() -> None:
    with pytest.raises(ValueError, match="recorded after"):
        _tree([("B", "A"), ("A", None)], {})


def test_rules_are_found_by_name() -> None:
    assert credit_rule("discount") is discounted_tree
    assert credit_rule("outcome") is outcome_broadcast
    assert credit_rule("returns_to_go") is returns_to_go
    with pytest.raises(InvalidRequest):
        credit_rule("gae")
