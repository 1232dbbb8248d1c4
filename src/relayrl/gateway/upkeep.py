"""The gateway's periodic upkeep: expire idle sessions and compact the durable log.

The durable log only ever appends, so without compaction a gateway that runs for days grows its
SQLite file with every session it ever served. Compaction deletes the events of sessions that
can never come back (acknowledged or aborted); it runs when enough sessions closed since the
last one, or when some closed and enough time passed, so its O(log) scan stays rare and a quiet
gateway does not scan at all. It runs in a worker thread: appends wait on the log's lock for the
one statement, but the event loop keeps serving calls that do not write.

May import: `relayrl.gateway.session_store`, `relayrl.trajectory` (no FastAPI, no torch).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from relayrl.gateway.session_store import SessionStore
from relayrl.trajectory import InteractionLog, Session

log = logging.getLogger("relayrl.gateway")


class Upkeep:
    """Expiry and log compaction, run by the app every few seconds (`tick`)."""

    def __init__(self, store: SessionStore, interaction_log: InteractionLog | None, *,
                 compact_after_closed: int = 1000, compact_every_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if compact_after_closed < 1 or compact_every_s <= 0:
            raise ValueError("need compact_after_closed >= 1 and compact_every_s > 0")
        self.store = store
        self.log = interaction_log
        self.compact_after_closed = compact_after_closed
        self.compact_every_s = compact_every_s
        self._clock = clock
        self._closed_then = self._closed()
        self._compacted_at = clock()
        self.compactions = 0
        """Compactions run so far."""

    def _closed(self) -> int:
        return self.store.totals["aborted"] + self.store.totals["exported"]

    def compaction_due(self) -> bool:
        """Whether enough sessions closed (or some closed long enough ago) to compact now."""
        closed = self._closed() - self._closed_then
        if self.log is None or closed <= 0:
            return False
        return (closed >= self.compact_after_closed
                or self._clock() - self._compacted_at >= self.compact_every_s)

    async def tick(self) -> list[Session]:
        """Expire idle sessions, compact the log when due; returns the sessions aborted now."""
        expired = self.store.expire()
        for s in expired:
            log.info("session %s idle past its TTL: aborted", s.id)
        if self.compaction_due():
            await self.compact()
        return expired

    async def compact(self) -> int:
        """Compact the log now (in a worker thread); returns how many events went."""
        if self.log is None:
            return 0
        # counted before the scan: a session closing during it is caught by the next one
        closed = self._closed()
        removed = await asyncio.to_thread(self.log.compact)
        self._closed_then, self._compacted_at = closed, self._clock()
        self.compactions += 1
        log.info("durable log compacted: %d events of closed sessions removed", removed)
        return removed


__all__ = ["Upkeep"]
