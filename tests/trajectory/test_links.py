"""Compaction and sub-agent segments: detection rules, links, credit and rows.

The request shapes are the ones the CLIs send, taken from their source (the texts are the
installed Codex 0.171.0, Claude Code 2.1.197 and opencode 1.18.33 binaries' own): Codex's compact
prompt and summary prefix, Claude Code's summarisation request (another system prompt) and its
continuation message, opencode's transcript-in-one-message request and the summary it re-sends as
an answer, Claude Code's `Agent` tool and Codex's `spawn_agent`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from relayrl.chat.conversation import Conversation, Message, ParsedReply, ToolCall
from relayrl.errors import InvalidRequest
from relayrl.trajectory import BranchReason, Interaction, Session, export_session
from relayrl.trajectory.links import (
    SUMMARY_PREFIXES,
    SUMMARY_REQUEST_MARKERS,
    LinkSignal,
    signal_from_request,
)
from relayrl.types import FinishReason, GenerateOutput

from . import EOT, assistant, render, render_message, sys_msg, tok, tool_result, user

CODEX_COMPACT = dict(SUMMARY_REQUEST_MARKERS)["codex"] + " Create a handoff summary for another LLM."
CODEX_PREFIX = dict(SUMMARY_PREFIXES)["codex"]
CLAUDE_COMPACT = ("CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.\n\n"
                  + SUMMARY_REQUEST_MARKERS[1][1] + ", paying close attention to the user's "
                  "explicit requests and your previous actions.")
CLAUDE_PREFIX = dict(SUMMARY_PREFIXES)["claude_code"]
SUMMARY = ("The user asked to fix the failing parser test in parse.py.\n"
           "The bug is an off-by-one in read_header at line 42.\n"
           "Next step: change range(n) to range(n + 1) and rerun pytest.")


def _call(session: Session, messages: Sequence[Message], reply: str, *,
          tool_calls: Sequence[ToolCall] = (), signal: LinkSignal | None = None) -> Interaction:
    """What the gateway does: locate (with the signal), render or extend, record with the rule."""
    conv = Conversation(tuple(messages))
    located = session.locate(conv, signal)
    if located.reason is None:
        assert located.parent is not None
        body: tuple[int, ...] = ()
        for m in located.new_messages:
            body += render_message(m)
        prompt = (*located.parent.token_ids, *body, 1, 3)
    else:
        prompt = render(conv.messages)
    text = reply + "".join(f"<{c.name}:{c.arguments}>" for c in tool_calls)
    ids = [*tok(text), EOT]
    out = GenerateOutput(output_ids=ids, logprobs=[-0.1] * len(ids), versions=[0] * len(ids),
                         finish_reason=FinishReason.STOP)
    c = session.new_interaction(conversation=conv, reply=ParsedReply(reply, tool_calls=tuple(
        tool_calls)), prompt_ids=prompt, output=out, parent=located.parent,
        reason=located.reason, link_rule=located.link_rule)
    session.record(c)
    return c


def _work(s: Session) -> tuple[list[Message], Interaction]:
    h = [sys_msg("You are a coding agent."), user("fix the failing parser test")]
    _call(s, h, "I will look at parse.py.")
    h += [assistant("I will look at parse.py."), user("go on")]
    c2 = _call(s, h, "read_header has an off-by-one at line 42.")
    h += [assistant("read_header has an off-by-one at line 42.")]
    return h, c2


def test_codex_compaction_links_the_continuation_to_the_summary_call() -> None:
    s = Session("s", task_id="t")
    h, _ = _work(s)
    # Codex's local compaction: the history + its compact prompt as a user turn (extends)
    summary_call = _call(s, [*h, user(CODEX_COMPACT)], SUMMARY)
    assert summary_call.branch_reason is None  # one segment with the work it summarises
    assert summary_call.metadata["compaction"] == "summary_request:codex"
    # the compacted history: initial context, the user's messages, the summary with its prefix
    compacted = [sys_msg("You are a coding agent."), user("fix the failing parser test"),
                 user(CODEX_PREFIX + "\n" + SUMMARY)]
    cont = _call(s, compacted, "Changed range(n) to range(n + 1).")
    assert cont.branch_reason == BranchReason.COMPACTION
    assert cont.parent_id == summary_call.id
    assert cont.metadata["link_rule"] == "summary_prefix:codex"
    seg = next(g for g in s.segments() if g.id == cont.segment_id)
    assert seg.parent_segment_id == summary_call.segment_id
    assert seg.link_rule == "summary_prefix:codex"
    # without the link the same call was just a new conversation
    plain = Session("p")
    _work(plain)
    assert plain.locate(Conversation(tuple(compacted))).reason == BranchReason.NEW_CONVERSATION


def test_summary_tokens_carry_loss_and_the_episode_reward_and_are_trained_once() -> None:
    s = Session("s", task_id="t")
    h, _ = _work(s)
    summary_call = _call(s, [*h, user(CODEX_COMPACT)], SUMMARY)
    compacted = [sys_msg("You are a coding agent."), user(CODEX_PREFIX + "\n" + SUMMARY)]
    cont = _call(s, compacted, "Done.")
    s.set_final_reward(1.0)
    rows = export_session(s, "concat", credit="discount", discount=1.0)
    assert len(rows) == 2
    old, new = rows
    i = old.interaction_ids.index(summary_call.id)
    start, end = old.turn_spans[i]
    # the summary's sampled tokens are trained (mask 1) and carry the episode's reward
    assert old.loss_mask[start:end] == [1] * (end - start) and end > start
    assert old.input_ids[start:end] == list(summary_call.output_ids)
    assert old.turn_rewards[i] == 1.0 and old.reward == 1.0
    # the copied summary in the continuation's prompt is prompt: never trained a second time
    assert new.interaction_ids == [cont.id]
    assert new.metadata["branch_reason"] == "compaction"
    assert new.metadata["parent_segment_id"] == old.segment_id
    summary_ids = list(tok(SUMMARY))
    p = len(cont.prompt_ids)
    k = next(j for j in range(p) if new.input_ids[j:j + len(summary_ids)] == summary_ids)
    assert sum(new.loss_mask[k:k + len(summary_ids)]) == 0
    assert sum(new.loss_mask) == len(cont.output_ids)
    # the credit reaches the summary call through the link: discounted once below its child
    assert export_session(s, "concat", credit="discount", discount=0.5)[0].turn_rewards[i] == 0.5


def test_claude_code_summary_request_and_continuation_are_linked() -> None:
    s = Session("s")
    h, last = _work(s)
    # Claude Code sends the summarisation request under another system prompt
    req = [sys_msg("You are a helpful AI assistant tasked with summarizing conversations."),
           *h[1:], user(CLAUDE_COMPACT)]
    reply = "<analysis>\nI read the whole conversation carefully first.\n</analysis>\n" \
            f"<summary>\n{SUMMARY}\n</summary>"
    writer = _call(s, req, reply)
    assert writer.branch_reason == BranchReason.COMPACTION
    assert writer.parent_id == last.id
    assert writer.metadata["link_rule"] == "summary_request:claude_code"
    # its continuation keeps the <summary> block only, as "Summary:"
    cont_msg = f"{CLAUDE_PREFIX} The summary below covers the earlier portion.\n\nSummary:\n{SUMMARY}"
    cont = _call(s, [sys_msg("You are a coding agent."), user(cont_msg)], "Fixed.")
    assert (cont.branch_reason, cont.parent_id) == (BranchReason.COMPACTION, writer.id)
    assert cont.metadata["link_rule"] == "summary_prefix:claude_code"


OPENCODE_ASK = dict(SUMMARY_REQUEST_MARKERS)["opencode"]
OPENCODE_AGAIN = SUMMARY_REQUEST_MARKERS[-1][1]


def _opencode_request(transcript: str, prior: str | None = None) -> list[Message]:
    """opencode's compaction call: its summarisation agent's prompt, the history as text."""
    text = f"Here is the conversation so far:\n\n<conversation>\n{transcript}\n</conversation>\n\n"
    text += (OPENCODE_ASK + " so another coding agent can continue the work." if prior is None
             else f"<prior-summary>\n{prior}\n</prior-summary>\n\n{OPENCODE_AGAIN}")
    return [sys_msg("You are a context summarization agent."), user(text)]


def test_opencode_summary_request_and_continuation_are_linked() -> None:
    s = Session("s")
    _, last = _work(s)
    # the turns before the kept tail, written out as text: the first user turn is quoted
    writer = _call(s, _opencode_request("[User]: fix the failing parser test"), SUMMARY)
    assert writer.metadata["compaction"] == "summary_request:opencode"
    assert (writer.branch_reason, writer.parent_id) == (BranchReason.COMPACTION, last.id)
    assert writer.metadata["link_rule"] == "summary_request:opencode"
    # the compacted history: the summary is the assistant's answer to "What did we do so far?"
    cont = _call(s, [sys_msg("You are a coding agent."), user("What did we do so far?"),
                     assistant(SUMMARY), user("Continue if you have next steps.")], "Fixed.")
    assert (cont.branch_reason, cont.parent_id) == (BranchReason.COMPACTION, writer.id)
    assert cont.metadata["link_rule"] == "copied_reply"
    # a later compaction carries the earlier summary as <prior-summary>: marked and linked too
    again = _call(s, _opencode_request("[User]: What did we do so far?\n[Assistant]: Fixed.",
                                       prior=SUMMARY), SUMMARY + "\nThe test passes now.")
    assert again.metadata["compaction"] == "summary_request:opencode"
    assert (again.branch_reason, again.parent_id) == (BranchReason.COMPACTION, cont.id)


def test_opencode_summary_request_finds_the_call_by_its_quoted_tool_call() -> None:
    s = Session("s")
    _call(s, [user("list the files here")], "",
          tool_calls=[ToolCall("c1", "bash", '{"command": "ls -la", "description": "list"}')])
    other = _call(s, [user("an unrelated conversation")], "Nothing to do here.")
    transcript = ('[Assistant tool call]: bash({"command":"ls -la","description":"list"})\n'
                  "[Tool result]: a.txt")
    writer = _call(s, _opencode_request(transcript), SUMMARY)
    assert writer.branch_reason == BranchReason.COMPACTION
    assert writer.parent_id == s.interactions[0].id != other.id


def test_an_answer_copying_a_reply_that_was_not_a_summary_is_not_compaction() -> None:
    s = Session("s")
    c = _call(s, [user("plan the work")], "Step one: read the parser module carefully.")
    other = _call(s, [user("What was the plan?"),
                      assistant("Step one: read the parser module carefully."), user("go")], "ok")
    assert other.branch_reason == BranchReason.HISTORY_EDITED and other.parent_id != c.id


def test_a_handoff_without_a_summary_mark_is_not_compaction() -> None:
    s = Session("s")
    c = _call(s, [user("plan the work")], "Step one: read the parser module carefully.")
    other = _call(s, [user("Do this: Step one: read the parser module carefully.")], "ok")
    assert other.branch_reason == BranchReason.NEW_CONVERSATION and c.id != other.parent_id


@pytest.mark.parametrize(("tool", "key"), [("Agent", "prompt"), ("Task", "prompt"),
                                           ("spawn_agent", "message")])
def test_subagent_calls_form_their_own_linked_segment(tool: str, key: str) -> None:
    s = Session("s")
    h = [sys_msg("main agent"), user("find where the parser breaks")]
    task = "Search the repository for read_header and report its callers."
    tc = ToolCall("call_1", tool, json.dumps({"description": "find callers", key: task}))
    spawn = _call(s, h, "", tool_calls=[tc])
    sub_h = [sys_msg("You are a search sub-agent."), user(task)]
    sub1 = _call(s, sub_h, "It is called from parse_file.")
    assert sub1.branch_reason == BranchReason.SUBAGENT and sub1.parent_id == spawn.id
    assert sub1.metadata["link_rule"] == f"tool:{tool}"
    sub_h += [assistant("It is called from parse_file."), user("anything else?")]
    sub2 = _call(s, sub_h, "No.")
    assert sub2.segment_id == sub1.segment_id  # the sub-agent's later calls extend its own
    main = _call(s, [*h, assistant("", [tc]), tool_result("call_1", "It is called from parse_file.")],
                 "The parser breaks in read_header.")
    assert main.segment_id == spawn.segment_id
    s.set_final_reward(1.0)
    rows = export_session(s, "concat", credit="discount", discount=1.0)
    by_seg = {r.segment_id: r for r in rows}
    sub_row = by_seg[sub1.segment_id]
    assert sub_row.metadata["branch_reason"] == "subagent"
    assert sub_row.metadata["parent_segment_id"] == spawn.segment_id
    assert sub_row.turn_rewards == [1.0, 1.0]  # the episode's reward reaches the sub-agent
    assert by_seg[spawn.segment_id].turn_rewards == [1.0, 1.0]


def test_explicit_signal_links_and_names_the_parent() -> None:
    s = Session("s")
    _h, c2 = _work(s)
    sig = signal_from_request({"x-relayrl-link": f"compaction; parent={c2.id}"}, None)
    assert sig == LinkSignal(BranchReason.COMPACTION, c2.id, "header")
    cont = _call(s, [user("Summary of the work so far: line 42.")], "ok", signal=sig)
    assert (cont.branch_reason, cont.parent_id) == (BranchReason.COMPACTION, c2.id)
    assert cont.metadata["link_rule"] == "signal:header"
    # body metadata, and no parent named: the session's last call
    sig2 = signal_from_request({}, {"relayrl_link": "subagent"})
    sub = _call(s, [user("a fresh sub-task for a helper agent")], "ok", signal=sig2)
    assert (sub.branch_reason, sub.parent_id) == (BranchReason.SUBAGENT, cont.id)
    # Codex tags its spawned threads' requests
    assert signal_from_request({"x-openai-subagent": "collab_spawn"}, None) == LinkSignal(
        BranchReason.SUBAGENT, None, "codex_header")
    assert signal_from_request({"x-openai-subagent": "review"}, None) is None
    # an extending call stays in its segment whatever the signal says
    ext = _call(s, [user("a fresh sub-task for a helper agent"), assistant("ok"), user("more")],
                "fine", signal=sig)
    assert ext.branch_reason is None and ext.segment_id == sub.segment_id


def test_bad_signals_are_clear_errors() -> None:
    with pytest.raises(InvalidRequest, match="link must be one of"):
        signal_from_request({"x-relayrl-link": "summary"}, None)
    with pytest.raises(InvalidRequest, match="unknown link parameter"):
        signal_from_request({"x-relayrl-link": "compaction; to=x"}, None)
    s = Session("s")
    _work(s)
    with pytest.raises(InvalidRequest, match="not a call of this session"):
        s.locate(Conversation((user("x"),)), LinkSignal(BranchReason.COMPACTION, "nope", "header"))


def test_linked_segments_survive_the_log_round_trip() -> None:
    s = Session("s")
    h, _ = _work(s)
    writer = _call(s, [*h, user(CODEX_COMPACT)], SUMMARY)
    cont = _call(s, [user(CODEX_PREFIX + SUMMARY)], "ok")
    back = Interaction.from_dict(json.loads(json.dumps(cont.to_dict())))
    assert back == cont and back.branch_reason == BranchReason.COMPACTION
    assert back.parent_id == writer.id
