"""Roles in the trajectory layer: the precedence of role sources, the group refusal, per-role
credit, and rows split per role (docs/multi-agent.md)."""

from __future__ import annotations

import pytest

from relayrl.chat.conversation import Conversation, Message, ParsedReply
from relayrl.errors import InvalidRequest
from relayrl.trajectory import Session, export_session
from relayrl.trajectory.credit import CallTree, credit_rule, per_role
from relayrl.trajectory.roles import (
    check_group_roles,
    check_role,
    resolve_role,
    role_from_model,
    role_group_id,
)
from relayrl.trajectory.store import InteractionLog
from relayrl.types import GenerateOutput

# ---- precedence ------------------------------------------------------------------------------


def test_the_header_wins_over_every_other_source() -> None:
    assert resolve_role(header="critic", path="solver", model="m@planner",
                        session_metadata={"role": "player_0"}) == "critic"


def test_the_scoped_url_wins_over_the_model_and_the_session() -> None:
    assert resolve_role(path="solver", model="m@planner",
                        session_metadata={"role": "player_0"}) == "solver"


def test_the_model_wins_over_the_session_metadata() -> None:
    assert resolve_role(model="default@planner", session_metadata={"role": "x"}) == "planner"


def test_a_configured_model_name_wins_over_the_at_suffix() -> None:
    mapping = {"triage-agent": "triage", "a@b": "mapped"}
    assert role_from_model("triage-agent", mapping) == "triage"
    assert role_from_model("a@b", mapping) == "mapped"
    assert role_from_model("gpt-4o", mapping) is None
    assert role_from_model("policy@", mapping) is None  # an empty suffix names nothing


def test_the_session_metadata_is_the_last_source_and_none_is_no_role() -> None:
    assert resolve_role(model="default", session_metadata={"role": "player_1"}) == "player_1"
    assert resolve_role(model="default", session_metadata={"episode_id": "e"}) is None
    assert resolve_role() is None


@pytest.mark.parametrize("bad", ["", "has space", "x" * 65, ".dot", "a/b", "é"])
def test_a_bad_role_name_is_refused_naming_where_it_came_from(bad: str) -> None:
    with pytest.raises(InvalidRequest, match="x-relayrl-role header"):
        resolve_role(header=bad) if bad.strip() else check_role(bad, "the x-relayrl-role header")


def test_a_bad_role_in_the_model_name_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="role in model"):
        role_from_model("policy@no good")


# ---- groups ----------------------------------------------------------------------------------


def test_groups_are_per_task_and_role() -> None:
    assert role_group_id("grp-1", None) == "grp-1"
    assert role_group_id("grp-1", "solver") == "grp-1/solver"


def test_a_group_that_mixes_roles_is_refused_with_both_roles_named() -> None:
    check_group_roles(["g1", "g1", "g2"], ["a", "a", "b"])  # one role per group: fine
    with pytest.raises(InvalidRequest, match=r"group 'g1' holds rows of roles 'a' and 'b'"):
        check_group_roles(["g1", "g1"], ["a", "b"])
    with pytest.raises(InvalidRequest, match="roles 'a' and None"):
        check_group_roles(["g1", "g1"], ["a", None])


# ---- credit ----------------------------------------------------------------------------------


def _tree(final: float | None = 1.0, role_rewards: dict[str, float] | None = None,
          rewards: dict[str, float | None] | None = None) -> CallTree:
    # planner p1 -> solver s1 -> solver s2 (s1 extends p1's tokens: one segment, roles change)
    return CallTree(order=("p1", "s1", "s2"), parents={"p1": None, "s1": "p1", "s2": "s1"},
                    rewards=rewards or {}, final_reward=final,
                    roles={"p1": "planner", "s1": "solver", "s2": "solver"},
                    role_rewards=role_rewards or {})


def test_by_default_every_role_gets_the_episodes_reward() -> None:
    for rule in ("discount", "outcome", "returns_to_go"):
        credited = per_role(credit_rule(rule), _tree(final=1.0), 0.5)
        assert credited["p1"] == 1.0  # the planner's last call is its role's leaf
        assert credited["s2"] == 1.0


def test_credit_never_flows_from_one_roles_calls_to_anothers() -> None:
    tree = _tree(final=None, rewards={"s1": 4.0})
    credited = per_role(credit_rule("discount"), tree, 0.5)
    assert credited == {"p1": 0.0, "s1": 4.0, "s2": 0.0}
    # without roles the planner's call would have been credited through its child
    plain = credit_rule("discount")(CallTree(tree.order, tree.parents, tree.rewards), 0.5)
    assert plain["p1"] == 2.0


