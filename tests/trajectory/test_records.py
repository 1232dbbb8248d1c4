from __future__ import annotations

import json

import pytest

from relayrl.chat.conversation import Conversation, Message, ParsedReply, Tool, ToolCall
from relayrl.trajectory import BranchReason, Interaction, Session
from relayrl.trajectory.records import from_log_dict, to_log_dict

from . import assistant, call, sys_msg, three_turn_session, user


def _interaction(**overrides: object) -> Interaction:
    fields: dict[str, object] = dict(
        id="c1", session_id="s", segment_id="seg-c1", parent_id=None,
        conversation=Conversation((Message("user", "hi"),)), reply=ParsedReply("hello"),
        prompt_ids=(1, 2, 3), output_ids=(4, 5), logprobs=(-0.1, -0.2), versions=(0, 0),
        finish_reason="stop", prompt_source="render", branch_reason=BranchReason.FIRST,
    )
    fields.update(overrides)
    return Interaction(**fields)  # type: ignore[arg-type]


def test_misaligned_logprobs_or_versions_are_rejected() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        _interaction(logprobs=(-0.1,))
    with pytest.raises(ValueError, match="versions"):
        _interaction(versions=(0, 0, 0))


def test_prompt_source_and_branch_reason_must_agree() -> None:
    with pytest.raises(ValueError, match="branch reason"):
        _interaction(branch_reason=None)
    with pytest.raises(ValueError, match="branch reason"):
        _interaction(prompt_source="extend", parent_id="c0")
    with pytest.raises(ValueError, match="needs a parent"):
        _interaction(prompt_source="extend", branch_reason=None)


def test_unknown_finish_reason_and_empty_prompt_are_rejected() -> None:
    with pytest.raises(ValueError, match="finish_reason"):
        _interaction(finish_reason="done")
    with pytest.raises(ValueError, match="empty prompt"):
        _interaction(prompt_ids=())


def test_interaction_with_tools_reasoning_and_kwargs_survives_json_round_trip() -> None:
    conv = Conversation(
        (Message("system", "s"), Message("user", "u"),
         Message("assistant", "", reasoning="think", tool_calls=(ToolCall("i1", "f", '{"x":1}'),)),
         Message("tool", "42", tool_call_id="i1", name="f")),
        tools=(Tool("f", "adds", {"type": "object", "properties": {"x": {"type": "integer"}}}),),
        tool_choice="required",
        template_kwargs={"enable_thinking": True},
    )
    c = _interaction(conversation=conv, reply=ParsedReply("ok", "hmm", (ToolCall("i2", "g", "{}"),)),
                     timings={"total_s": 0.5}, reward=0.25, created=123.5)
    back = Interaction.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back == c


def test_log_entry_of_a_child_holds_only_what_its_parent_lacks() -> None:
    s = Session("s")
    calls = three_turn_session(s)
    parent, child = calls[1], calls[2]
    entry = to_log_dict(child, parent)
    assert len(entry["conversation"]["messages"]) < len(child.conversation.messages)
    assert len(entry["prompt_ids"]) == len(child.prompt_ids) - len(parent.token_ids)
    rebuilt = from_log_dict(json.loads(json.dumps(entry)), parent)
    assert rebuilt == child


def test_log_entry_of_a_rendered_child_keeps_its_full_prompt() -> None:
    s = Session("s")
    first = call(s, [sys_msg(), user("q")], "a")
    # a prompt that does not extend the parent's tokens: a new segment with the full prompt
    second = call(s, [sys_msg(), user("q"), assistant("a"), user("more")], "b",
                  prompt_override=(9, 9, 9))
    entry = to_log_dict(second, first)
    assert entry["prompt_ids"] == [9, 9, 9]
    assert from_log_dict(entry, first) == second


def test_log_entry_refusing_a_missing_parent() -> None:
    s = Session("s")
    calls = three_turn_session(s)
    entry = to_log_dict(calls[2], calls[1])
    with pytest.raises(ValueError, match="missing parent"):
        from_log_dict(entry, None)
