"""Parsers for what a model writes: reasoning, tool calls and visible content, whole or streamed.

Recognized forms:
- `<think>…</think>` anywhere (several allowed) is reasoning; a reply that starts inside reasoning
  (the prompt opened `<think>`, as Qwen3-style templates do) has only the closing tag.
- `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes/Qwen), several per reply, with
  text before, between and after them; `arguments` may be an object, a JSON text of one, or absent.
- Bare JSON calls (Qwen2.5 writes those without tags): the text outside reasoning is nothing but
  one or more `{"name": ..., "arguments": ...}` objects separated by whitespace, optionally inside
  one ```` ```json ```` fence. Anything else around them and they stay text: a reply that merely
  shows some JSON must not turn into a call.

Anything malformed (invalid JSON, no string "name", an unclosed `<tool_call>`) stays as content
text, verbatim; parsing never raises. Content and reasoning are stripped of surrounding whitespace.
Tool-call ids are generated (`call_` + random hex) and arguments re-serialized as compact JSON.

`parse_reply` works on the whole text; `StreamingReplyParser` gives the same result for any split of
the text into deltas. Its tradeoff is latency: it holds back only what could still turn into a tag
(the longest suffix that is a prefix of `<think>`, `</think>` or `<tool_call>`), trailing whitespace
(it may end up stripped), a whole `<tool_call>` until its closing tag, and, when the reply starts
with `{` or a backtick, the text for as long as it could still be a sequence of bare calls. Bare
calls are therefore only emitted at `finish()`: until the reply ends, more text could follow them.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from relayrl.chat.conversation import (
    ContentDelta,
    ParsedReply,
    ReasoningDelta,
    ReplyDelta,
    ToolCall,
    ToolCallDelta,
)
from relayrl.errors import RelayError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FENCE, FENCE_LANG = "```", "json"

_Call = tuple[str, str]
"""(name, compact JSON arguments) of a recognized call."""


def new_call_id() -> str:
    """A fresh tool-call id in OpenAI's style."""
    return "call_" + secrets.token_hex(12)


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an opened `<think>` (the reply starts in reasoning)."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


def reply_starts_in_reasoning(text: str) -> bool:
    """Whether a whole reply starts inside reasoning: a `</think>` comes before any `<think>`."""
    close = text.find(THINK_CLOSE)
    if close < 0:
        return False
    opening = text.find(THINK_OPEN)
    return opening < 0 or close < opening


def _call_from_obj(obj: Any, require_arguments: bool) -> _Call | None:
    """A call from a parsed JSON value, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if "arguments" not in obj:
        if require_arguments:
            return None
        args: Any = {}
    else:
        args = obj["arguments"]
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False, separators=(",", ":"))


def _call_from_text(text: str) -> _Call | None:
    """A call from the JSON text inside `<tool_call>` tags, or None if it is not one."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    return _call_from_obj(obj, require_arguments=False)


# ---------------------------------------------------------------------------------------------
# Whole-text parsing.


def parse_reply(text: str, starts_in_reasoning: bool | None = None) -> ParsedReply:
    """Split a model's output into content, reasoning and tool calls.

    `starts_in_reasoning`: whether the prompt opened `<think>`; None guesses it from the text
    (a `</think>` before any `<think>`, see `reply_starts_in_reasoning`).
    """
    inside = reply_starts_in_reasoning(text) if starts_in_reasoning is None else starts_in_reasoning
    reasoning, outside, saw_think = _split_think(text, inside)
    bare = _bare_calls(outside)
    if bare is not None:
        content, calls = "", bare
    else:
        content, calls = _tagged_calls(outside)
    return ParsedReply(
        content=content.strip(),
        reasoning=reasoning.strip() if saw_think else None,
        tool_calls=tuple(ToolCall(id=new_call_id(), name=n, arguments=a) for n, a in calls),
    )


def _split_think(text: str, inside: bool) -> tuple[str, str, bool]:
    """(reasoning text, text outside reasoning, whether there was any reasoning block)."""
    parts: dict[bool, list[str]] = {True: [], False: []}
    saw, pos = inside, 0
    while pos < len(text):  # pos grows every round
        tag = THINK_CLOSE if inside else THINK_OPEN
        j = text.find(tag, pos)
        if j < 0:
            parts[inside].append(text[pos:])
            break
        parts[inside].append(text[pos:j])
        pos, inside, saw = j + len(tag), not inside, True
    return "".join(parts[True]), "".join(parts[False]), saw


