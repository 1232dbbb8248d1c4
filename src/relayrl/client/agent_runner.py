"""`AgentRunner`: run an agent function over a dataset, each episode in its own AgentSession.

`await AgentRunner(group_size=4).run(agent_fn, dataset)` runs `agent_fn(item)` for every item,
`group_size` times (one `group_id` per item, so GRPO compares the tries of one prompt), at most
`concurrency` at a time, with a progress bar. The function's return value is the reward: a number
is the trajectory's final reward, a dict `{completion_id: reward}` rewards single calls, None
means the agent rewarded over HTTP itself. An episode that raises is aborted (never trained) and
counted; nothing is retried, except starting a session while the service answers 429 (bounded
by `start_wait_s`, as AgentSession does).

Imports: relayrl.client.agent_session, relayrl.errors, tqdm.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from relayrl.client.agent_session import AgentSession, resolve_service
from relayrl.errors import EpisodeFailed, InvalidRequest

log = logging.getLogger(__name__)


@dataclass
class RunSummary:
    """What one `AgentRunner.run` did."""

    finished: int = 0
    """Episodes finalized (handed to the service for training)."""
    aborted: int = 0
    """Episodes that raised: aborted on the service, never trained."""
    rewards: list[float] = field(default_factory=list)
    """Final rewards of finished episodes that returned a number."""
    errors: list[str] = field(default_factory=list)
    """`item #i: Type: message` of each aborted episode."""
    start_waits: int = 0
    """Times a start was refused with 429 and waited on."""

    @property
    def mean_reward(self) -> float | None:
        """Mean of `rewards` (None when no episode returned a number)."""
        return sum(self.rewards) / len(self.rewards) if self.rewards else None


class AgentRunner:
    """Runs `agent_fn(item)` for each item × `group_size`, each inside its own AgentSession."""

    def __init__(self, base_url: str | None = None, group_size: int = 1, concurrency: int = 8,
                 *, api_key: str | None = None, metadata: dict[str, Any] | None = None,
                 progress: bool = True, start_wait_s: float = 300.0,
                 timeout_s: float = 60.0) -> None:
        if group_size < 1 or concurrency < 1:
            raise InvalidRequest("group_size and concurrency must be >= 1")
        self.base_url, self.api_key = resolve_service(base_url, api_key)
        self.group_size = group_size
        self.concurrency = concurrency
        self.metadata = metadata
        self.progress = progress
        self.start_wait_s = start_wait_s
        self.timeout_s = timeout_s

    async def run(self, agent_fn: Callable[[Any], Any], dataset: Iterable[Any]) -> RunSummary:
        """Run every episode; return the summary (an episode's failure does not stop the rest)."""
        from tqdm.auto import tqdm

        items = list(dataset)
        run_id = uuid.uuid4().hex[:12]
        summary = RunSummary()
        # episodes in order (every try of item 0, then item 1, ...), pulled by `concurrency`
        # workers: a large dataset does not become a task per episode up front
        todo = iter([(i, item) for i, item in enumerate(items) for _ in range(self.group_size)])
        bar = tqdm(total=len(items) * self.group_size, desc="episodes", unit="ep",
                   disable=not self.progress)

        async def worker() -> None:
            for index, item in todo:
                try:
                    reward = await self._episode(agent_fn, f"{run_id}-{index}", index, item,
                                                 summary)
                except Exception as e:
                    summary.aborted += 1
                    summary.errors.append(f"item #{index}: {type(e).__name__}: {e}")
                    log.warning("episode for item #%d aborted: %s: %s", index,
                                type(e).__name__, e)
                else:
                    summary.finished += 1
                    if reward is not None:
                        summary.rewards.append(reward)
                bar.update(1)
                mean = summary.mean_reward
                bar.set_postfix(reward="-" if mean is None else f"{mean:.3f}",
                                aborted=summary.aborted, refresh=False)

        try:
            await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        finally:
            bar.close()
        return summary

    async def _episode(self, agent_fn: Callable[[Any], Any], group_id: str, index: int,
                       item: Any, summary: RunSummary) -> float | None:
        metadata = {**(self.metadata or {}), "item_index": index}
        session = AgentSession(self.base_url, self.api_key, group_id=group_id,
                               metadata=metadata, start_wait_s=self.start_wait_s,
                               timeout_s=self.timeout_s)
        try:
            async with session as s:
                return await _apply(s, await _call(agent_fn, item))
        finally:
            summary.start_waits += session.start_waits


async def _call(fn: Callable[[Any], Any], item: Any) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(item)  # bound `async def run` methods (an agent's MyAgent().run) too
    # a synchronous agent runs in a thread that copies this context, so its calls land in the
    # session too, and it does not stall the other episodes (an object whose __call__ is async
    # hands back a coroutine, awaited here)
    result = await asyncio.to_thread(fn, item)
    if inspect.isawaitable(result):
        result = await result
    return result


async def _apply(session: AgentSession, result: Any) -> float | None:
    """Turn an agent's return value into rewards on `session`; the final reward, if a number."""
    if result is None:
        return None
    if isinstance(result, bool) or not isinstance(result, int | float | dict):
        raise EpisodeFailed(f"the agent returned {type(result).__name__}; expected a number, "
                            "a dict {completion_id: reward}, or None")
    if isinstance(result, dict):
        for completion_id, reward in result.items():
            await session.set_reward(_finite(reward), completion_id=str(completion_id))
        return None
    value = _finite(result)
    session.reward = value
    return value


def _finite(value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise EpisodeFailed(f"reward {value!r} is not a number") from None
    if not math.isfinite(v):
        raise EpisodeFailed(f"reward {value!r} is not finite")
    return v
