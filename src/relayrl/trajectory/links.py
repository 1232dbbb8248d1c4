"""Links between segments: compaction and sub-agents (docs/compaction.md).

A call whose messages cannot extend a stored call opens a new segment. Two kinds of such calls
still continue the episode's work, and are linked to the stored call they continue, so that
credit flows along the link and the viewer and the ATIF export can show it:

- **compaction** (`BranchReason.COMPACTION`): the messages replace earlier turns with a summary
  that a stored call wrote (its reply re-sent as input). The summary-writing call becomes the new
  segment's parent; its tokens are trained once, as that call's output, and the summary text in
  the new prompt is prompt (loss mask 0).
- **sub-agent** (`BranchReason.SUBAGENT`): a new conversation that a stored call started with a
  sub-agent tool call (Claude Code's `Agent`/`Task`, Codex's `spawn_agent`). The spawning call is
  the parent.

Detection, in the order 1, 4, 2, 3 (a later summarisation request also holds the earlier
summary, so rule 4 goes before rule 2); the first that applies wins, and the rule's name is
recorded on the call as `metadata["link_rule"]` and on the segment as `Segment.link_rule`:

1. An explicit signal: the `X-RelayRL-Link` header (`compaction` or `subagent`, optionally
   `; parent=<interaction id>`), the same in the body's `metadata` (`relayrl_link`,
   `relayrl_link_parent`), Codex's `x-openai-subagent` header (`collab_spawn` -> sub-agent,
   `compact` -> compaction), or opencode's `x-parent-session-id` header (set on every call of a
   child session, which its `task` tool opens: sub-agent). Without a named parent, the call
   whose sub-agent tool call holds the new conversation's prompt (rule 3), else the session's
   last recorded call.
2. Copied summary: a message holds at least half of the substantial lines of the reply of a
   stored call that was a summarisation request (rule `copied_reply`; opencode re-sends its
   summary as the assistant's answer to "What did we do so far?", the others as input), or a
   non-assistant message does so for any stored call and holds a CLI's continuation prefix (rule
   `summary_prefix:codex` / `summary_prefix:claude_code`). The most recent such call is the
   parent. (A reply handed to another agent without either mark is a handoff, not a summary.)
3. Sub-agent tool call: a user message before the first assistant turn holds the prompt argument
   of a sub-agent tool call in a stored call's reply (rule `tool:<name>`).
4. A summarisation request that re-renders the history under another system prompt (Claude
   Code's compaction call): linked to the stored call whose non-system messages + reply are the
   longest prefix of its own (rule `summary_request:<which>`). One that writes the history out as
   text in a single message (opencode's): linked to the most recent stored call the text quotes
   (its reply's substantial lines, a tool call as `name({compact JSON arguments})`, or its first
   user turn as `[User]: ...`).

A call recognised as a summarisation request (rule 4's markers) is marked
`metadata["compaction"] = "summary_request:<which>"` wherever it lands, so exports and the viewer
can tell the summary-writing calls apart.

May import: `relayrl.chat.conversation`, `relayrl.errors` and `relayrl.trajectory.records`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from relayrl.chat.conversation import Conversation, Message
from relayrl.errors import InvalidRequest
from relayrl.trajectory.records import BranchReason, Interaction

LINK_HEADER = "x-relayrl-link"
"""Request header an agent sets on a call that compacts or starts a sub-agent."""
LINK_METADATA_KEY = "relayrl_link"
"""The same signal as a key of the request body's `metadata` (OpenAI / Anthropic bodies)."""
LINK_PARENT_METADATA_KEY = "relayrl_link_parent"
"""Body `metadata` key naming the interaction id the call continues (optional)."""
CODEX_SUBAGENT_HEADER = "x-openai-subagent"
"""Codex tags the requests of its sub-agent threads with this header (codex-rs
`SessionSource::SubAgent`: `collab_spawn` for `spawn_agent` threads, `compact`, `review`, ...)."""

REQUEST_LINK_KEY = "relayrl_link_signal"
"""Where the gateway keeps a call's parsed signal in the request's metadata."""
COMPACTION_KEY = "compaction"
"""Call metadata key marking a summarisation request (`summary_request:<which>`)."""
LINK_RULE_KEY = "link_rule"
"""Call metadata key naming the rule that linked a compaction or sub-agent segment."""

