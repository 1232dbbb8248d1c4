"""The trajectory records: one recorded call (`Interaction`), the token segments calls form, and
why a call had to open a new segment (`BranchReason`).

Records are frozen and aligned by construction: `output_ids`, `logprobs` and `versions` have one
length, checked in `__post_init__`, so no later stage can drift them apart. A reward that arrives
after the call is stored by replacing the record (`dataclasses.replace`), never by mutating it:
the record stays the one source of truth that the durable log serializes and recovery rebuilds.

The JSON forms (`to_dict` / `from_dict`) carry the full conversation and reply, so a restarted
gateway can rebuild its parent-lookup index from the log alone; the cost is a few KB per call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from relayrl.chat.conversation import Conversation, Message, ParsedReply, Tool, ToolCall

FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "abort"})
"""Values `Interaction.finish_reason` may take (the OpenAI names, plus `abort`)."""

PROMPT_SOURCES = frozenset({"render", "extend"})
"""`render`: the prompt was rendered from the messages alone (a new segment starts);
`extend`: it is the parent's prompt + output + newly rendered turns (same segment)."""


class BranchReason(StrEnum):
    """Why a call opened a new segment instead of extending its parent's tokens."""

    FIRST = "first"
    """The session's first call."""
    NEW_CONVERSATION = "new_conversation"
    """The messages hold no assistant turn: a fresh conversation (or a resample of a first turn)."""
    HISTORY_EDITED = "history_edited"
    """The messages hold assistant turns, but no prefix ending after one matches a stored call
    plus its reply (compaction, rewritten or injected turns)."""
    TOOLS_CHANGED = "tools_changed"
    """The messages extend a stored call, but the tools, tool choice or template kwargs differ,
    so the rendered prefix differs too."""
    PARENT_UNFINISHED = "parent_unfinished"
    """The parent stopped on `length` or `abort`: its tokens lack the end of turn, so the new
    prompt could not extend them."""
    PROMPT_MISMATCH = "prompt_mismatch"
    """The messages extend a stored call, but the new prompt tokens do not start with that
    call's prompt + output (a renderer that cannot extend, or a template that rewrites history)."""
    COMPACTION = "compaction"
    """The messages replace earlier turns with a summary that a stored call wrote: the segment
    continues the one that call belongs to (the call is its parent; docs/compaction.md)."""
    SUBAGENT = "subagent"
    """A sub-agent's conversation, started by a stored call (a Task / spawn_agent tool call, or
    an explicit signal): that call is its parent (docs/compaction.md)."""


class EventKind(StrEnum):
    """Kinds of entries in a session's journal (the durable log replays them in order)."""

    START = "start"
    INTERACTION = "interaction"
    REWARD = "reward"
    """Body: `interaction_id`, `reward`."""
    FINAL_REWARD = "final_reward"
    """Body: `reward` (the trajectory-level reward)."""
    END = "end"
    EXPORTED = "exported"
    """The trainer acknowledged the export: the session need not be recovered."""
    ABORTED = "aborted"
    CALL_ABORTED = "call_aborted"
    """Body: an `AbortedCall` (a call that never finished: its client left before the answer)."""


