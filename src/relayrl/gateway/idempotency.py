"""Idempotent retries: a completion retried with the same `Idempotency-Key` gets its recorded answer.

Some SDKs and proxies resend a call (after a timeout or a dropped connection) with the header
`Idempotency-Key`; without this the session would record the call twice and train on both. The
first call with a key claims a slot; its answer (the wire-neutral `Completion`, plus the rendered
body of a non-streamed reply) is kept, and a retry with the same key and the same body gets that
answer again (a stream is replayed as a stream) while nothing new is sampled or recorded.

Rules (docs/protocol.md): keys are scoped to the calling session (the cache is keyed by session id
and a digest of the key, and only session calls use it: an unrecorded call has nothing to replay
and no scope); a retry while the first call still runs waits for it (up to `WAIT_S`, then 409);
if the first call did not finish (its client left, it failed) the retry runs afresh; the same key
with another body is a 422. Memory is bounded: at most `MAX_ENTRIES` answers (least recently used
go first), and an entry dies with its session (held through a weak reference, skipped once the
session is closed or gone). Key values are never stored or logged, only their sha256.

May import: `relayrl.chat.completion`, `relayrl.errors`, `relayrl.trajectory` (no FastAPI).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from relayrl.chat.completion import Completion
from relayrl.errors import InvalidRequest, SessionClosed
from relayrl.trajectory import Session

HEADER = "idempotency-key"
MAX_KEY_CHARS = 255
"""Longest key accepted (UUIDs and the SDKs' `stainless-python-retry-...` keys are far shorter)."""
MAX_ENTRIES = 1024
"""Answers kept at most, over all sessions (each holds one reply's text and ids)."""
WAIT_S = 300.0
"""How long a retry waits for the first call with its key before answering 409."""


class IdempotencyMismatch(InvalidRequest):
    """The key was used before with a different request body."""

    status_code = 422


class IdempotencyInFlight(SessionClosed):
    """The first call with this key is still running after the wait."""


@dataclass
class Answer:
    """What a finished call answered: replayed to a retry."""

    completion: Completion
    payload: dict[str, Any] | None = None
    """The rendered body of a non-streamed reply (None for a stream: it is re-encoded)."""


@dataclass
class Slot:
    """One key's entry: running until `answer` is set or the slot is released."""

    session: weakref.ref[Session]
    fingerprint: bytes
    done: asyncio.Event = field(default_factory=asyncio.Event)
    answer: Answer | None = None
    released: bool = False


def read_key(headers: Any) -> str | None:
    """The request's `Idempotency-Key`, checked (400 when empty, too long or not printable)."""
    key = headers.get(HEADER)
    if key is None:
        return None
    if not 0 < len(key) <= MAX_KEY_CHARS or not key.isascii() or not key.isprintable():
        raise InvalidRequest(f"Idempotency-Key must be 1 to {MAX_KEY_CHARS} printable ASCII "
                             "characters")
    return key


def fingerprint(wire: str, body: Any) -> bytes:
    """Digest of what the call asks for: its wire and its JSON body (key order ignored)."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{wire}\n{text}".encode()).digest()


class IdempotencyCache:
    """Answers by (session, key digest), bounded and scoped per session (module docstring)."""

    def __init__(self, max_entries: int = MAX_ENTRIES, wait_s: float = WAIT_S) -> None:
        self.max_entries, self.wait_s = max_entries, wait_s
        self._slots: OrderedDict[tuple[str, bytes], Slot] = OrderedDict()
        self.replayed = 0

    def __len__(self) -> int:
        return len(self._slots)

    async def claim(self, session: Session, key: str, print_: bytes) -> Slot | Answer:
        """The recorded `Answer` for a retry, else a `Slot` this call now owns (release it)."""
        k = (session.id, hashlib.sha256(key.encode()).digest())
        deadline = asyncio.get_running_loop().time() + self.wait_s
        for _ in range(64):  # a slot released by a failed first call lets the next one claim
            slot = self._slots.get(k)
            if slot is not None and (slot.released or slot.session() is not session):
                del self._slots[k]
                slot = None
            if slot is None:
                slot = Slot(weakref.ref(session), print_)
                self._slots[k] = slot
                self._trim()
                return slot
            if slot.fingerprint != print_:
                raise IdempotencyMismatch(
                    "this Idempotency-Key was used with a different request body; "
                    "send a new key for a new call")
            if slot.answer is not None:
                self._slots.move_to_end(k)
                self.replayed += 1
                return slot.answer
            left = deadline - asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(asyncio.shield(slot.done.wait()), max(0.0, left))
            except TimeoutError:
                raise IdempotencyInFlight(
                    "a call with this Idempotency-Key is still running; retry later") from None
        raise IdempotencyInFlight("a call with this Idempotency-Key keeps failing; use a new key")

    def fulfil(self, slot: Slot, answer: Answer) -> None:
        """The call finished: keep its answer for retries and wake those waiting."""
        slot.answer = answer
        slot.done.set()

    def release(self, slot: Slot) -> None:
        """The call did not finish (no answer to replay): a waiting retry runs it afresh."""
        if slot.answer is None:
            slot.released = True
            slot.done.set()

    def _trim(self) -> None:
        # drop answers of closed or forgotten sessions from the oldest end, then the oldest
        # beyond the bound (a running call's slot may go too: its owner and waiters keep it)
        for k in list(self._slots)[:8]:
            s = self._slots[k].session()
            if s is None or not s.is_open:
                del self._slots[k]
        while len(self._slots) > self.max_entries:
            self._slots.popitem(last=False)
