"""`RemoteRolloutWorkflow`: train on episodes that an external rollout server runs.

Per episode: open a gateway session, POST `/rollout` to the server with the session's URL as
the callback (`server_url`) and its key as `callback_api_key`, wait for the answer, turn
`COMPLETED` into a finished episode and `ERROR` into an aborted one (it raises), score it (a
reward function over `final_messages` and the data item, else a `reward` the server put in its
metrics or metadata), and export the session's rows. The gateway checked every callback's
`response_mask` against its own record; a rollout with any disagreement is dropped (the default)
or kept with the count in its rows' metadata, and either way counted in `stats` and logged.

Imports the client, workflow and errors layers and this package's schemas; no torch, no gateway.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import ValidationError

from relayrl.client.pool import pooled_client
from relayrl.client.session_client import SessionClient, SessionHandle
from relayrl.errors import ConfigError, EpisodeFailed
from relayrl.remote_rollout.schemas import (
    RolloutRequest,
    RolloutResponse,
    RolloutStatus,
    SamplingParams,
    ToolDefinition,
    ToolsResponse,
)
from relayrl.trajectory import SCHEMA_VERSION, TrajectoryRow, row_from_dict
from relayrl.workflow.base import RolloutWorkflow
from relayrl.workflow.context import get as current_context
from relayrl.workflow.resolve import import_dotted
from relayrl.workflow.reward import AsyncRewardWrapper
from relayrl.workflow.sessions import SessionReleaser, open_episode_session

log = logging.getLogger(__name__)

MASK_POLICIES = ("drop", "keep")
MASK_KEY = "remote_rollout"
"""The gateway's counters in a session's metadata (see relayrl.gateway.rollout_callback)."""

RewardFn = Callable[[list[dict[str, Any]], dict[str, Any]], float]
"""`reward_fn(final_messages, data) -> float`."""


@dataclass(frozen=True)
class RemoteRolloutConfig:
    """How episodes are sent to the rollout server and exported."""

    on_mask_mismatch: str = "drop"     # "drop" the rollout or "keep" it (counted either way)
    max_turns: int = 10                # advisory limits sent with every rollout
    max_tokens_total: int = 4096
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields
    tokenizer_name: str | None = None  # what the server renders with (its default if None)
    tools: list[dict[str, Any]] | None = None  # tools offered to the model (None: the server's)
    callback_base_url: str | None = None  # gateway root as the server reaches it (default: ours)
    system_prompt: str | None = None   # prepended when the data item has no system message
    export_style: str = "concat"
    credit: str = "discount"
    discount: float = 1.0
    rollout_timeout_s: float = 900.0   # one POST /rollout, the whole episode
    capacity_wait_s: float = 60.0
    capacity_poll_s: float = 0.25
    reward_timeout_s: float = 15.0
    server_api_key: str | None = field(default=None, repr=False)  # else $ROLLOUT_SERVER_API_KEY

    def __post_init__(self) -> None:
        if self.on_mask_mismatch not in MASK_POLICIES:
            raise ConfigError(f"on_mask_mismatch {self.on_mask_mismatch!r} is not one of "
                              f"{list(MASK_POLICIES)}")
        if self.rollout_timeout_s <= 0 or self.capacity_poll_s <= 0 or self.capacity_wait_s < 0:
            raise ConfigError("need rollout_timeout_s > 0, capacity_poll_s > 0, "
                              "capacity_wait_s >= 0")
        try:
            SamplingParams.model_validate(self.sampling)
        except ValidationError as e:
            raise ConfigError(f"remote rollout sampling: {e.errors()[0]['msg']} "
                              f"({'.'.join(map(str, e.errors()[0]['loc']))})") from None

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> RemoteRolloutConfig:
        """Build from a config section, refusing unknown keys by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown remote rollout options {unknown}; known: {sorted(known)}")
        defaults = cls()
        values = {k: _coerce(v, getattr(defaults, k)) for k, v in options.items()}
        return cls(**values)


