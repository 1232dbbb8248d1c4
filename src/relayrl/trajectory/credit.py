"""Credit assignment: pure functions from a session's call tree and its rewards to one number
per call.

A `CallTree` is a snapshot (ids, parent links, own rewards, the trajectory's final reward), so
the rules never touch a live session and cannot leak state between exports. Every rule walks the
tree leaves first (children finished before parents), so a branch never borrows credit from a
sibling branch; recording order is used only because it is already a topological order (a call
is recorded after its parent).

Tradeoff: a rule returns one value per call. Returns-to-go are path quantities; where a call
lies on several root-to-leaf paths (a branched tree) its value is the mean over those paths,
and `returns_to_go_paths` gives the per-path detail.

Own rewards: a call's own reward is what `set_reward` gave it (None counts as 0), plus the final
reward when the call is a leaf (no children): the final reward is the episode's outcome, and
every path of the tree ends in a leaf, so each path is credited with it.

`CreditRule` names the built-in rules (the one list the gateway, clients and configs check
against); a new rule is a function of the `CreditFn` shape added here and to `credit_rule`.

May import: `relayrl.errors` only (pure Python; no torch, no I/O).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from relayrl.errors import InvalidRequest


@dataclass(frozen=True)
class CallTree:
    """A snapshot of a session's calls for credit assignment (a forest: several roots allowed)."""

    order: tuple[str, ...]
    """Call ids in recording order; each call comes after its parent."""
    parents: Mapping[str, str | None]
    rewards: Mapping[str, float | None]
    """Own reward of each call (None = not given)."""
    final_reward: float | None = None
    """The trajectory-level reward (`Session.set_final_reward`), if any."""
    children: Mapping[str, tuple[str, ...]] = field(init=False, repr=False, compare=False)
    roles: Mapping[str, str] = field(default_factory=dict)
    """Role of each call that has one (`relayrl.trajectory.roles`); absent: no role."""
    role_rewards: Mapping[str, float] = field(default_factory=dict)
    """Final rewards given to single roles; a role without one gets `final_reward`."""

    def __post_init__(self) -> None:
        kids: dict[str, list[str]] = {}
        for n in self.order:
            p = self.parents.get(n)
            if p is not None and p not in kids:  # kids holds exactly the calls seen so far
                raise ValueError(f"call {n}: parent {p} is unknown or recorded after it")
            if n in kids:
                raise ValueError(f"call {n} appears twice")
            kids[n] = []
            if p is not None:
                kids[p].append(n)
        object.__setattr__(self, "children", {n: tuple(c) for n, c in kids.items()})

    def leaves(self) -> tuple[str, ...]:
        """Calls with no children, in recording order."""
        return tuple(n for n in self.order if not self.children[n])

    def own_reward(self, call_id: str) -> float:
        """Reward given to this call (None -> 0), plus the final reward if it is a leaf."""
        own = self.rewards.get(call_id)
        value = 0.0 if own is None else float(own)
        if self.final_reward is not None and not self.children[call_id]:
            value += float(self.final_reward)
        return value

    def path_to(self, call_id: str) -> tuple[str, ...]:
        """Call ids from the root down to `call_id`."""
        path = [call_id]
        for _ in range(len(self.order)):  # bounded: a path is at most every call
            parent = self.parents.get(path[-1])
            if parent is None:
                break
            path.append(parent)
        return tuple(reversed(path))


CreditFn = Callable[[CallTree, float], dict[str, float]]
"""A credit rule's function: (tree, gamma) -> credited reward per call id."""


class CreditRule(StrEnum):
    """The built-in credit rules, by name (`credit_rule` gives each one's function)."""

    DISCOUNT = "discount"
    """Leaves first: own reward + gamma * mean of the children's credited rewards."""
    OUTCOME = "outcome"
    """Every call gets the trajectory's outcome."""
    RETURNS_TO_GO = "returns_to_go"
    """Discounted return along each root-to-leaf path (averaged where paths share a call)."""


DEFAULT_CREDIT_RULE = CreditRule.DISCOUNT
"""The rule used when none is named (the backward discount)."""


def _check_gamma(gamma: float) -> None:
    if not 0.0 <= gamma <= 1.0:
        raise InvalidRequest(f"discount must be in [0, 1], got {gamma}")


