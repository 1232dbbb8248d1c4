from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest

from relayrl.chat.conversation import Conversation, Message, Tool, ToolCall
from relayrl.errors import InvalidRequest, SessionClosed
from relayrl.trajectory import BranchReason, Session, canonical_message
from relayrl.types import FinishReason, GenerateOutput

from . import assistant, call, sys_msg, three_turn_session, tool_result, user


def test_first_call_opens_a_segment_with_reason_first() -> None:
    s = Session("s")
    c = call(s, [sys_msg(), user("hi")], "hello")
    assert (c.prompt_source, c.branch_reason, c.parent_id) == ("render", BranchReason.FIRST, None)
    assert [seg.reason for seg in s.segments()] == [BranchReason.FIRST]


def test_follow_up_calls_extend_their_parent_within_one_segment() -> None:
    s = Session("s")
    c1, c2, c3 = three_turn_session(s)
    assert (c2.parent_id, c3.parent_id) == (c1.id, c2.id)
    assert c1.segment_id == c2.segment_id == c3.segment_id
    assert c3.prompt_source == "extend"
    assert c3.prompt_ids[: len(c2.token_ids)] == c2.token_ids
    assert s.stats().segments == 1


def test_reordered_and_respaced_tool_arguments_still_find_the_parent() -> None:
    s = Session("s")
    h = [sys_msg(), user("add")]
    first = call(s, h, "", tool_calls=[ToolCall("call_1", "add", '{"a": 1, "b": 2}')])
    echoed = ToolCall("call_1", "add", '{ "b":2,"a":1 }')
    located = s.locate(Conversation((*h, assistant("", [echoed]), tool_result("call_1", "3"))))
    assert located.parent == first and located.reason is None
    assert [m.role for m in located.new_messages] == ["tool"]


def test_dropped_reasoning_none_content_and_whitespace_still_find_the_parent() -> None:
    s = Session("s")
    h = [sys_msg(), user("q")]
    first = call(s, h, "  the answer  ")
    echoed = Message("assistant", "the answer\n", reasoning=None)
    located = s.locate(Conversation((*h, echoed, user("next"))))
    assert located.parent == first
    # a None content (as some clients send for tool-call turns) equals ""
    assert canonical_message(Message("assistant", None, tool_calls=(ToolCall("i", "f", ""),))) \
        == canonical_message(Message("assistant", "", tool_calls=(ToolCall("i", "f", "{}"),)))  # type: ignore[arg-type]


def test_a_different_tool_call_id_is_an_edit() -> None:
    s = Session("s")
    h = [sys_msg(), user("add")]
    call(s, h, "", tool_calls=[ToolCall("call_1", "add", "{}")])
    other = ToolCall("call_X", "add", "{}")
    located = s.locate(Conversation((*h, assistant("", [other]), tool_result("call_X", "3"))))
    assert located.parent is None and located.reason == BranchReason.HISTORY_EDITED


def test_compacted_history_opens_a_new_segment_and_counts_the_reason() -> None:
    s = Session("s")
    c1, _, _ = three_turn_session(s)
    compacted = [sys_msg(), user("summary: 1+2=3"), assistant("noted"), user("go on")]
    c4 = call(s, compacted, "ok")
    assert c4.parent_id is None and c4.branch_reason == BranchReason.HISTORY_EDITED
    assert c4.segment_id != c1.segment_id
    assert s.stats().branch_reasons == {"first": 1, "history_edited": 1}


def test_changed_tools_open_a_segment_but_keep_the_tree_parent() -> None:
    s = Session("s")
    h = [sys_msg(), user("q")]
    first = call(s, h, "a", tools=[Tool("f")])
    c = call(s, [*h, assistant("a"), user("again")], "b", tools=[Tool("f"), Tool("g")])
    assert c.parent_id == first.id
    assert c.branch_reason == BranchReason.TOOLS_CHANGED and c.prompt_source == "render"


def test_calls_continuing_the_same_parent_become_siblings() -> None:
    s = Session("s")
    h = [sys_msg(), user("q")]
    root = call(s, h, "a")
    left = call(s, [*h, assistant("a"), user("left")], "l")
    right = call(s, [*h, assistant("a"), user("right")], "r")
    assert left.parent_id == right.parent_id == root.id
    assert left.segment_id == right.segment_id == root.segment_id
    assert [c.id for c in s.children(root.id)] == [left.id, right.id]
    paths = s.segment_paths(root.segment_id)
    assert [[c.id for c in p] for p in paths] == [[root.id, left.id], [root.id, right.id]]


def test_the_longest_matching_prefix_wins() -> None:
    s = Session("s")
    _, c2, c3 = three_turn_session(s)
    h = [*c3.conversation.messages, assistant("You are welcome."), user("bye")]
    assert s.locate(Conversation(tuple(h))).parent == c3
    # a call that forks after the second turn finds c2, not c3
    fork = [*c2.conversation.messages, assistant("It is 3."), user("why?")]
    assert s.locate(Conversation(tuple(fork))).parent == c2


def test_tokens_that_do_not_extend_the_parent_open_a_prompt_mismatch_segment() -> None:
    s = Session("s")
    h = [sys_msg(), user("q")]
    first = call(s, h, "a")
    c = call(s, [*h, assistant("a"), user("more")], "b", prompt_override=(1, 5, 99, 3))
    assert c.parent_id == first.id
    assert c.branch_reason == BranchReason.PROMPT_MISMATCH and c.segment_id != first.segment_id


def test_a_parent_cut_by_length_is_reported_as_unfinished() -> None:
    s = Session("s")
    h = [sys_msg(), user("q")]
    first = call(s, h, "a very long", finish=FinishReason.LENGTH)
    c = call(s, [*h, assistant("a very long"), user("continue")], "b",
             prompt_override=(1, 2, 3, 4))
    assert first.finish_reason == "length"
    assert c.branch_reason == BranchReason.PARENT_UNFINISHED


