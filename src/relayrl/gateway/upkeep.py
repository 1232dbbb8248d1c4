"""The gateway's periodic upkeep: expire idle sessions, compact the durable log, give memory back.

The durable log only ever appends, so without compaction a gateway that runs for days grows its
SQLite file with every session it ever served. Compaction deletes the events of sessions that
can never come back (acknowledged or aborted); it runs when enough sessions closed since the
last one, or when some closed and enough time passed, so its O(log) scan stays rare and a quiet
gateway does not scan at all. It runs in a worker thread: appends wait on the log's lock for the
one statement, but the event loop keeps serving calls that do not write.

Forgetting sessions frees their memory to Python, but glibc's allocator keeps freed heap pages
that are not at the top of the heap: after 10,000 abandoned sessions expire, the process stays at
its peak RSS (about +25 MiB here) although nothing holds them. So once many sessions were
forgotten since the last time (as many as the store still holds, or `trim_after_forgotten`), the
upkeep asks glibc to return free pages (`malloc_trim`, a few milliseconds, in a worker thread).
Before that it clears the content caches the app names (rendered prompts, token pieces, shared
turns): they are bounded, but the forgotten sessions filled them, and their entries, allocated
among the sessions' objects, keep Python's allocator arenas from being freed (about 4 MiB after
10,000 sessions, measured); a prompt sent again is rendered once more. Where the C library has no
`malloc_trim` (musl, macOS) this step does nothing.

May import: `relayrl.gateway.session_store`, `relayrl.trajectory` (no FastAPI, no torch).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from relayrl import heap
from relayrl.gateway.session_store import SessionStore
from relayrl.trajectory import InteractionLog, Session

log = logging.getLogger("relayrl.gateway")


class Upkeep:
    """Expiry, log compaction and memory trimming, run by the app every few seconds (`tick`)."""

    def __init__(self, store: SessionStore, interaction_log: InteractionLog | None, *,
                 compact_after_closed: int = 1000, compact_every_s: float = 600.0,
                 trim_after_forgotten: int = 1000,
                 caches: Sequence[Callable[[], object]] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        if compact_after_closed < 1 or compact_every_s <= 0 or trim_after_forgotten < 1:
            raise ValueError("need compact_after_closed >= 1, compact_every_s > 0 and "
                             "trim_after_forgotten >= 1")
        self.store = store
        self.log = interaction_log
        self.compact_after_closed = compact_after_closed
        self.compact_every_s = compact_every_s
        self.trim_after_forgotten = trim_after_forgotten
        self.caches = tuple(caches)
        """Clears content caches (rendered prompts, token pieces) filled by forgotten sessions."""
        self._clock = clock
        self._closed_then = self._closed()
        self._compacted_at = clock()
        self._forgotten_then = store.totals["forgotten"]
        self.compactions = 0
        """Compactions run so far."""
        self.trims = 0
        """Times free heap memory was handed back to the system (`malloc_trim` ran)."""

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
        if self.trim_due():
            await self.release_memory()
        return expired

    def trim_due(self) -> bool:
        """Whether enough sessions were forgotten since the last trim to hand memory back.

        As many as the store still holds (the heap is then mostly free: a mass expiry, or a
        small store turning over), or `trim_after_forgotten`, whichever is fewer. Never where
        the process keeps its freed heap for training (`relayrl.heap.kept`).
        """
        if heap.MALLOC_TRIM is None or heap.kept():
            return False
        forgotten = self.store.totals["forgotten"] - self._forgotten_then
        return forgotten > 0 and forgotten >= min(self.trim_after_forgotten, len(self.store))

    async def release_memory(self) -> bool:
        """Hand free heap pages back to the system; False where the C library cannot."""
        if heap.MALLOC_TRIM is None:
            return False
        self._forgotten_then = self.store.totals["forgotten"]
        for clear in self.caches:  # their entries, scattered among the sessions', pin arenas
            clear()
        # ctypes releases the GIL, so the event loop keeps serving while glibc walks its heaps
        await asyncio.to_thread(heap.MALLOC_TRIM, 0)
        self.trims += 1
        return True

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
