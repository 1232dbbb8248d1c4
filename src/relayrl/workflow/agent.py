"""`AgentWorkflow`: any object with `async def run(data, **extra_kwargs)` as an RL episode.

Per episode: wait for capacity on the gateway, open a session, run the agent with the session's
`base_url` and `api_key` (and, inline, a shared `http_client`), turn its return value into
rewards (a number: the last call; a dict: per call id; None: the agent set rewards over HTTP),
end the session and export its rows. The agent never learns it is being trained.

Two modes. *inline*: `run` is a coroutine on the rollout process's event loop (cheap, but it
must be async and must not block). *subprocess*: `run` goes to a worker process with
`OPENAI_BASE_URL` / `OPENAI_API_KEY` set, may be synchronous, and can be killed on timeout; the
agent is pickled once, up front, so an unpicklable agent fails before any episode starts.

Whatever happens to the agent (it raises, hangs, is cancelled), the session is ended and
released on the gateway: a failed episode is aborted, and its calls are never trained on.

May import: httpx, `relayrl.client`, `relayrl.trajectory` (rows, `ExportStyle`, `CreditRule`),
`relayrl.errors` and the other `relayrl.workflow` modules; never torch or openai (agents bring
their own SDKs).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import logging
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import httpx

from relayrl.client.pool import pooled_client
from relayrl.client.session_client import SessionClient, SessionHandle
from relayrl.errors import ConfigError, InvalidRequest
from relayrl.trajectory import (
    DEFAULT_CREDIT_RULE,
    DEFAULT_EXPORT_STYLE,
    SCHEMA_VERSION,
    CreditRule,
    ExportStyle,
    TrajectoryRow,
    row_from_dict,
)
from relayrl.workflow.base import RolloutWorkflow
from relayrl.workflow.context import EpisodeContext
from relayrl.workflow.context import get as current_context
from relayrl.workflow.sessions import discard_session, open_episode_session
from relayrl.workflow.subproc import SubprocessPool, pickle_agent

log = logging.getLogger(__name__)



class AgentMode(StrEnum):
    """Where an agent's `run` executes."""

    INLINE = "inline"
    """A coroutine on the rollout process's event loop."""
    SUBPROCESS = "subprocess"
    """A worker process (may be synchronous; killed on timeout)."""

    @classmethod
    def _missing_(cls, value: object) -> AgentMode | None:
        # AReaL spells the subprocess mode `subproc`; both name the same thing
        return cls.SUBPROCESS if value == "subproc" else None


def _member(enum_type: type[StrEnum], value: str, what: str) -> StrEnum:
    try:
        return enum_type(value)
    except ValueError:
        raise ConfigError(f"{what} {value!r} is not one of "
                          f"{[str(m) for m in enum_type]}") from None


@dataclass(frozen=True)
class AgentConfig:
    """How an agent is run and exported."""

    mode: AgentMode = AgentMode.INLINE   # "inline" (coroutine here) or "subprocess" (worker pool)
    subproc_max_workers: int = 4       # worker processes in subprocess mode
    export_style: ExportStyle = DEFAULT_EXPORT_STYLE  # "concat" (row per segment path) or "individual"
    credit: CreditRule = DEFAULT_CREDIT_RULE  # credit rule applied at export
    discount: float = 1.0              # γ of the discount rule
    capacity_wait_s: float = 60.0      # how long to wait for gateway capacity before aborting
    capacity_poll_s: float = 0.25      # pause between capacity checks
    http_timeout_s: float = 600.0      # per request on the shared http_client (slow CPU models)

    def __post_init__(self) -> None:
        # plain strings are accepted (YAML, keyword arguments) and kept as the enums
        object.__setattr__(self, "mode", _member(AgentMode, self.mode, "agent mode"))
        object.__setattr__(self, "export_style",
                           _member(ExportStyle, self.export_style, "export_style"))
        object.__setattr__(self, "credit", _member(CreditRule, self.credit, "credit"))
        if (self.subproc_max_workers < 1 or self.capacity_poll_s <= 0
                or self.capacity_wait_s < 0 or self.http_timeout_s <= 0):
            raise ConfigError("need subproc_max_workers >= 1, capacity_poll_s > 0, "
                              "capacity_wait_s >= 0, http_timeout_s > 0")


def has_run(obj: Any) -> bool:
    """Whether `obj` looks like an agent (it has a callable `run`)."""
    return callable(getattr(obj, "run", None))


class FunctionAgent:
    """A plain function `run(data, *, base_url, api_key, ..., **kwargs)` as an agent.

    `kwargs` (a config's `workflow_kwargs`) are bound to every call. The function stays the
    agent's `run`, so an async one runs inline and a synchronous one in subprocess mode, and
    the agent pickles by reference (the function's module and name) for worker processes.
    """

    def __init__(self, fn: Any, kwargs: dict[str, Any] | None = None) -> None:
        if not callable(fn):
            raise ConfigError(f"{fn!r} is not callable")
        self.fn = fn
        self.kwargs = dict(kwargs or {})
        self.run = functools.partial(fn, **self.kwargs) if self.kwargs else fn

    def __repr__(self) -> str:
        return f"FunctionAgent({getattr(self.fn, '__qualname__', self.fn)!r})"