def _tagged_calls(text: str) -> tuple[str, list[_Call]]:
    """(content with recognized `<tool_call>` blocks removed, the calls)."""
    content: list[str] = []
    calls: list[_Call] = []
    pos = 0
    while True:  # pos grows every round
        i = text.find(CALL_OPEN, pos)
        j = text.find(CALL_CLOSE, i + len(CALL_OPEN)) if i >= 0 else -1
        if j < 0:
            content.append(text[pos:])
            return "".join(content), calls
        call = _call_from_text(text[i + len(CALL_OPEN):j])
        if call is None:
            content.append(text[pos:j + len(CALL_CLOSE)])
        else:
            content.append(text[pos:i])
            calls.append(call)
        pos = j + len(CALL_CLOSE)


def _bare_calls(text: str) -> list[_Call] | None:
    """The calls if `text` is nothing but bare JSON calls (optionally in one fence), else None."""
    s = text.strip()
    if s.startswith(FENCE):
        if len(s) < 2 * len(FENCE) or not s.endswith(FENCE):
            return None
        s = s[len(FENCE):-len(FENCE)]
        if s.startswith(FENCE_LANG):
            s = s[len(FENCE_LANG):]
    decoder = json.JSONDecoder()
    calls: list[_Call] = []
    i = 0
    while True:  # i grows every round
        while i < len(s) and s[i].isspace():
            i += 1
        if i == len(s):
            return calls or None
        if s[i] != "{":
            return None
        try:
            obj, i = decoder.raw_decode(s, i)
        except json.JSONDecodeError:
            return None
        call = _call_from_obj(obj, require_arguments=True)
        if call is None:
            return None
        calls.append(call)