def test_the_last_calls_reward_is_the_episodes_reward_for_every_role() -> None:
    # an agent that returns a number rewards the last call: the other roles get it too
    credited = per_role(credit_rule("discount"), _tree(final=None, rewards={"s2": 1.0}), 1.0)
    assert credited == {"p1": 1.0, "s1": 1.0, "s2": 1.0}


def test_a_roles_own_reward_replaces_the_episodes_for_that_role_only() -> None:
    credited = per_role(credit_rule("discount"), _tree(final=1.0, role_rewards={"planner": -1.0}),
                        1.0)
    assert credited == {"p1": -1.0, "s1": 1.0, "s2": 1.0}


def test_without_roles_per_role_is_the_rule_itself() -> None:
    tree = CallTree(("a", "b"), {"a": None, "b": "a"}, {"a": 0.5}, final_reward=2.0)
    assert per_role(credit_rule("discount"), tree, 0.9) == credit_rule("discount")(tree, 0.9)


# ---- sessions and rows -----------------------------------------------------------------------


def _call(session: Session, parent: object, messages: list[Message], reply: str,
          role: str | None, prompt: tuple[int, ...]) -> object:
    conv = Conversation(messages=tuple(messages))
    out = GenerateOutput(output_ids=[90, 91], logprobs=[-0.1, -0.2], versions=[0, 0],
                         finish_reason="stop")
    located = session.locate(conv)
    c = session.new_interaction(conversation=conv, reply=ParsedReply(content=reply),
                                prompt_ids=prompt, output=out, parent=located.parent,
                                reason=located.reason, role=role)
    session.record(c)
    return c


def _two_role_session() -> Session:
    s = Session("s1", task_id="t1")
    user = [Message(role="user", content="plan it")]
    p = _call(s, None, user, "plan", "planner", (1, 2, 3))
    follow = [*user, Message(role="assistant", content="plan"), Message(role="user", content="go")]
    _call(s, p, follow, "done", "solver", (1, 2, 3, 90, 91, 4, 5))
    return s


def test_a_path_that_changes_role_makes_one_row_per_role() -> None:
    s = _two_role_session()
    s.set_final_reward(1.0)
    s.set_final_reward(0.25, role="solver")
    rows = export_session(s)
    assert [r.role for r in rows] == ["planner", "solver"]
    planner, solver = rows
    assert planner.input_ids == [1, 2, 3, 90, 91] and sum(planner.loss_mask) == 2
    # the solver's row holds the planner's reply as context only: its own two tokens train
    assert solver.input_ids == [1, 2, 3, 90, 91, 4, 5, 90, 91]
    assert solver.loss_mask == [0, 0, 0, 0, 0, 0, 0, 1, 1]
    assert (planner.reward, solver.reward) == (1.0, 0.25)
    assert solver.metadata["role_rewards"] == {"solver": 0.25}
    individual = export_session(s, style="individual")
    assert [r.metadata["role"] for r in individual] == ["planner", "solver"]


def test_a_session_without_roles_exports_as_before() -> None:
    s = Session("s2", task_id="t")
    user = [Message(role="user", content="hi")]
    p = _call(s, None, user, "a", None, (1, 2))
    _call(s, p, [*user, Message(role="assistant", content="a"),
                 Message(role="user", content="b")], "c", None, (1, 2, 90, 91, 3))
    rows = export_session(s)
    assert len(rows) == 1 and rows[0].role is None and "role" not in rows[0].metadata


def test_roles_and_role_rewards_survive_the_durable_log(tmp_path: object) -> None:
    path = f"{tmp_path}/log.sqlite"
    with InteractionLog(path) as log:
        s = Session("s3", task_id="t", journal=log)
        user = [Message(role="user", content="plan it")]
        p = _call(s, None, user, "plan", "planner", (1, 2, 3))
        follow = [*user, Message(role="assistant", content="plan"),
                  Message(role="user", content="go")]
        _call(s, p, follow, "done", "solver", (1, 2, 3, 90, 91, 4, 5))
        s.set_final_reward(0.5, role="planner")
        s.set_final_reward(1.0)
    with InteractionLog(path) as log:
        (rebuilt,) = log.recover()
    assert [c.role for c in rebuilt.interactions] == ["planner", "solver"]
    assert rebuilt.role_rewards == {"planner": 0.5} and rebuilt.final_reward == 1.0
    assert [r.reward for r in export_session(rebuilt)] == [0.5, 1.0]