def _coerce(value: Any, default: Any) -> Any:
    """Command-line overrides arrive as text: give numbers and booleans their field's type."""
    raw = getattr(value, "text", None)
    if type(value).__name__ == "_CliText" and isinstance(raw, str):
        # relayrl.config leaves an override's text unparsed inside untyped (dict) fields
        import yaml

        value = yaml.safe_load(raw) if raw else raw
    if isinstance(value, Mapping):
        return {str(k).encode().decode(): _coerce(v, None) for k, v in value.items()}
    if not isinstance(value, str):
        return value
    text = value.encode().decode()  # a plain str: pydantic refuses the CLI's str subclass
    if isinstance(default, bool):
        return text.strip().lower() in ("1", "true", "yes", "on")
    for kind in (int, float):
        if isinstance(default, kind):
            try:
                return kind(text)
            except ValueError:
                raise ConfigError(f"expected a {kind.__name__}, got {text!r}") from None
    return text


def callback_port(base_port: int, worker_index: int, num_workers: int) -> int:
    """The gateway port of trainer worker `worker_index`: `base_port + index` when several run."""
    if num_workers < 1 or not 0 <= worker_index < num_workers:
        raise ConfigError(f"worker_index {worker_index} is not in [0, {num_workers})")
    return base_port + worker_index if num_workers > 1 else base_port


def callback_url(session: SessionHandle, callback_base_url: str | None = None) -> str:
    """The protocol's `server_url` for a session: its base URL without `/v1`, re-rooted at
    `callback_base_url` (the gateway as the rollout server reaches it) when one is given."""
    base = session.base_url.rstrip("/")
    root = base[: -len("/v1")] if base.endswith("/v1") else base
    if callback_base_url:
        path = urlsplit(root).path
        return callback_base_url.rstrip("/") + path
    return root