OPENCODE_PARENT_HEADER = "x-parent-session-id"
"""opencode sets this header (the parent session's id) on the calls of a child session: the
sessions its `task` tool opens for a sub-agent (opencode 1.x `session/llm`; with
`x-session-affinity` and `X-Session-Id` naming the session itself)."""

_LINK_VALUES = {"compaction": BranchReason.COMPACTION, "subagent": BranchReason.SUBAGENT}
_CODEX_SUBAGENT_VALUES = {"collab_spawn": BranchReason.SUBAGENT, "compact": BranchReason.COMPACTION}

# The summarisation requests the CLIs send, matched by a fixed sentence of their prompt:
# - Codex (codex-rs `core/templates/compact/prompt.md`, the local compaction task; the text is in
#   the 0.171.0 binary): "You are performing a CONTEXT CHECKPOINT COMPACTION. ..."
# - Claude Code (2.1.197 `cli.js`, its compact prompt builder): "Your task is to create a detailed
#   summary of the conversation so far" (full compaction) and "... of the RECENT portion of the
#   conversation" (partial compaction).
# - opencode (1.18.33 binary, its compaction agent): the history written out inside
#   `<conversation>` tags, then "Create a new anchored summary ..." (first compaction) or, with the
#   previous summary in `<prior-summary>` tags, "The <prior-summary> summarizes ..." (later ones).
SUMMARY_REQUEST_MARKERS: tuple[tuple[str, str], ...] = (
    ("codex", "You are performing a CONTEXT CHECKPOINT COMPACTION."),
    ("claude_code", "Your task is to create a detailed summary of the conversation so far"),
    ("claude_code", "Your task is to create a detailed summary of the RECENT portion of the "
                    "conversation"),
    ("opencode", "Create a new anchored summary from the conversation history in the "
                 "<conversation> tags above"),
    ("opencode", "The <prior-summary> summarizes everything that happened before the "
                 "<conversation>."),
)
"""(which, sentence): a message holding the sentence makes the call a summarisation request."""

# The prefixes the CLIs put before the summary in the compacted history:
# - Codex (codex-rs `core/templates/compact/summary_prefix.md`, 0.171.0 binary).
# - Claude Code (2.1.197: the user message that opens the continued conversation; the summary
#   follows with `<analysis>` dropped and `<summary>` turned into "Summary:").
SUMMARY_PREFIXES: tuple[tuple[str, str], ...] = (
    ("codex", "Another language model started to solve this problem and produced a summary of "
              "its thinking process."),
    ("claude_code", "This session is being continued from a previous conversation that ran out "
                    "of context."),
)
"""(which, prefix) of the message that carries a summary in a compacted history."""

SUBAGENT_TOOLS: Mapping[str, str] = {
    "Agent": "prompt",  # Claude Code 2.x (`AgentInput` in sdk-tools.d.ts: description, prompt)
    "Task": "prompt",  # Claude Code 1.x named the same tool Task
    "spawn_agent": "message",  # Codex multi-agent (codex-rs tools/handlers/multi_agents.rs)
    "task": "prompt",  # opencode (`TaskTool`: description, prompt, subagent_type, task_id)
}
"""Sub-agent tool name -> the argument that becomes the sub-agent's first user message."""

MIN_COPIED_LINE = 12
"""Reply lines shorter than this (characters, stripped) are not evidence of copying."""
MIN_SUBAGENT_PROMPT = 8
"""A sub-agent prompt shorter than this is too generic to identify its spawning call."""


@dataclass(frozen=True)
class LinkSignal:
    """An explicit signal that a call compacts or starts a sub-agent."""

    reason: BranchReason
    parent_id: str | None
    source: str
    """Where it came from: `header`, `metadata`, `codex_header` or `opencode_header`."""

    def to_dict(self) -> dict[str, Any]:
        """JSON form (kept in the request's metadata)."""
        return {"reason": str(self.reason), "parent_id": self.parent_id, "source": self.source}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LinkSignal:
        """Inverse of `to_dict`."""
        parent = d.get("parent_id")
        return cls(BranchReason(d["reason"]), None if parent is None else str(parent),
                   str(d["source"]))


@dataclass(frozen=True)
class Link:
    """A new segment's link to the stored call it continues."""

    reason: BranchReason
    parent: Interaction
    rule: str


