"""Incremental detokenization: turn streamed token ids into text deltas that never split a character.

A byte-level BPE token can hold part of a UTF-8 character (an emoji is often 2-4 tokens), and a
SentencePiece decoder treats the first token of a text differently (it drops a leading space).
So the decoder keeps a small window: it decodes `ids[prefix:]` and `ids[prefix:read]` and emits the
difference, holding it back while it ends in U+FFFD (an unfinished character). Joined, the deltas
equal `decode(all ids)`. The tradeoff: each push decodes the window again (a few tokens, usually),
instead of keeping per-tokenizer byte state; this works for every decoder `tokenizers` has.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"


class _Decodes(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDecoder:
    """Text deltas for a growing list of token ids (works with a `Renderer` or a `tokenizers.Tokenizer`)."""

    def __init__(self, tokenizer: _Decodes, skip_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        """Start of the decode window: a point where earlier text is settled."""
        self._read = 0
        """End of the ids whose text has been emitted."""

    def push(self, ids: Sequence[int]) -> str:
        """Add sampled ids; return the text they complete (possibly empty)."""
        self._ids.extend(ids)
        if self._read == len(self._ids):
            return ""
        emitted = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        # A trailing U+FFFD is a character whose remaining bytes are still to come.
        if len(text) <= len(emitted) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(emitted):]

    def flush(self) -> str:
        """The text still held back (an unfinished character is emitted as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        emitted = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(emitted):]

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""
