"""The workflow context: which episode the running code belongs to (task, episode, group, eval).

It lives in a `contextvars.ContextVar`, so every asyncio task sees the episode it was started
for, and concurrent episodes never see each other's. The tradeoff: code that runs outside the
task (a thread pool, a subprocess) does not inherit it; the subprocess mode passes the fields it
needs explicitly instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

ROLLOUT_SCOPE = "rollout"
EVAL_SCOPE = "eval-rollout"


@dataclass(frozen=True)
class EpisodeContext:
    """What an episode knows about itself."""

    task_id: str = ""
    """The group's task (one dataset item submitted once); all members of a group share it."""
    episode_id: str = ""
    """This episode; unique across the run."""
    group_id: str = ""
    """The group of episodes run on the same data (advantages are normalized within it)."""
    sample_index: int = 0
    """Position of the episode within its group."""
    is_eval: bool = False
    version: int = 0
    """Weight version when the episode was admitted."""

    @property
    def stat_scope(self) -> str:
        """`rollout` or `eval-rollout`: where this episode's stats and dumps go."""
        return EVAL_SCOPE if self.is_eval else ROLLOUT_SCOPE


NO_EPISODE = EpisodeContext()
"""The context seen outside any episode (empty ids)."""

_CURRENT: ContextVar[EpisodeContext] = ContextVar("relayrl_episode", default=NO_EPISODE)


def get() -> EpisodeContext:
    """The running episode's context (an empty one outside any episode)."""
    return _CURRENT.get()


def stat_scope() -> str:
    """`rollout` or `eval-rollout` for the running episode."""
    return _CURRENT.get().stat_scope


@contextmanager
def episode_scope(ctx: EpisodeContext) -> Iterator[EpisodeContext]:
    """Make `ctx` the current episode for the enclosed code (restored on exit)."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
