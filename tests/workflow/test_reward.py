"""AsyncRewardWrapper: off the event loop, bounded in time, failures abort (never score 0)."""

from __future__ import annotations

import asyncio
import pickle
import threading
import time

import pytest

from relayrl.errors import EpisodeFailed
from relayrl.workflow import AsyncRewardWrapper


def exact_match(completion: str, answer: str) -> float:
    return float(completion.strip() == answer)


async def test_a_sync_reward_runs_in_another_thread_and_returns_a_float() -> None:
    threads: list[int] = []

    def reward(x: int) -> int:
        threads.append(threading.get_ident())
        return x * 2

    wrapper = AsyncRewardWrapper(reward)
    assert await wrapper(3) == 6.0
    assert isinstance(await wrapper(1), float)
    assert threads and threading.get_ident() not in threads
    wrapper.close()


async def test_a_slow_reward_does_not_stall_other_coroutines() -> None:
    wrapper = AsyncRewardWrapper(lambda: time.sleep(0.3) or 1.0, timeout_s=5)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        for _ in range(20):
            await asyncio.sleep(0.01)
            ticks += 1

    reward, _ = await asyncio.gather(wrapper(), ticker())
    assert reward == 1.0 and ticks == 20
    wrapper.close()


async def test_a_reward_that_raises_fails_the_episode_keeping_the_error() -> None:
    def broken(_: str) -> float:
        raise KeyError("answer")

    with pytest.raises(EpisodeFailed, match="broken raised KeyError") as err:
        await AsyncRewardWrapper(broken)("x")
    assert isinstance(err.value.__cause__, KeyError)


async def test_a_reward_past_its_timeout_fails_the_episode() -> None:
    release = threading.Event()
    wrapper = AsyncRewardWrapper(lambda: release.wait(10) and 1.0, timeout_s=0.1)
    start = time.monotonic()
    with pytest.raises(EpisodeFailed, match=r"did not finish within 0\.1 s"):
        await wrapper()
    assert time.monotonic() - start < 1.0
    release.set()
    wrapper.close()


@pytest.mark.parametrize("value", [None, "1.0", True, float("nan")])
async def test_a_reward_that_is_not_a_finite_number_fails_the_episode(value) -> None:
    with pytest.raises(EpisodeFailed, match="reward function"):
        await AsyncRewardWrapper(lambda: value)()


async def test_a_wrapper_pickles_for_subprocess_agents_even_after_use() -> None:
    wrapper = AsyncRewardWrapper(exact_match, timeout_s=2)
    assert await wrapper(" 4 ", "4") == 1.0
    copy = pickle.loads(pickle.dumps(wrapper))
    assert await copy("5", "4") == 0.0
    wrapper.close()
    copy.close()