def test_a_call_without_assistant_turns_is_a_new_conversation() -> None:
    s = Session("s")
    call(s, [sys_msg(), user("q")], "a")
    again = call(s, [sys_msg(), user("q")], "a2")
    assert again.parent_id is None and again.branch_reason == BranchReason.NEW_CONVERSATION


def test_record_refuses_an_extension_whose_tokens_do_not_extend() -> None:
    s = Session("s")
    h = [sys_msg(), user("q")]
    call(s, h, "a")
    conv = Conversation((*h, assistant("a"), user("x")))
    located = s.locate(conv)
    good = call(Session("other"), h, "a")  # a donor for a well-formed output
    out = GenerateOutput(list(good.output_ids), list(good.logprobs), list(good.versions),
                         FinishReason.STOP)
    assert located.parent is not None
    made = s.new_interaction(conversation=conv, reply=good.reply, output=out,
                             prompt_ids=(*located.parent.token_ids, 5), parent=located.parent)
    forged = replace(made, prompt_ids=(7, 7, 7))
    with pytest.raises(InvalidRequest, match="does not extend"):
        s.record(forged)
    s.record(made)
    with pytest.raises(InvalidRequest, match="already recorded"):
        s.record(made)


def test_calls_on_an_ended_session_are_refused() -> None:
    s = Session("s")
    call(s, [user("q")], "a")
    s.end()
    with pytest.raises(SessionClosed):
        s.locate(Conversation((user("q"),)))


def test_the_latest_identical_call_is_the_parent_of_a_follow_up() -> None:
    s = Session("s")
    h = [user("q")]
    call(s, h, "a")
    second = call(s, h, "a")
    follow = s.locate(Conversation((*h, assistant("a"), user("n"))))
    assert follow.parent == second


def _many_conversations(n_calls: int) -> tuple[Session, list[Message]]:
    s = Session("s")
    h: list[Message] = []
    for k in range(n_calls):
        if k % 3 == 0:
            h = [sys_msg(), user(f"task {k}")]
        call(s, h, f"reply {k}")
        h = [*h, assistant(f"reply {k}"), user(f"next {k}")]
    return s, h


def test_locate_work_depends_on_the_call_not_on_how_many_calls_are_stored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import relayrl.chat.conversation as conversation_module

    counted = {"n": 0}
    original = conversation_module.canonical_message

    def counting(m: Message) -> str:
        counted["n"] += 1
        return original(m)

    work = []
    for n_calls in (30, 900):
        s, last = _many_conversations(n_calls)
        # fresh copies: a turn computes its canonical form once (`Message.canonical_bytes`)
        fresh = tuple(dataclasses.replace(m) for m in last)
        monkeypatch.setattr(conversation_module, "canonical_message", counting)
        counted["n"] = 0
        located = s.locate(Conversation(fresh))
        monkeypatch.setattr(conversation_module, "canonical_message", original)
        assert located.parent is not None and located.reason is None
        work.append((len(last), counted["n"]))
    # one canonical form per message of the new call, whatever the session holds
    assert work[0] == work[1] == (work[0][0], work[0][0])


def test_a_turn_keeps_its_canonical_bytes_and_a_lone_surrogate_still_hashes() -> None:
    m = Message(role="user", content=" 3 + 4 \ud800 ")
    assert m.canonical_bytes == canonical_message(m).encode("utf-8", "surrogatepass")
    assert m.canonical_bytes is m.canonical_bytes  # computed once
    assert m == Message(role="user", content=" 3 + 4 \ud800 ")  # the cache is not a field
    s = Session("s")
    call(s, [m], "ok")
    assert s.locate(Conversation((m, Message(role="assistant", content="ok"),
                                  user("next")))).parent is not None


def test_a_call_sharing_turns_with_the_last_one_hashes_only_what_follows_them() -> None:
    s = Session("s")
    h = [sys_msg(), user("task")]
    for k in range(20):
        call(s, h, f"reply {k}")
        h = [*h, assistant(f"reply {k}"), user(f"next {k}")]
    shared = tuple(h[:-1])
    calls = [Conversation((*shared, user("variant a"))), Conversation((*shared, user("variant b"))),
             Conversation((*shared[:9], replace(shared[9], content="edited"), *shared[10:],
                           user("variant c"))),
             Conversation(tuple(h))]
    reused = []
    for conv in calls:
        before = s._trail[1]
        located = s.locate(conv)
        # the running hashes of the turns shared with the last call are reused, not recomputed
        reused.append(sum(a is b for a, b in zip(s._trail[1], before, strict=False)))
        fresh = Session("s2")
        fresh.__dict__.update({k: v for k, v in s.__dict__.items() if k not in ("_trail", "id")})
        again = fresh.locate(conv)  # the same calls, no trail: hashes every turn
        assert (located.parent, located.reason, located.new_messages) == (
            again.parent, again.reason, again.new_messages)
    # 19 replies shared with the last recorded call, then all 20, then the 4 before the edit
    assert reused == [19, 20, 4, 4]
    assert s.locate(calls[-1]).parent is not None  # the real follow-up still finds its parent


def test_a_finished_session_lets_go_of_what_locate_kept_for_the_next_call() -> None:
    s = Session("s")
    c1 = call(s, [sys_msg(), user("q")], "a")
    s.locate(Conversation((sys_msg(), user("q"), assistant("a"), user("next"))))
    assert s._trail[1]
    s.end()
    assert s._trail == ((), []) and not s._hashed
    assert s.get(c1.id) is c1  # the calls themselves stay