class RemoteRolloutWorkflow(RolloutWorkflow):
    """One episode = one `POST /rollout` to `server_url`, called back on its own session."""

    def __init__(self, server_url: str, client: SessionClient,
                 reward_fn: RewardFn | str | None = None,
                 config: RemoteRolloutConfig | None = None,
                 http_client: httpx.AsyncClient | None = None) -> None:
        self.server_url = server_url.rstrip("/")
        self.client = client
        self.config = config or RemoteRolloutConfig()
        fn = import_dotted(reward_fn) if isinstance(reward_fn, str) else reward_fn
        if fn is not None and not callable(fn):
            raise ConfigError(f"reward_fn {reward_fn!r} is not callable")
        self._reward = (AsyncRewardWrapper(fn, timeout_s=self.config.reward_timeout_s)
                        if fn is not None else None)
        self._own_http = http_client is None
        self._http = http_client
        self._releaser = SessionReleaser(client)
        self._tools: list[ToolDefinition] | None = None
        self._tools_lock = asyncio.Lock()
        self.stats: Counter[str] = Counter()
        """episodes, completed, errors, no_calls, mask_checks, mask_mismatches,
        mismatched_rollouts, dropped_mask_mismatch, kept_mask_mismatch."""

    def counters(self) -> dict[str, float]:
        """`stats` for the training log: mask checks/mismatches, dropped and ERROR rollouts."""
        keys = ("episodes", "completed", "errors", "no_calls", "mask_checks", "mask_mismatches",
                "mismatched_rollouts", "dropped_mask_mismatch", "kept_mask_mismatch")
        # every key, zeros included: a flat 0 curve is what shows the check ran and passed
        return {k: float(self.stats[k]) for k in keys}

    @property
    def http(self) -> httpx.AsyncClient:
        """The client for the rollout server (episode-long timeout, no connection cap)."""
        if self._http is None:
            self._http = pooled_client(self.config.rollout_timeout_s)
        return self._http

    def _server_headers(self) -> dict[str, str]:
        key = self.config.server_api_key or os.environ.get("ROLLOUT_SERVER_API_KEY") or None
        return {"authorization": f"Bearer {key}"} if key else {}

    async def tools(self) -> list[ToolDefinition]:
        """The server's tools, fetched once (`GET /tools`) and kept."""
        if self._tools is not None:
            return self._tools
        async with self._tools_lock:
            if self._tools is None:
                try:
                    resp = await self.http.get(f"{self.server_url}/tools", timeout=30.0,
                                               headers=self._server_headers())
                    resp.raise_for_status()
                    self._tools = ToolsResponse.model_validate(resp.json()).tools
                except (httpx.HTTPError, ValueError, ValidationError) as e:
                    raise EpisodeFailed(f"rollout server {self.server_url}: GET /tools failed: "
                                        f"{type(e).__name__}: {e}") from e
            return self._tools

    def rollout_request(self, session: SessionHandle, rollout_id: str,
                        data: Mapping[str, Any]) -> RolloutRequest:
        """The `/rollout` body for one episode on `session`."""
        c = self.config
        # validated as a body, as the constructor would: the messages are still plain dicts
        return RolloutRequest.model_validate(dict(
            rollout_id=rollout_id, messages=self._messages(data),
            server_url=callback_url(session, c.callback_base_url),
            callback_api_key=session.api_key,
            sampling_params=SamplingParams.model_validate(c.sampling),
            max_turns=int(data.get("max_turns", c.max_turns)),
            max_tokens_total=c.max_tokens_total, tokenizer_name=c.tokenizer_name,
            tools=None if c.tools is None else [ToolDefinition.model_validate(t) for t in c.tools],
            metadata={k: v for k, v in data.items() if k not in ("messages", "prompt")
                      and isinstance(v, str | int | float | bool)}))

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, TrajectoryRow] | None:
        """Run one remote rollout; its rows, or None (no LLM call, or dropped for a mask)."""
        del engine  # the rollout server reaches the policy over HTTP, through the session
        ctx = current_context()
        await self.tools()
        self.stats["episodes"] += 1
        c = self.config
        session = await open_episode_session(self.client, ctx, c.capacity_wait_s,
                                             c.capacity_poll_s,
                                             extra={"rollout_server": self.server_url})
        rollout_id = ctx.episode_id or f"rollout-{uuid.uuid4().hex}"
        exported = False
        try:
            resp = await self._post_rollout(self.rollout_request(session, rollout_id, data))
            if resp.status != RolloutStatus.COMPLETED:
                self.stats["errors"] += 1
                raise EpisodeFailed(f"rollout {rollout_id} failed on the rollout server: "
                                    f"{resp.error_message or 'no error message'}")
            if resp.metrics.num_llm_calls == 0:
                self.stats["no_calls"] += 1
                return None
            reward = await self._score(resp, data)
            await self.client.set_reward(session, reward)
            await self.client.end_session(session)
            rows = await self.client.export(session.session_id, style=c.export_style,
                                            credit=c.credit, discount=c.discount, ack=True)
            exported = True
        finally:
            if not exported:
                await self._releaser.release(session)
        self.stats["completed"] += 1
        return self._rows(rows, resp, rollout_id)

    async def _post_rollout(self, req: RolloutRequest) -> RolloutResponse:
        url = f"{self.server_url}/rollout"
        try:
            resp = await self.http.post(url, json=req.model_dump(mode="json"),
                                        headers=self._server_headers())
        except httpx.HTTPError as e:
            self.stats["errors"] += 1
            raise EpisodeFailed(f"POST {url} failed: {type(e).__name__}: {e}") from e
        if resp.status_code >= 400:
            self.stats["errors"] += 1
            raise EpisodeFailed(f"POST {url} answered {resp.status_code}: {resp.text[:500]}")
        try:
            return RolloutResponse.model_validate(resp.json())
        except (ValueError, ValidationError) as e:
            self.stats["errors"] += 1
            raise EpisodeFailed(f"POST {url}: not a rollout response: {e}") from None

    async def _score(self, resp: RolloutResponse, data: dict[str, Any]) -> float:
        if self._reward is not None:
            final = [m.to_wire() for m in resp.final_messages]
            return await self._reward(final, data)
        for where in (resp.metrics.model_extra or {}, resp.metadata):
            value = where.get("reward")
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value)
        raise EpisodeFailed(f"rollout {resp.rollout_id}: no reward function is configured and "
                            "the server returned no numeric `reward` in metrics or metadata")

    def _rows(self, rows: list[dict[str, Any]], resp: RolloutResponse,
              rollout_id: str) -> dict[str, TrajectoryRow] | None:
        checks, mismatches = _mask_counts(rows)
        self.stats["mask_checks"] += checks
        self.stats["mask_mismatches"] += mismatches
        summary = {"rollout_id": rollout_id, "finish_reason": resp.finish_reason,
                   "metrics": resp.metrics.model_dump(), "mask_checks": checks,
                   "mask_mismatches": mismatches}
        if mismatches:
            self.stats["mismatched_rollouts"] += 1
            drop = self.config.on_mask_mismatch == "drop"
            self.stats["dropped_mask_mismatch" if drop else "kept_mask_mismatch"] += 1
            log.warning("rollout %s: %d of %d response masks disagree with the gateway's record "
                        "(server tokenizer/template differs from the policy's); %s", rollout_id,
                        mismatches, checks, "dropped" if drop else "kept, as configured")
            if drop:
                return None
        parsed = []
        for r in rows:
            meta = {**r.get("metadata", {}), "remote_rollout": summary}
            parsed.append(row_from_dict({"schema_version": SCHEMA_VERSION, **r, "metadata": meta}))
        return {p.interaction_ids[-1]: p for p in parsed} or None

    async def aclose(self) -> None:
        """Wait for session releases, close the HTTP client and the reward pool."""
        await self._releaser.wait()
        if self._reward is not None:
            self._reward.close()
        if self._http is not None and self._own_http:
            await self._http.aclose()
            self._http = None

    def _messages(self, data: Mapping[str, Any]) -> list[dict[str, Any]]:
        msgs = data.get("messages")
        if msgs is None:
            prompt = data.get("prompt") or data.get("question")
            if not isinstance(prompt, str):
                raise EpisodeFailed("the data item has neither `messages` nor a `prompt`/"
                                    "`question` string")
            msgs = [{"role": "user", "content": prompt}]
        msgs = [dict(m) for m in msgs]
        if self.config.system_prompt and not (msgs and msgs[0].get("role") == "system"):
            msgs.insert(0, {"role": "system", "content": self.config.system_prompt})
        return msgs


