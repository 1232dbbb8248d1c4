"""The gateway's live sessions: bounded in number, with idle expiry, lookup by key, and the
staleness rule (`relayrl.trajectory.staleness.StalenessGate`, counted in sessions) behind
`grant_capacity`.

Aborted sessions give their slot back (as the rollout controller's groups do); exported
sessions keep it (they became training rows). Every state has a bounded lifetime, so a gateway
that runs for days under any client holds a bounded number of sessions: open ones idle past
`ttl_s` and ended-but-unexported ones idle past `ended_ttl_s` are aborted, and closed ones
(exported or aborted) are forgotten `ttl_s` after they closed. `trajectory` keeps what a session *is* (`Session`,
its tree, records, credit, export); this module keeps what the gateway needs to serve many.

May import: `relayrl.errors` and `relayrl.trajectory` (no FastAPI, no engine, no torch).
"""

from __future__ import annotations

import hmac
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from relayrl.errors import AuthenticationFailed, CapacityExhausted, InvalidRequest, NotFound
from relayrl.trajectory.session import Session, SessionJournal, SessionState, hash_key
from relayrl.trajectory.staleness import StalenessGate


class SessionStore:
    """Live sessions, bounded in number, with idle expiry, key lookup and the staleness rule.

    Idle OPEN sessions expire after `ttl_s` and become ABORTED (never a zero reward); ENDED
    sessions nobody exported expire the same way after `ended_ttl_s` (a trainer collects them
    within seconds, so this only catches sessions no trainer will take). Closed sessions stay
    `ttl_s` after closing (a late caller learns the session closed) and are then forgotten. When
    full, expired, exported and aborted sessions are evicted first; if every slot still holds a
    session with unexported calls, `start_session` refuses (CapacityExhausted) rather than drop
    data.
    """

    def __init__(
        self,
        ttl_s: float = 900.0,
        max_sessions: int = 10_000,
        log: SessionJournal | None = None,
        clock: Callable[[], float] = time.time,
        ended_ttl_s: float = 6 * 3600.0,
    ) -> None:
        if ttl_s <= 0 or max_sessions <= 0 or ended_ttl_s <= 0:
            raise InvalidRequest("ttl_s, ended_ttl_s and max_sessions must be > 0")
        self.ttl_s = ttl_s
        self.ended_ttl_s = ended_ttl_s
        self.max_sessions = max_sessions
        self.log = log
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._by_key: dict[bytes, str] = {}
        # Sessions started here (adopted ones included) run until aborted (slot given back) or
        # acknowledged (accepted); the rule's parameters come with each grant_capacity.
        self.gate = StalenessGate(batch_size=1, max_staleness=0)
        self._version: int | None = None  # None: no staleness rule given yet
        # Totals since start: closed sessions are forgotten, so their count lives here.
        self.totals: Counter[str] = Counter()
        self.on_forget: list[Callable[[Session], None]] = []
        """Called with each session as it is forgotten (who keeps something per session)."""

    @property
    def submitted(self) -> int:
        """Sessions the staleness rule counts: started or adopted, less the aborted ones."""
        return self.gate.submitted

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def grant_capacity(self, version: int, max_staleness: int, batch_size: int) -> int:
        """How many more sessions may start: submitted <= (version + max_staleness + 1) * batch.

        The rule given here stays in force for `start_session` until the next call.
        """
        if version < 0 or max_staleness < 0 or batch_size < 1:
            raise InvalidRequest(
                f"need version >= 0, max_staleness >= 0, batch_size >= 1; got "
                f"{version}, {max_staleness}, {batch_size}"
            )
        self.gate.set_rule(max_staleness, batch_size)
        self._version = version
        return self._room()

    def _room(self) -> int:
        if self._version is None:
            return self.max_sessions  # no staleness rule given: only memory bounds us
        return self.gate.capacity(self._version)

    def start_session(
        self,
        task_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        *,
        session_id: str | None = None,
        api_key: str | None = None,
    ) -> Session:
        """Open a new session (journaled); raises CapacityExhausted when none may start."""
        if self._room() <= 0:
            raise CapacityExhausted(
                f"staleness limit reached: {self.submitted} sessions submitted under "
                f"(version, max_staleness, batch_size) = "
                f"{(self._version, self.gate.max_staleness, self.gate.batch_size)}"
            )
        sid = session_id or f"sess-{uuid.uuid4().hex}"
        if sid in self._sessions:
            raise InvalidRequest(f"session {sid} already exists")
        if api_key is not None and hash_key(api_key) in self._by_key:
            # else the key would silently move to the new session (and its calls with it)
            raise InvalidRequest("api_key is already held by another session; choose another")
        self._make_room()
        session = Session(sid, task_id, metadata, api_key, journal=self.log, clock=self._clock)
        self._add(session)
        self.gate.add()  # the room was checked above, under the same rule
        return session

    def adopt(self, sessions: Iterable[Session]) -> None:
        """Take in sessions rebuilt from the log (counted as submitted; TTL restarts now)."""
        for s in sessions:
            if s.id in self._sessions:
                raise InvalidRequest(f"session {s.id} already exists")
            s.attach_journal(self.log)
            s.touch(self._clock())
            self._add(s)
            self.gate.add()

    def _add(self, session: Session) -> None:
        self._sessions[session.id] = session
        self._by_key[session.key_hash] = session.id

    def get(self, session_id: str, *, touch: bool = True) -> Session:
        """The session `session_id` (NotFound); marks it active unless `touch=False`."""
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"unknown session {session_id!r}")
        if touch:
            session.touch(self._clock())
        return session

    def by_key(self, api_key: str) -> Session:
        """The session whose key is `api_key` (AuthenticationFailed if none); O(1)."""
        digest = hash_key(api_key)
        sid = self._by_key.get(digest)
        session = self._sessions.get(sid) if sid is not None else None
        # compare_digest keeps the final check constant-time, whatever the dict lookup did
        if session is None or not hmac.compare_digest(session.key_hash, digest):
            raise AuthenticationFailed("invalid session key")
        return self.get(session.id)

    def authorize(self, session_id: str, api_key: str) -> Session:
        """The session `session_id` if `api_key` is its key (constant-time compare)."""
        session = self.get(session_id, touch=False)
        if not hmac.compare_digest(session.key_hash, hash_key(api_key)):
            raise AuthenticationFailed(f"this key does not reach session {session_id}")
        return self.get(session_id)

    def remove(self, session_id: str) -> None:
        """Forget a session (NotFound if unknown)."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            raise NotFound(f"unknown session {session_id!r}")
        self._by_key.pop(session.key_hash, None)
        self.totals["forgotten"] += 1  # the upkeep gives memory back after many went
        for hook in self.on_forget:
            hook(session)

    def expire(self, now: float | None = None) -> list[Session]:
        """Abort sessions idle past their state's TTL and forget long-closed ones; returns the
        aborted ones.

        OPEN: `ttl_s`; ENDED (never exported): `ended_ttl_s`; EXPORTED or ABORTED: forgotten
        `ttl_s` after they closed. A plain scan: the gateway calls it every few seconds and on a
        full store; 10k sessions take a few milliseconds, less than an ordered index would cost
        to keep exact.
        """
        now = self._clock() if now is None else now
        expired: list[Session] = []
        gone: list[str] = []
        for s in self._sessions.values():
            if s.state == SessionState.OPEN:
                if s.last_active + self.ttl_s < now:
                    expired.append(s)
            elif s.state == SessionState.ENDED:
                if s.last_active + self.ended_ttl_s < now:
                    expired.append(s)
            elif s.last_active + self.ttl_s < now:
                gone.append(s.id)
        for sid in gone:
            self.remove(sid)
        for s in expired:
            self.abort(s.id)
            self.totals["expired"] += 1
        return expired

    def abort(self, session_id: str) -> Session:
        """Abort a session: its calls are never trained on, and its capacity is given back.

        Counting aborted episodes against the staleness budget would let failures starve
        training: the trainer could never fill the batch that moves the version on.
        """
        session = self.get(session_id, touch=False)
        if session.state in (SessionState.OPEN, SessionState.ENDED):
            session.abort()
            session.touch(self._clock())  # the closed-session retention counts from now
            self.gate.finish(accepted=False)
            self.totals["aborted"] += 1
        return session

    def acknowledge(self, session_id: str) -> None:
        """The trainer took the session's rows: journal it as exported, then forget it.

        It keeps its staleness slot (it became training data), unlike an aborted session.
        """
        session = self.get(session_id, touch=False)
        counted = session.state in (SessionState.OPEN, SessionState.ENDED)
        session.mark_exported()  # journaled, so a restart will not bring it back; 409 if aborted
        if counted:
            self.gate.finish(accepted=True)
            self.totals["exported"] += 1
        self.remove(session_id)

    def _make_room(self) -> None:
        if len(self._sessions) < self.max_sessions:
            return
        self.expire()
        closed = sorted(
            (s for s in self._sessions.values()
             if s.state in (SessionState.EXPORTED, SessionState.ABORTED)),
            key=lambda s: s.last_active,
        )
        for s in closed:  # evict them all: the scan is O(n), so make it rare
            self.remove(s.id)
        if len(self._sessions) >= self.max_sessions:
            raise CapacityExhausted(
                f"session store full: {len(self._sessions)} sessions hold unexported calls"
            )

    def stats(self) -> dict[str, int]:
        """Sessions held, by state, plus `submitted` and totals since start (`*_total`)."""
        by_state = Counter(str(s.state) for s in self._sessions.values())
        totals = {f"{k}_total": self.totals.get(k, 0) for k in ("aborted", "expired", "exported")}
        return {"submitted": self.submitted, **{str(st): by_state.get(str(st), 0)
                                                  for st in SessionState}, **totals}


__all__ = ["SessionStore"]
