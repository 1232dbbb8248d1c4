"""`AsyncRewardWrapper`: a synchronous reward function, awaited off the event loop, with a timeout.

Reward functions are often plain, slow Python (parsing, sympy, running tests). Running them in
the event loop would stall every other episode, so they run in a small thread pool of their own.
A reward that raises or runs past its timeout raises `EpisodeFailed`: the episode is aborted with
the error kept, never scored 0 (a 0 would teach the policy that a grader bug is a wrong answer).

Tradeoff: a thread cannot be killed, so a timed-out function keeps its thread until it returns;
the pool is bounded (`max_workers`), so a grader that hangs forever ties up at most that many
threads, and further calls fail by timeout instead of piling up.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from relayrl.errors import EpisodeFailed, InvalidRequest


class AsyncRewardWrapper:
    """`await wrapper(*args, **kwargs)` runs `fn(*args, **kwargs)` in a thread, bounded in time."""

    def __init__(self, fn: Callable[..., float], timeout_s: float = 15.0,
                 max_workers: int = 4) -> None:
        if timeout_s <= 0 or max_workers < 1:
            raise InvalidRequest("timeout_s must be > 0 and max_workers >= 1")
        self.fn = fn
        self.timeout_s = timeout_s
        self.max_workers = max_workers
        self._pool: ThreadPoolExecutor | None = None

    @property
    def name(self) -> str:
        """The wrapped function's name, for errors."""
        return getattr(self.fn, "__qualname__", None) or type(self.fn).__name__

    async def __call__(self, *args: Any, **kwargs: Any) -> float:
        """The reward; raises EpisodeFailed if the function raises, times out or returns junk."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="relayrl-reward")
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, lambda: self.fn(*args, **kwargs))
        try:
            value = await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            raise EpisodeFailed(
                f"reward function {self.name} did not finish within {self.timeout_s} s"
            ) from None
        except Exception as e:
            raise EpisodeFailed(
                f"reward function {self.name} raised {type(e).__name__}: {e}"
            ) from e
        return _as_reward(value, self.name)

    def close(self) -> None:
        """Shut the thread pool down without waiting for hung calls."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:
        # the pool cannot be pickled (subprocess agents carry wrappers); the copy makes its own
        return {**self.__dict__, "_pool": None}


def _as_reward(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EpisodeFailed(f"reward function {name} returned a {type(value).__name__}, "
                            "not a number")
    if not math.isfinite(value):
        raise EpisodeFailed(f"reward function {name} returned {value}")
    return float(value)