def _mask_counts(rows: list[dict[str, Any]]) -> tuple[int, int]:
    """(checks, mismatches) the gateway recorded for the session the rows came from."""
    for r in rows:
        session_meta = (r.get("metadata") or {}).get("session") or {}
        stats = session_meta.get(MASK_KEY)
        if isinstance(stats, Mapping):
            return int(stats.get("mask_checks", 0)), int(stats.get("mask_mismatches", 0))
    return 0, 0


def build_remote_workflow(options: Mapping[str, Any], client: SessionClient) -> RemoteRolloutWorkflow:
    """A workflow from a `workflow: remote` config section: `server_url`, optional `reward_fn`
    (a dotted path) and any `RemoteRolloutConfig` field."""
    opts = dict(options)
    server_url = opts.pop("server_url", None)
    if not isinstance(server_url, str) or not server_url:
        raise ConfigError("workflow: remote needs remote.server_url (the rollout server's root)")
    reward_fn = opts.pop("reward_fn", None)
    return RemoteRolloutWorkflow(server_url, client, reward_fn,
                                 RemoteRolloutConfig.from_mapping(opts))


__all__ = ["MASK_POLICIES", "RemoteRolloutConfig", "RemoteRolloutWorkflow", "RewardFn",
           "build_remote_workflow", "callback_port", "callback_url"]
