"""The durable log: every session event appended to SQLite (WAL mode) before the gateway replies,
and replayed to rebuild unexported sessions after a restart.

One table of events (session start, each finished call, each call cut off before it finished,
rewards, end, export acknowledgement, abort) in append order. Each append is one small transaction through a cached prepared
statement. With `synchronous="NORMAL"` (the default) a committed append survives a crash of the
process, at ~tens of microseconds; `"FULL"` also survives power loss, at an fsync per append.
A call's entry stores only what its parent does not already hold (see
`records.to_log_dict`), so the log grows with the tokens of a session, not with turns squared.

Recovery replays events through the same `Session` methods the gateway uses, so every invariant
is checked again; an entry that cannot be decoded or applied (a torn or corrupt write) is
skipped and counted, and never costs the entries before it.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relayrl.errors import InvalidRequest, RelayError, Unavailable
from relayrl.trajectory.records import AbortedCall, EventKind, from_log_dict
from relayrl.trajectory.session import Session, SessionState

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY,  -- rowid: append order (no AUTOINCREMENT: one page less per append)
    session_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    body TEXT NOT NULL,
    at REAL NOT NULL
)
"""
_INSERT = "INSERT INTO events (session_id, kind, body, at) VALUES (?, ?, ?, ?)"
_SELECT = "SELECT seq, session_id, kind, body FROM events ORDER BY seq"
_COMPACT = (
    "DELETE FROM events WHERE session_id IN "
    "(SELECT session_id FROM events WHERE kind IN (?, ?))"
)


BUSY_TIMEOUT_S = 0.2
"""How long an append waits for a lock another process holds on the log before giving up with
`Unavailable` (a 503): the append runs on the gateway's event loop, so a long wait would stall
every session (SQLite's default is 5 s)."""


class InteractionLog:
    """Append-only SQLite log of session events; a `SessionJournal` for `Session`."""

    def __init__(self, path: str | Path, *, synchronous: str = "NORMAL",
                 busy_timeout_s: float = BUSY_TIMEOUT_S) -> None:
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"synchronous must be OFF, NORMAL, FULL or EXTRA, not {synchronous!r}")
        self.path = Path(path)
        # autocommit (isolation_level=None): each INSERT is exactly one transaction
        self._conn = sqlite3.connect(str(self.path), isolation_level=None,
                                     check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute(f"PRAGMA synchronous={synchronous.upper()}")
        self._conn.execute(_SCHEMA)
        # opening may wait SQLite's usual 5 s for a lock; serving calls may not
        self._conn.execute(f"PRAGMA busy_timeout={max(0, int(busy_timeout_s * 1000))}")
        self._lock = threading.Lock()  # cheap insurance should a thread-pool route append
        self.skipped = 0
        """Entries the last `recover` could not decode or apply."""

    def append(self, session_id: str, kind: EventKind, body: dict[str, Any]) -> None:
        """Persist one event (one transaction); raises RelayError if it cannot."""
        try:
            text = json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
            with self._lock:
                self._conn.execute(_INSERT, (session_id, str(kind), text, time.time()))
        except (ValueError, TypeError) as exc:
            # NaN, or a lone surrogate SQLite cannot encode (UnicodeEncodeError is a ValueError):
            # the event is refused whole, nothing was written
            raise InvalidRequest(f"cannot record this event: {exc}") from None
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise Unavailable("the durable log is locked by another process; "
                                  "try again shortly") from exc
            raise RelayError(f"durable log write failed: {exc}") from exc
        except sqlite3.Error as exc:
            raise RelayError(f"durable log write failed: {exc}") from exc

    def recover(
        self, *, include_closed: bool = False, clock: Callable[[], float] = time.time
    ) -> list[Session]:
        """Rebuild sessions from the log: OPEN and ENDED ones (all with `include_closed`)."""
        sessions: dict[str, Session] = {}
        self.skipped = 0
        with self._lock:
            cursor = self._conn.execute(_SELECT)
            for seq, session_id, kind, body in cursor:
                try:
                    _apply(sessions, session_id, kind, json.loads(body), clock)
                except (RelayError, KeyError, TypeError, ValueError) as exc:
                    # json.JSONDecodeError is a ValueError: torn or corrupt rows land here
                    self.skipped += 1
                    log.warning("durable log: skipped entry %d (%s, %s): %s",
                                seq, session_id, kind, exc)
        live = (SessionState.OPEN, SessionState.ENDED)
        return [s for s in sessions.values() if include_closed or s.state in live]

    def compact(self) -> int:
        """Delete the events of exported and aborted sessions; returns how many went."""
        with self._lock:
            cur = self._conn.execute(_COMPACT, (str(EventKind.EXPORTED), str(EventKind.ABORTED)))
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return cur.rowcount

    def __len__(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM events").fetchone()[0])

    def close(self) -> None:
        """Close the database (checkpoints the WAL)."""
        with self._lock:
            self._conn.close()

    def __enter__(self) -> InteractionLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _apply(
    sessions: dict[str, Session],
    session_id: str,
    kind: str,
    body: dict[str, Any],
    clock: Callable[[], float],
) -> None:
    """Replay one event onto the sessions rebuilt so far."""
    if kind == EventKind.START:
        if session_id in sessions:
            raise ValueError(f"session {session_id} started twice")
        sessions[session_id] = Session(
            body["id"], body.get("task_id"), body.get("metadata"),
            key_hash=bytes.fromhex(body["key_hash"]), created=float(body["created"]),
            clock=clock,
        )
        return
    session = sessions.get(session_id)
    if session is None:
        raise KeyError(f"event for unknown session {session_id}")
    if kind == EventKind.INTERACTION:
        parent_id = body.get("parent_id")
        parent = session.get(parent_id) if parent_id else None
        session.record(from_log_dict(body, parent))
    elif kind == EventKind.CALL_ABORTED:
        session.record_aborted(AbortedCall.from_dict(body))
    elif kind == EventKind.REWARD:
        session.set_reward(body["interaction_id"], body["reward"])
    elif kind == EventKind.FINAL_REWARD:
        session.set_final_reward(body["reward"], role=body.get("role"))
    elif kind == EventKind.END:
        session.end()
    elif kind == EventKind.EXPORTED:
        session.mark_exported()
    elif kind == EventKind.ABORTED:
        session.abort()
    else:
        raise ValueError(f"unknown event kind {kind!r}")