def discounted_tree(tree: CallTree, gamma: float) -> dict[str, float]:
    """The backward discount, leaves first: reward(call) = own + gamma * mean(reward(children))."""
    _check_gamma(gamma)
    credited: dict[str, float] = {}
    for n in reversed(tree.order):  # reverse topological: every child is done before its parent
        kids = tree.children[n]
        value = tree.own_reward(n)
        if kids:
            value += gamma * sum(credited[c] for c in kids) / len(kids)
        credited[n] = value
    return credited


def outcome(tree: CallTree) -> float:
    """The trajectory's outcome: the final reward, else the last call's own reward, else 0."""
    if tree.final_reward is not None:
        return float(tree.final_reward)
    last = tree.rewards.get(tree.order[-1]) if tree.order else None
    if last is not None:
        return float(last)
    return 0.0


def outcome_broadcast(tree: CallTree, gamma: float = 1.0) -> dict[str, float]:
    """Every call gets the trajectory's outcome (`gamma` is unused; rules share one signature)."""
    value = outcome(tree)
    return {n: value for n in tree.order}


def returns_to_go_paths(tree: CallTree, gamma: float) -> dict[str, dict[str, float]]:
    """Per leaf, the return of every call on its root-to-leaf path: G_t = r_t + gamma * G_{t+1}."""
    _check_gamma(gamma)
    result: dict[str, dict[str, float]] = {}
    for leaf in tree.leaves():
        g = 0.0
        returns: dict[str, float] = {}
        for n in reversed(tree.path_to(leaf)):
            g = tree.own_reward(n) + gamma * g
            returns[n] = g
        result[leaf] = returns
    return result


def returns_to_go(tree: CallTree, gamma: float) -> dict[str, float]:
    """Per call, its return-to-go, averaged over the root-to-leaf paths that pass through it."""
    sums: dict[str, float] = dict.fromkeys(tree.order, 0.0)
    counts: dict[str, int] = dict.fromkeys(tree.order, 0)
    for returns in returns_to_go_paths(tree, gamma).values():
        for n, g in returns.items():
            sums[n] += g
            counts[n] += 1
    return {n: sums[n] / counts[n] for n in tree.order}  # every call is on >= 1 path


def credit_rule(name: str) -> CreditFn:
    """The built-in rule called `name` (a `CreditRule`): discount, outcome or returns_to_go."""
    rules: dict[str, CreditFn] = {
        CreditRule.DISCOUNT: discounted_tree,
        CreditRule.OUTCOME: outcome_broadcast,
        CreditRule.RETURNS_TO_GO: returns_to_go,
    }
    if name not in rules:
        raise InvalidRequest(f"unknown credit rule {name!r}; known: {sorted(rules)}")
    return rules[name]


def per_role(rule: CreditFn, tree: CallTree, gamma: float) -> dict[str, float]:
    """`rule` applied to each role's calls as a tree of their own (the documented role rule).

    A call whose parent has another role is a root of its role's tree, so credit never flows
    from one role's calls to another's. Each role's leaves get the role's own final reward when
    one was set, else the episode's reward: the final reward, or, without one, the last call's
    own reward (an agent that returned a number), which the last call's role already holds and
    every other role gets at its leaves. With one role (or none) this is `rule(tree, gamma)`.
    """
    roles = [tree.roles.get(n) for n in tree.order]
    if len(set(roles)) <= 1 and not tree.role_rewards:
        return rule(tree, gamma)
    last_reward = tree.rewards.get(tree.order[-1]) if tree.order else None
    credited: dict[str, float] = {}
    for role in dict.fromkeys(roles):  # roles in order of first call
        order = tuple(n for n, r in zip(tree.order, roles, strict=True) if r == role)
        parents = {n: p if p is not None and tree.roles.get(p) == role else None
                   for n in order for p in (tree.parents.get(n),)}
        final: float | None
        if role is not None and role in tree.role_rewards:
            final = tree.role_rewards[role]
        elif tree.final_reward is not None or role == roles[-1]:
            final = tree.final_reward
        else:
            final = last_reward
        sub = CallTree(order=order, parents=parents,
                       rewards={n: tree.rewards.get(n) for n in order}, final_reward=final)
        credited.update(rule(sub, gamma))
    return credited