# ---------------------------------------------------------------------------------------------
# Streaming.


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class _Trim:
    """Emits a channel's text stripped of leading and trailing whitespace, as it streams."""

    def __init__(self) -> None:
        self.started = False
        self.pending = ""
        self.emitted: list[str] = []

    def feed(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.pending + text
        body = text.rstrip()
        self.pending = text[len(body):]
        self.emitted.append(body)
        return body


class _ThinkSplitter:
    """Routes text to reasoning (inside `<think>`) or outside, holding back partial tags."""

    def __init__(self, inside: bool) -> None:
        self.inside = inside
        self.saw = inside
        self.held = ""

    def feed(self, text: str) -> list[tuple[bool, str]]:
        """(inside reasoning?, text) pieces that are settled."""
        out: list[tuple[bool, str]] = []
        buf = self.held + text
        while True:  # buf shrinks every round that continues
            tag = THINK_CLOSE if self.inside else THINK_OPEN
            j = buf.find(tag)
            if j < 0:
                break
            out.append((self.inside, buf[:j]))
            buf = buf[j + len(tag):]
            self.inside, self.saw = not self.inside, True
        keep = _partial_tag_len(buf, THINK_CLOSE if self.inside else THINK_OPEN)
        out.append((self.inside, buf[:len(buf) - keep]))
        self.held = buf[len(buf) - keep:]
        return out

    def finish(self) -> list[tuple[bool, str]]:
        held, self.held = self.held, ""
        return [(self.inside, held)]


class _BareScanner:
    """Decides, character by character, whether text is still a possible bare-call sequence.

    The grammar is `_bare_calls`'s: whitespace, optionally ```` ``` ```` + optional `json`, JSON
    objects that are calls separated by whitespace, the closing fence, whitespace.
    """

    def __init__(self) -> None:
        self.state = "start"
        self.fenced = False
        self.ticks = 0
        self.lang = ""
        self.obj: list[str] = []
        self.depth = 0
        self.in_str = False
        self.escaped = False
        self.calls: list[_Call] = []

    @property
    def failed(self) -> bool:
        return self.state == "fail"

    def feed(self, text: str) -> None:
        for c in text:
            if self.state == "fail":
                return
            self._step(c)

    def _step(self, c: str) -> None:
        st = self.state
        if st == "obj":
            self._step_obj(c)
        elif st in ("start", "between"):
            if c.isspace():
                return
            if c == "{":
                self._open_obj()
            elif c == "`" and st == "start":
                self.fenced, self.ticks, self.state = True, 1, "fence"
            elif c == "`" and self.fenced:
                self.ticks, self.state = 1, "close"
            else:
                self.state = "fail"
        elif st == "fence":
            self.ticks += 1
            self.state = ("lang" if self.ticks == len(FENCE) else "fence") if c == "`" else "fail"
        elif st == "lang":
            if len(self.lang) < len(FENCE_LANG) and FENCE_LANG.startswith(self.lang + c):
                self.lang += c
            elif self.lang not in ("", FENCE_LANG):
                self.state = "fail"
            elif c.isspace():
                self.state = "between"
            elif c == "{":
                self._open_obj()
            else:
                self.state = "fail"
        elif st == "close":
            self.ticks += 1
            self.state = ("end" if self.ticks == len(FENCE) else "close") if c == "`" else "fail"
        elif st == "end" and not c.isspace():
            self.state = "fail"

    def _open_obj(self) -> None:
        self.state, self.obj, self.depth = "obj", ["{"], 1
        self.in_str = self.escaped = False

    def _step_obj(self, c: str) -> None:
        self.obj.append(c)
        if self.in_str:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_str = False
            return
        if c == '"':
            self.in_str = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 0:
                self._close_obj()

    def _close_obj(self) -> None:
        try:
            call = _call_from_obj(json.loads("".join(self.obj)), require_arguments=True)
        except json.JSONDecodeError:
            call = None
        if call is None:
            self.state = "fail"
            return
        self.calls.append(call)
        self.state = "between"

    def result(self) -> list[_Call] | None:
        """The calls if the whole text was a bare-call sequence."""
        done = self.state == "end" or (self.state == "between" and not self.fenced)
        return self.calls if done and self.calls else None


class StreamingReplyParser:
    """Incremental `parse_reply`: feed text deltas, get content/reasoning/tool-call deltas.

    For any split of a text into deltas, the concatenated deltas and `result()` equal
    `parse_reply(text, starts_in_reasoning)` (up to generated call ids).
    """

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self._think = _ThinkSplitter(starts_in_reasoning)
        self._bare: _BareScanner | None = _BareScanner()
        self._bare_held: list[str] = []
        self._in_call = False
        self._held = ""
        self._content = _Trim()
        self._reasoning = _Trim()
        self._calls: list[ToolCall] = []
        self._finished = False

    def feed(self, text_delta: str) -> list[ReplyDelta]:
        """Deltas settled by this piece of text, in the order the model wrote them."""
        if self._finished:
            raise RelayError("StreamingReplyParser.feed() after finish()")
        out: list[ReplyDelta] = []
        for inside, piece in self._think.feed(text_delta):
            self._route(inside, piece, out)
        return out

    def finish(self) -> list[ReplyDelta]:
        """Deltas for the rest of the text, once the reply has ended."""
        if self._finished:
            return []
        out: list[ReplyDelta] = []
        for inside, piece in self._think.finish():
            self._route(inside, piece, out)
        if self._bare is not None:
            calls = self._bare.result()
            held = "".join(self._bare_held)
            self._bare, self._bare_held = None, []
            if calls is not None:
                for name, args in calls:
                    self._emit_call(name, args, out)
            else:
                self._outside(held, out)
        tail = (CALL_OPEN if self._in_call else "") + self._held
        self._in_call, self._held = False, ""
        self._emit_content(tail, out)
        self._finished = True
        return out

    def result(self) -> ParsedReply:
        """The whole reply, after `finish()`."""
        if not self._finished:
            raise RelayError("StreamingReplyParser.result() before finish()")
        return ParsedReply(
            content="".join(self._content.emitted),
            reasoning="".join(self._reasoning.emitted) if self._think.saw else None,
            tool_calls=tuple(self._calls),
        )

    def _route(self, inside: bool, piece: str, out: list[ReplyDelta]) -> None:
        if not piece:
            return
        if inside:
            text = self._reasoning.feed(piece)
            if text:
                out.append(ReasoningDelta(text))
        elif self._bare is not None:
            self._bare_held.append(piece)
            self._bare.feed(piece)
            if self._bare.failed:
                held = "".join(self._bare_held)
                self._bare, self._bare_held = None, []
                self._outside(held, out)
        else:
            self._outside(piece, out)

    def _outside(self, text: str, out: list[ReplyDelta]) -> None:
        """Text outside reasoning once bare calls are ruled out: find `<tool_call>` blocks."""
        buf = self._held + text
        while True:  # buf shrinks every round that continues
            if self._in_call:
                j = buf.find(CALL_CLOSE)
                if j < 0:
                    self._held = buf
                    return
                call = _call_from_text(buf[:j])
                if call is None:
                    self._emit_content(CALL_OPEN + buf[:j + len(CALL_CLOSE)], out)
                else:
                    self._emit_call(*call, out)
                buf, self._in_call = buf[j + len(CALL_CLOSE):], False
            else:
                i = buf.find(CALL_OPEN)
                if i < 0:
                    keep = _partial_tag_len(buf, CALL_OPEN)
                    self._emit_content(buf[:len(buf) - keep], out)
                    self._held = buf[len(buf) - keep:]
                    return
                self._emit_content(buf[:i], out)
                buf, self._in_call = buf[i + len(CALL_OPEN):], True

    def _emit_content(self, text: str, out: list[ReplyDelta]) -> None:
        text = self._content.feed(text) if text else ""
        if text:
            out.append(ContentDelta(text))

    def _emit_call(self, name: str, arguments: str, out: list[ReplyDelta]) -> None:
        call = ToolCall(id=new_call_id(), name=name, arguments=arguments)
        out.append(ToolCallDelta(index=len(self._calls), arguments=arguments, id=call.id,
                                 name=name))
        self._calls.append(call)