def _parse_link_value(value: str, source: str) -> LinkSignal:
    head, _, rest = value.partition(";")
    kind = head.strip().lower()
    if kind not in _LINK_VALUES:
        raise InvalidRequest(f"{source}: link must be one of {sorted(_LINK_VALUES)}, got {kind!r}")
    parent: str | None = None
    for part in rest.split(";"):
        key, _, val = part.partition("=")
        if key.strip().lower() == "parent" and val.strip():
            parent = val.strip()
        elif part.strip():
            raise InvalidRequest(f"{source}: unknown link parameter {part.strip()!r}")
    return LinkSignal(_LINK_VALUES[kind], parent, source)


def signal_from_request(headers: Mapping[str, str],
                        body_metadata: Mapping[str, Any] | None) -> LinkSignal | None:
    """The explicit link signal of a request (header, body metadata, then Codex's, opencode's)."""
    value = headers.get(LINK_HEADER)
    if value:
        return _parse_link_value(value, "header")
    meta = body_metadata or {}
    if isinstance(meta.get(LINK_METADATA_KEY), str) and meta[LINK_METADATA_KEY]:
        sig = _parse_link_value(meta[LINK_METADATA_KEY], "metadata")
        parent = meta.get(LINK_PARENT_METADATA_KEY)
        return LinkSignal(sig.reason, str(parent) if parent else sig.parent_id, "metadata")
    codex = (headers.get(CODEX_SUBAGENT_HEADER) or "").strip().lower()
    if codex in _CODEX_SUBAGENT_VALUES:
        return LinkSignal(_CODEX_SUBAGENT_VALUES[codex], None, "codex_header")
    if (headers.get(OPENCODE_PARENT_HEADER) or "").strip():
        return LinkSignal(BranchReason.SUBAGENT, None, "opencode_header")
    return None


def summary_request(conv: Conversation) -> str | None:
    """`summary_request:<which>` when the call asks for a summary of the conversation."""
    for m in reversed(conv.messages):
        if m.role == "assistant":
            break  # the request is the latest turn: an older one was an earlier compaction
        for which, marker in SUMMARY_REQUEST_MARKERS:
            if marker in m.content:
                return f"summary_request:{which}"
    return None


def _reply_lines(c: Interaction) -> list[str]:
    text = c.reply.content
    # Claude Code keeps only the <summary> block of its summary (the <analysis> is dropped)
    start, end = text.find("<summary>"), text.find("</summary>")
    if 0 <= start < end:
        text = text[start + len("<summary>"):end]
    return [ln.strip() for ln in text.splitlines()
            if len(ln.strip()) >= MIN_COPIED_LINE and not ln.strip().startswith("<")]


def copied_in(c: Interaction, text: str) -> bool:
    """Most (at least half) of the reply's substantial lines occur in `text`."""
    lines = _reply_lines(c)
    if not lines:
        return False
    found = sum(ln in text for ln in lines)
    return found * 2 >= len(lines)


def _prefix_rule(message: Message) -> str:
    for which, prefix in SUMMARY_PREFIXES:
        if prefix in message.content:  # the CLIs may put reminders before it in one message
            return f"summary_prefix:{which}"
    return "copied_reply"


def _copied_summary(calls: Sequence[Interaction], conv: Conversation) -> Link | None:
    inputs = [m for m in conv.messages if m.role != "assistant" and m.content]
    # opencode puts its summary back as the assistant's answer to "What did we do so far?"
    answers = [m for m in conv.messages if m.role == "assistant" and m.content]
    if not inputs and not answers:
        return None
    prefixed = [m for m in inputs if _prefix_rule(m) != "copied_reply"]
    for c in reversed(calls):  # the most recent writer: a later summary supersedes an earlier
        # a reply re-sent is a summary only when its call was asked for one, or the (input)
        # message carries a CLI's summary prefix: a handoff between agents is not a compaction
        candidates = [*inputs, *answers] if COMPACTION_KEY in c.metadata else prefixed
        for m in candidates:
            if copied_in(c, m.content):
                return Link(BranchReason.COMPACTION, c, _prefix_rule(m))
    return None


def _subagent_prompt(arguments: str, key: str) -> str | None:
    try:
        args = json.loads(arguments)
    except ValueError:
        return None
    value = args.get(key) if isinstance(args, dict) else None
    return value.strip() if isinstance(value, str) else None