@dataclass(frozen=True)
class AbortedCall:
    """A call that was cut off before it finished: its client left, so its generation stopped.

    It is kept beside the tree of finished calls, never in it: no later call can extend tokens the
    client never received, and its partial output is never trained on (docs/trajectory-format.md).
    """

    id: str
    """The interaction id the call would have been recorded under."""
    session_id: str
    parent_id: str | None
    """The stored call the request extended (where it would have hung in the tree)."""
    prompt_tokens: int
    output_tokens: int | None
    """Tokens sampled before the generation stopped (None: not counted, a non-streamed call)."""
    reason: str
    """Why it stopped: `client_disconnected`."""
    created: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the journal body)."""
        return {"id": self.id, "session_id": self.session_id, "parent_id": self.parent_id,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "reason": self.reason, "created": self.created}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AbortedCall:
        """Inverse of `to_dict`."""
        out = d.get("output_tokens")
        return cls(id=str(d["id"]), session_id=str(d["session_id"]),
                   parent_id=None if d.get("parent_id") is None else str(d["parent_id"]),
                   prompt_tokens=int(d["prompt_tokens"]),
                   output_tokens=None if out is None else int(out),
                   reason=str(d["reason"]), created=float(d.get("created", 0.0)))


@dataclass(frozen=True)
class Interaction:
    """One recorded call: the request, the exact tokens sampled, and where it sits in the tree."""

    id: str
    session_id: str
    segment_id: str
    parent_id: str | None
    """The stored call whose messages + reply this call's messages extend (None at a root)."""
    conversation: Conversation
    """The request: messages, tools, tool choice, template kwargs."""
    reply: ParsedReply
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """Logprob of each output token under the sampling policy (behaviour logprobs)."""
    versions: tuple[int, ...]
    """Weight version that sampled each output token."""
    finish_reason: str
    """One of `FINISH_REASONS`."""
    prompt_source: str
    """One of `PROMPT_SOURCES`."""
    branch_reason: BranchReason | None = None
    """Set exactly when the call opens a segment (`prompt_source == "render"`)."""
    created: float = 0.0
    """Wall-clock time (`time.time()`) the call was recorded."""
    timings: dict[str, float] = field(default_factory=dict)
    """Engine timings in seconds (queued_s, first_token_s, total_s, ...)."""
    reward: float | None = None
    """The call's own reward (None = not given); credit assignment turns it into a return."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """What the request said beyond the conversation: its wire format, and what was left out
    of the prompt or mapped (hosted tools, tool kinds), JSON values only."""
    role: str | None = None
    """Which agent of the episode made the call (`relayrl.trajectory.roles`); None: no role."""

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"interaction {self.id}: {n} output ids, {len(self.logprobs)} logprobs, "
                f"{len(self.versions)} versions"
            )
        if not self.prompt_ids:
            raise ValueError(f"interaction {self.id}: empty prompt")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"interaction {self.id}: finish_reason {self.finish_reason!r}")
        if self.prompt_source not in PROMPT_SOURCES:
            raise ValueError(f"interaction {self.id}: prompt_source {self.prompt_source!r}")
        if (self.prompt_source == "render") != (self.branch_reason is not None):
            raise ValueError(
                f"interaction {self.id}: a rendered prompt needs a branch reason, "
                "an extended one must not have one"
            )
        if self.prompt_source == "extend" and self.parent_id is None:
            raise ValueError(f"interaction {self.id}: an extended prompt needs a parent")

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Prompt + output: the whole sequence this call leaves behind for its children."""
        return self.prompt_ids + self.output_ids

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (conversation and reply included)."""
        return {
            "id": self.id,
            "session_id": self.session_id,
            "segment_id": self.segment_id,
            "parent_id": self.parent_id,
            "conversation": conversation_to_dict(self.conversation),
            "reply": reply_to_dict(self.reply),
            "prompt_ids": list(self.prompt_ids),
            "output_ids": list(self.output_ids),
            "logprobs": list(self.logprobs),
            "versions": list(self.versions),
            "finish_reason": self.finish_reason,
            "prompt_source": self.prompt_source,
            "branch_reason": None if self.branch_reason is None else str(self.branch_reason),
            "created": self.created,
            "timings": dict(self.timings),
            "reward": self.reward,
            "metadata": dict(self.metadata),
            "role": self.role,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Interaction:
        """Inverse of `to_dict`."""
        reason = d.get("branch_reason")
        return cls(
            id=d["id"],
            session_id=d["session_id"],
            segment_id=d["segment_id"],
            parent_id=d.get("parent_id"),
            conversation=conversation_from_dict(d["conversation"]),
            reply=reply_from_dict(d["reply"]),
            prompt_ids=tuple(int(t) for t in d["prompt_ids"]),
            output_ids=tuple(int(t) for t in d["output_ids"]),
            logprobs=tuple(float(x) for x in d["logprobs"]),
            versions=tuple(int(v) for v in d["versions"]),
            finish_reason=d["finish_reason"],
            prompt_source=d["prompt_source"],
            branch_reason=None if reason is None else BranchReason(reason),
            created=float(d.get("created", 0.0)),
            timings={k: float(v) for k, v in (d.get("timings") or {}).items()},
            reward=None if d.get("reward") is None else float(d["reward"]),
            metadata=dict(d.get("metadata") or {}),
            role=None if d.get("role") is None else str(d["role"]),
        )


@dataclass(frozen=True)
class Segment:
    """Calls whose tokens form one contiguous sequence, each extending the one before.

    The first call's prompt was rendered from its messages; every later call's prompt starts with
    its parent's prompt + output. A segment is a tree when one call has several extending
    children (the agent resampled or forked): each root-to-leaf path is one token sequence.
    """

    id: str
    reason: BranchReason
    """Why the segment was opened."""
    root_id: str
    """The call that opened it."""
    parent_id: str | None
    """The root's parent call in the session tree (in another segment), if any."""
    interaction_ids: tuple[str, ...]
    """Members in recording order (root first)."""
    parent_segment_id: str | None = None
    """The segment of the root's parent call (the segment this one continues or was started
    from: compaction, sub-agent), if any."""
    link_rule: str | None = None
    """For a compaction or sub-agent segment: the rule that linked it (docs/compaction.md)."""