class AgentWorkflow(RolloutWorkflow):
    """Runs `agent.run(data, base_url=..., api_key=..., ...)` against a gateway, one session each."""

    def __init__(self, agent: Any, client: SessionClient,
                 config: AgentConfig | None = None) -> None:
        config = config or AgentConfig()
        if not has_run(agent):
            raise InvalidRequest(f"{type(agent).__qualname__} has no run(data, **kwargs) method")
        if config.mode == AgentMode.INLINE and not inspect.iscoroutinefunction(agent.run):
            raise ConfigError(f"{type(agent).__qualname__}.run is synchronous; inline mode "
                              "needs `async def run`, or use mode='subprocess'")
        self.agent = agent
        self.client = client
        self.config = config
        self._agent_bytes = pickle_agent(agent) if config.mode == AgentMode.SUBPROCESS else b""
        self._pool = (SubprocessPool(config.subproc_max_workers)
                      if config.mode == AgentMode.SUBPROCESS else None)
        self._cleanups: set[asyncio.Task[None]] = set()
        self._http: httpx.AsyncClient | None = None

    @property
    def http_client(self) -> httpx.AsyncClient:
        """The client shared by inline agents: no connection cap, a generation-sized timeout.

        Not the SessionClient's own: the openai SDK adopts a custom client's timeout, and admin
        calls want a short one while a CPU model may take minutes to answer.
        """
        if self._http is None:
            self._http = pooled_client(self.config.http_timeout_s)
        return self._http

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, TrajectoryRow] | None:
        """One session: run the agent, set rewards, export; None when it made no calls."""
        ctx = current_context()
        session = await self._open_session(ctx)
        exported = False
        try:
            value = await self._run_agent(session, data)
            await self._apply_rewards(session, value)
            await self.client.end_session(session)
            rows = await self.client.export(session.session_id, style=self.config.export_style,
                                            credit=self.config.credit,
                                            discount=self.config.discount, ack=True)
            exported = True
        finally:
            if not exported:
                await self._release(session)
        parsed = [row_from_dict({"schema_version": SCHEMA_VERSION, **r}) for r in rows]
        return {r.interaction_ids[-1]: r for r in parsed} or None

    async def _open_session(self, ctx: EpisodeContext) -> SessionHandle:
        """Wait (bounded) for capacity, then start a session tagged with the episode's ids."""
        c = self.config
        return await open_episode_session(self.client, ctx, c.capacity_wait_s, c.capacity_poll_s)

    async def _run_agent(self, session: SessionHandle, data: dict[str, Any]) -> Any:
        if self._pool is not None:
            env = {"OPENAI_BASE_URL": session.base_url, "OPENAI_API_KEY": session.api_key}
            kwargs = {"base_url": session.base_url, "api_key": session.api_key}
            return await self._pool.run(self._agent_bytes, data, env, kwargs)
        # a deep copy: group members share one data item and agents may edit theirs
        return await self.agent.run(copy.deepcopy(data), base_url=session.base_url,
                                    api_key=session.api_key, http_client=self.http_client)

    async def _apply_rewards(self, session: SessionHandle, value: Any) -> None:
        if value is None:
            return  # the agent set its rewards over HTTP (or leaves them to credit rules)
        if isinstance(value, dict):
            for interaction_id, reward in value.items():
                await self.client.set_reward(session, _reward(reward, f"reward of "
                                                                     f"{interaction_id!r}"),
                                             interaction_id=str(interaction_id))
            return
        await self.client.set_reward(session, _reward(value, "agent.run's return value"))

    async def _release(self, session: SessionHandle) -> None:
        """Abort a session whose episode failed; survives its own cancellation."""
        task = asyncio.ensure_future(self._discard(session))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        await asyncio.shield(task)

    async def _discard(self, session: SessionHandle) -> None:
        await discard_session(self.client, session)

    def counters(self) -> dict[str, float]:
        """The agent's own cumulative counters, when it keeps any (`agent.counters()`)."""
        counters = getattr(self.agent, "counters", None)
        return dict(counters()) if callable(counters) else {}

    async def aclose(self) -> None:
        """Wait for session releases in flight, then stop the worker processes."""
        if self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)
        if self._pool is not None:
            await self._pool.aclose()
        agent_close = getattr(self.agent, "aclose", None)
        if self._pool is None and callable(agent_close):
            await agent_close()  # what an inline agent serves (e.g. an environment's servers)
        if self._http is not None:
            await self._http.aclose()
            self._http = None


def _reward(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(
            f"{what} is a {type(value).__name__}; agent.run must return a number (reward of "
            "the last call), a dict interaction id -> number, or None (rewards set over HTTP)"
        )
    if not math.isfinite(value):
        raise InvalidRequest(f"{what} is {value}; rewards must be finite")
    return float(value)