def _spawning_call(calls: Sequence[Interaction], conv: Conversation) -> Link | None:
    opening: list[str] = []  # the user messages before the first assistant turn
    for m in conv.messages:  # (Codex puts its environment context before the task)
        if m.role == "assistant":
            break
        if m.role == "user":
            opening.append(m.content)
    if not opening:
        return None
    for c in reversed(calls):
        for tc in c.reply.tool_calls:
            # a namespaced tool is rendered `NAMESPACE.NAME` (Codex: `multi_agent_v1.spawn_agent`)
            key = SUBAGENT_TOOLS.get(tc.name) or SUBAGENT_TOOLS.get(tc.name.rsplit(".", 1)[-1])
            if key is None:
                continue
            prompt = _subagent_prompt(tc.arguments, key)
            if prompt and len(prompt) >= MIN_SUBAGENT_PROMPT and any(prompt in t for t in opening):
                return Link(BranchReason.SUBAGENT, c, f"tool:{tc.name}")
    return None


def _non_system(messages: Sequence[Message]) -> list[bytes]:
    return [m.canonical_bytes for m in messages if m.role != "system"]


def _summarised_call(calls: Sequence[Interaction], conv: Conversation) -> Interaction | None:
    """The stored call whose non-system messages + reply are the longest prefix of `conv`'s."""
    mine = _non_system(conv.messages)
    best: Interaction | None = None
    best_n = 0
    for c in calls:
        theirs = _non_system((*c.conversation.messages, c.reply.to_message()))
        n = len(theirs)
        if best_n < n <= len(mine) and mine[:n] == theirs:
            best, best_n = c, n
    return best


def _compact_json(arguments: str) -> str:
    """Tool-call arguments as JavaScript's `JSON.stringify` writes them (opencode's transcript)."""
    try:
        return json.dumps(json.loads(arguments), separators=(",", ":"), ensure_ascii=False)
    except ValueError:
        return arguments


def _quoted(c: Interaction, text: str) -> bool:
    """Whether `text`, a history written out as opencode writes it, quotes `c`: its reply's
    lines, one of its tool calls (`[Assistant tool call]: name({...})`), or its first user turn
    (`[User]: ...`; the turns kept verbatim after a summary are left out of the text)."""
    if copied_in(c, text):
        return True
    if any(f"{tc.name}({_compact_json(tc.arguments)})" in text for tc in c.reply.tool_calls):
        return True
    first = next((m.content for m in c.conversation.messages if m.role == "user"), "")
    return len(first) >= MIN_SUBAGENT_PROMPT and f"[User]: {first}" in text


def _transcribed_call(calls: Sequence[Interaction], conv: Conversation) -> Interaction | None:
    """The most recent stored call that a summarisation request quotes in its text."""
    text = "\n".join(m.content for m in conv.messages if m.role != "assistant")
    return next((c for c in reversed(calls) if _quoted(c, text)), None)


def find_link(calls: Sequence[Interaction], conv: Conversation,
              signal: LinkSignal | None) -> Link | None:
    """The stored call a new segment continues (compaction or sub-agent), by the module's rules.

    `calls` are the session's calls in recording order; the call would otherwise open a segment
    with no parent. An explicit signal naming an unknown parent is a clear error (4xx).
    """
    if not calls:
        return None
    by_id = {c.id: c for c in calls}
    if signal is not None:
        if signal.parent_id is not None:
            parent = by_id.get(signal.parent_id)
            if parent is None:
                raise InvalidRequest(f"link parent {signal.parent_id!r} is not a call of this "
                                     "session")
            return Link(signal.reason, parent, f"signal:{signal.source}")
        found = (_copied_summary(calls, conv) if signal.reason == BranchReason.COMPACTION
                 else _spawning_call(calls, conv))
        if found is not None:  # the signal says what; a rule may still name the exact parent
            return Link(signal.reason, found.parent, f"signal:{signal.source}+{found.rule}")
        return Link(signal.reason, calls[-1], f"signal:{signal.source}")
    rule = summary_request(conv)
    if rule is not None:  # before rule 2: a later request also holds the previous summary
        summarised = _summarised_call(calls, conv) or _transcribed_call(calls, conv)
        if summarised is not None:
            return Link(BranchReason.COMPACTION, summarised, rule)
    copied = _copied_summary(calls, conv)
    if copied is not None:
        return copied
    return _spawning_call(calls, conv)
