"""Running an agent's `run` in worker processes: the subprocess mode of `AgentWorkflow`.

Each worker is a `spawn`ed process that takes one task at a time over a pipe: the pickled agent,
the data, and the environment (`OPENAI_BASE_URL`, `OPENAI_API_KEY`) to set before calling
`agent.run(data, ...)`. A synchronous `run` is called as is; an async one (or one returning an
awaitable) is driven by `asyncio.run`. The parent waits on the pipe with `loop.add_reader`, so a
waiting episode holds no thread.

Why not `concurrent.futures.ProcessPoolExecutor`: it cannot stop one task. Here, an episode that
times out or is cancelled kills *its* worker (and only it); the next task starts a fresh one.
`spawn` (not `fork`) because the parent runs threads (a gateway, tqdm) that a fork would copy
mid-lock. Tradeoff: a new worker pays an interpreter start and the agent's imports (about 1-2 s),
and, as always with `spawn`, the launching script must guard its entry point with
`if __name__ == "__main__":` and the agent's class must be importable by its module path.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import multiprocessing as mp
import os
import pickle
import traceback
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from relayrl.errors import EpisodeFailed, InvalidRequest

_CTX = mp.get_context("spawn")


def pickle_agent(agent: Any) -> bytes:
    """The agent's pickle; InvalidRequest naming the agent when it cannot be pickled."""
    try:
        return pickle.dumps(agent)
    except Exception as e:
        raise InvalidRequest(
            f"agent {type(agent).__qualname__} cannot be pickled, which subprocess mode needs "
            f"({type(e).__name__}: {e}); define it at module level without open clients, "
            "locks or lambdas, or use mode='inline'"
        ) from e


def _call_agent(agent: Any, data: Any, kwargs: dict[str, Any]) -> Any:
    out = agent.run(data, **kwargs)
    if inspect.isawaitable(out):
        async def _await() -> Any:
            return await out

        out = asyncio.run(_await())
    return out


def _worker_main(conn: Connection) -> None:
    """A worker's loop: receive a task, run it, send back ("ok", value) or ("error", ...)."""
    while True:  # bounded by the pipe: EOF (the parent closed it or died) ends the worker
        try:
            agent_bytes, data, env, kwargs = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        os.environ.update(env)
        try:
            reply: tuple[Any, ...] = ("ok", _call_agent(pickle.loads(agent_bytes), data, kwargs))
        except BaseException as e:
            reply = ("error", type(e).__name__, str(e), traceback.format_exc())
        try:
            payload = pickle.dumps(reply)
        except Exception as e:
            payload = pickle.dumps(("error", type(e).__name__,
                                    f"the agent's return value cannot be pickled: {e}", ""))
        conn.send_bytes(payload)


class _Worker:
    def __init__(self) -> None:
        parent, child = _CTX.Pipe(duplex=True)
        self.conn: Connection = parent
        self.proc: BaseProcess = _CTX.Process(target=_worker_main, args=(child,), daemon=True,
                                              name="relayrl-agent")
        self.proc.start()
        child.close()

    async def request(self, payload: bytes) -> bytes:
        """Send one task and wait for its reply without blocking the loop."""
        self.conn.send_bytes(payload)
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        fd = self.conn.fileno()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(fd, wake)
        try:
            await ready
        finally:
            loop.remove_reader(fd)
        return self.conn.recv_bytes()

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.close()
        if self.proc.is_alive():
            self.proc.kill()


class SubprocessPool:
    """At most `max_workers` agent runs at once, each in its own worker process."""

    def __init__(self, max_workers: int = 4) -> None:
        if max_workers < 1:
            raise InvalidRequest(f"subproc_max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._slots: asyncio.Semaphore | None = None
        self.killed = 0
        """Workers killed because their task timed out, was cancelled or crashed them."""

    async def run(self, agent_bytes: bytes, data: Any, env: dict[str, str],
                  kwargs: dict[str, Any]) -> Any:
        """`agent.run(data, **kwargs)` in a worker with `env` set; EpisodeFailed if it failed."""
        try:
            payload = pickle.dumps((agent_bytes, data, env, kwargs))
        except Exception as e:
            raise EpisodeFailed(f"the episode's data cannot be pickled for the subprocess: "
                                f"{type(e).__name__}: {e}") from e
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_workers)
        async with self._slots:
            worker = self._idle.pop() if self._idle else _Worker()
            self._busy.add(worker)
            try:
                raw = await worker.request(payload)
            except BaseException as e:  # cancelled, timed out, or the worker died
                self._busy.discard(worker)
                worker.kill()
                self.killed += 1
                if isinstance(e, EOFError | OSError):
                    raise EpisodeFailed(f"the agent's subprocess died (exit code "
                                        f"{worker.proc.exitcode})") from e
                raise
            self._busy.discard(worker)
            self._idle.append(worker)
        return _unpack(raw)

    async def aclose(self) -> None:
        """Kill every worker, idle or busy."""
        workers = [*self._idle, *self._busy]
        self._idle.clear()
        self._busy.clear()
        for w in workers:
            w.kill()
        for w in workers:
            await asyncio.to_thread(w.proc.join, 5.0)


def _unpack(raw: bytes) -> Any:
    reply = pickle.loads(raw)
    if reply[0] == "ok":
        return reply[1]
    _, name, message, tb = reply
    raise EpisodeFailed(f"agent raised {name}: {message}" + (f"\n{tb}" if tb else ""))
