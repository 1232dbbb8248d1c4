"""Opening and releasing an episode's gateway session: shared by every session-based workflow.

`open_episode_session` waits (bounded) for capacity and starts a session tagged with the running
episode's ids; `discard_session` ends and acknowledges a failed episode's session, so nothing of
it is exported and its capacity comes back. May import the client layer and workflow.context.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from relayrl.client.session_client import SessionClient, SessionHandle
from relayrl.errors import CapacityExhausted
from relayrl.workflow.context import EpisodeContext

log = logging.getLogger(__name__)


def episode_metadata(ctx: EpisodeContext) -> dict[str, object]:
    """The session metadata that labels exported rows with their episode and group."""
    return {"episode_id": ctx.episode_id, "group_id": ctx.group_id,
            "sample_index": ctx.sample_index, "is_eval": ctx.is_eval}


async def open_episode_session(client: SessionClient, ctx: EpisodeContext, wait_s: float,
                               poll_s: float,
                               extra: dict[str, object] | None = None) -> SessionHandle:
    """Wait up to `wait_s` for capacity, then start a session tagged with `ctx`'s ids."""
    meta = {**episode_metadata(ctx), **(extra or {})}
    deadline = time.monotonic() + wait_s
    for _ in range(int(wait_s / poll_s) + 2):
        if await client.grant_capacity() > 0:
            with contextlib.suppress(CapacityExhausted):  # another episode took the slot
                return await client.start_session(ctx.task_id or None, meta)
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(poll_s)
    raise CapacityExhausted(f"the gateway granted no capacity within {wait_s} s")


async def discard_session(client: SessionClient, session: SessionHandle) -> None:
    """Abort a failed episode's session; errors (already closed, gone) are logged."""
    # Abort, never end + acknowledge: an acknowledged session keeps its staleness slot as if
    # it had become training data, so each crash would eat into the budget for good.
    try:
        await client.abort_session(session.session_id)
    except Exception as e:  # already closed, gateway gone: nothing more to free
        log.debug("releasing session %s: %s", session.session_id, e)



class SessionReleaser:
    """Releases failed episodes' sessions in tasks that survive the episode's cancellation."""

    def __init__(self, client: SessionClient) -> None:
        self.client = client
        self._tasks: set[asyncio.Task[None]] = set()

    async def release(self, session: SessionHandle) -> None:
        """Discard `session`; a cancelled caller still leaves the release running to its end."""
        task = asyncio.ensure_future(discard_session(self.client, session))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        await asyncio.shield(task)

    async def wait(self) -> None:
        """Wait for the releases in flight."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


__all__ = ["SessionReleaser", "discard_session", "episode_metadata", "open_episode_session"]