def _message_to_dict(m: Message) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.reasoning is not None:
        d["reasoning"] = m.reasoning
    if m.tool_calls:
        d["tool_calls"] = [_tool_call_to_dict(c) for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        d["name"] = m.name
    return d


def _tool_call_to_dict(c: ToolCall) -> dict[str, str]:
    return {"id": c.id, "name": c.name, "arguments": c.arguments}


def _tool_call_from_dict(d: dict[str, Any]) -> ToolCall:
    return ToolCall(id=d["id"], name=d["name"], arguments=d["arguments"])


def _message_from_dict(d: dict[str, Any]) -> Message:
    return Message(
        role=d["role"],
        content=d.get("content") or "",
        reasoning=d.get("reasoning"),
        tool_calls=tuple(_tool_call_from_dict(c) for c in d.get("tool_calls") or ()),
        tool_call_id=d.get("tool_call_id"),
        name=d.get("name"),
    )


def conversation_to_dict(conv: Conversation) -> dict[str, Any]:
    """A JSON-ready dict of a conversation (template kwargs must be JSON values)."""
    return {
        "messages": [_message_to_dict(m) for m in conv.messages],
        "tools": [
            {"name": t.name, "description": t.description, "parameters": t.parameters}
            for t in conv.tools
        ],
        "tool_choice": conv.tool_choice,
        "template_kwargs": dict(conv.template_kwargs),
    }


def conversation_from_dict(d: dict[str, Any]) -> Conversation:
    """Inverse of `conversation_to_dict`."""
    return Conversation(
        messages=tuple(_message_from_dict(m) for m in d["messages"]),
        tools=tuple(
            Tool(name=t["name"], description=t.get("description", ""),
                 parameters=t.get("parameters") or {})
            for t in d.get("tools") or ()
        ),
        tool_choice=d.get("tool_choice", "auto"),
        template_kwargs=dict(d.get("template_kwargs") or {}),
    )


def reply_to_dict(reply: ParsedReply) -> dict[str, Any]:
    """A JSON-ready dict of a parsed reply."""
    return {
        "content": reply.content,
        "reasoning": reply.reasoning,
        "tool_calls": [_tool_call_to_dict(c) for c in reply.tool_calls],
    }


def reply_from_dict(d: dict[str, Any]) -> ParsedReply:
    """Inverse of `reply_to_dict`."""
    return ParsedReply(
        content=d.get("content") or "",
        reasoning=d.get("reasoning"),
        tool_calls=tuple(_tool_call_from_dict(c) for c in d.get("tool_calls") or ()),
    )


def to_log_dict(c: Interaction, parent: Interaction | None) -> dict[str, Any]:
    """`c.to_dict()`, with what its parent already holds replaced by references.

    A long conversation repeats every earlier message and token in each call; logging them again
    would make the log quadratic in the number of turns. The body keeps only the messages after
    the shared prefix, the prompt tokens after the parent's, and the tools when they changed.
    """
    d = c.to_dict()
    if parent is None or parent.id != c.parent_id:
        return d
    conv = d["conversation"]
    shared = 0
    for mine, theirs in zip(c.conversation.messages, parent.conversation.messages, strict=False):
        if mine != theirs:
            break
        shared += 1
    conv["messages"] = conv["messages"][shared:]
    conv["messages_from_parent"] = shared
    if c.conversation.tools == parent.conversation.tools:
        conv["tools"] = None
        conv["tools_from_parent"] = True
    parent_tokens = parent.token_ids
    if c.prompt_ids[: len(parent_tokens)] == parent_tokens:
        d["prompt_ids"] = d["prompt_ids"][len(parent_tokens):]
        d["prompt_from_parent"] = len(parent_tokens)
    return d


def from_log_dict(d: dict[str, Any], parent: Interaction | None) -> Interaction:
    """Inverse of `to_log_dict` (`parent` is the record named by `d["parent_id"]`)."""
    conv = dict(d["conversation"])
    d = {**d, "conversation": conv}
    shared = int(conv.pop("messages_from_parent", 0))
    from_parent_tools = bool(conv.pop("tools_from_parent", False))
    prompt_shared = int(d.pop("prompt_from_parent", 0))
    if (shared or from_parent_tools or prompt_shared) and parent is None:
        raise ValueError(f"interaction {d.get('id')}: log entry refers to a missing parent")
    if parent is not None:
        prefix = conversation_to_dict(parent.conversation)
        conv["messages"] = prefix["messages"][:shared] + list(conv["messages"])
        if from_parent_tools:
            conv["tools"] = prefix["tools"]
        d["prompt_ids"] = list(parent.token_ids[:prompt_shared]) + list(d["prompt_ids"])
    return Interaction.from_dict(d)
