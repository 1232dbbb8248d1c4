"""The agent loop and the server's shared state: tokenizer cache, HTTP client, rate limit.

`execute_rollout` runs one `RolloutRequest` under the concurrency semaphore: call the trainer,
run the reply's tool calls in parallel, repeat until a reply calls no tool or a limit is hit.
Every failure becomes `status: ERROR` with a message naming its category (tokenizer, tool,
trainer callback); nothing raises out of it. May import this package only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from relayrl.client.pool import pooled_client
from relayrl.remote_rollout.config import ServerConfig
from relayrl.remote_rollout.schemas import (
    FinishReason,
    RolloutMetrics,
    RolloutRequest,
    RolloutResponse,
    RolloutStatus,
)
from relayrl.remote_rollout.session import RolloutSession, TrainerCallError
from relayrl.remote_rollout.tokenizer import (
    ChatTokenizer,
    TokenizerCache,
    TokenizerLoadError,
    load_tokenizer,
)
from relayrl.remote_rollout.tools import Calculator, Toolbox, execute_tool_calls

log = logging.getLogger("relayrl.remote_rollout")


@dataclass
class AppState:
    """What every rollout shares: config, tools, tokenizers, one HTTP client, the semaphore."""

    config: ServerConfig
    toolbox: Toolbox
    tokenizers: TokenizerCache
    http_client: httpx.AsyncClient | None = None
    semaphore: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(100))
    active: int = 0
    peak_active: int = 0
    completed: int = 0
    errors: int = 0

    @classmethod
    def create(cls, config: ServerConfig, toolbox: Toolbox | None = None,
               loader: Callable[[str], ChatTokenizer] | None = None) -> AppState:
        """State for `config`; the calculator and the configured tokenizer backend by default."""
        if toolbox is None:
            toolbox = Calculator((config.tool_delay_min_s, config.tool_delay_max_s),
                                 config.tool_seed)
        if loader is None:
            def loader(name: str) -> ChatTokenizer:
                return load_tokenizer(name, config.tokenizer_backend,
                                      config.tokenizer_trust_remote_code)
        return cls(config=config, toolbox=toolbox,
                   tokenizers=TokenizerCache(config.tokenizer_cache_size, loader),
                   semaphore=asyncio.Semaphore(config.max_concurrent_rollouts))

    def open_client(self) -> httpx.AsyncClient:
        """The shared client (made on first use, inside the running loop)."""
        if self.http_client is None:
            self.http_client = pooled_client(
                self.config.http_client_timeout, self.config.max_concurrent_rollouts
            )
        return self.http_client

    async def aclose(self) -> None:
        """Close the HTTP client."""
        if self.http_client is not None:
            await self.http_client.aclose()
            self.http_client = None


async def execute_rollout(state: AppState, req: RolloutRequest) -> RolloutResponse:
    """Run one rollout once a concurrency slot is free; never raises for a rollout's failure."""
    async with state.semaphore:
        state.active += 1
        state.peak_active = max(state.peak_active, state.active)
        try:
            resp = await _run(state, req)
        finally:
            state.active -= 1
    if resp.status == RolloutStatus.ERROR:
        state.errors += 1
        log.warning("rollout %s failed: %s", req.rollout_id, resp.error_message)
    else:
        state.completed += 1
    return resp


async def _run(state: AppState, req: RolloutRequest) -> RolloutResponse:
    start = time.perf_counter()
    session: RolloutSession | None = None
    tool_s = 0.0
    tool_calls = tool_errors = 0

    def answer(status: RolloutStatus, finish: FinishReason, error: str | None = None
               ) -> RolloutResponse:
        s = session
        metrics = RolloutMetrics(
            total_latency_ms=(time.perf_counter() - start) * 1000,
            llm_latency_ms=(s.llm_latency_s * 1000) if s else 0.0,
            tool_latency_ms=tool_s * 1000, num_llm_calls=s.num_llm_calls if s else 0,
            num_tool_calls=tool_calls, num_tool_errors=tool_errors,
            prompt_tokens=s.last_prompt_tokens if s else 0,
            completion_tokens=s.completion_tokens if s else 0)
        final = s.messages if s else []
        return RolloutResponse(rollout_id=req.rollout_id, status=status, final_messages=final,
                               finish_reason=finish, error_message=error, metrics=metrics)

    name = req.tokenizer_name or state.config.default_tokenizer
    try:
        tokenizer = await state.tokenizers.get(name)
    except TokenizerLoadError as e:
        return answer(RolloutStatus.ERROR, "error", f"tokenizer load failed: {e}")
    tools = req.tools if req.tools is not None else state.toolbox.definitions()
    session = RolloutSession(req.rollout_id, req.messages, tokenizer, state.open_client(),
                             req.server_url, req.callback_api_key, tools)
    try:
        for _ in range(req.max_turns):
            # the budget covers the whole trajectory: prompt and everything sampled so far
            room = req.max_tokens_total - session.prompt_length()
            if room <= 0:
                return answer(RolloutStatus.COMPLETED, "max_tokens")
            await session.call_llm(req.sampling_params, min(req.sampling_params.max_tokens, room))
            calls = session.messages[-1].tool_calls or []
            if not calls:
                return answer(RolloutStatus.COMPLETED, "stop")
            if session.last_prompt_length >= req.max_tokens_total:
                return answer(RolloutStatus.COMPLETED, "max_tokens")
            if session.num_llm_calls >= req.max_turns:
                return answer(RolloutStatus.COMPLETED, "max_turns")
            t0 = time.perf_counter()
            try:
                results = await execute_tool_calls(state.toolbox, calls)
            except Exception as e:  # a tool crashed (not a refusal the model can read)
                log.exception("rollout %s: tool crashed", req.rollout_id)
                return answer(RolloutStatus.ERROR, "error",
                              f"tool execution failed: {type(e).__name__}: {e}")
            finally:
                tool_s += time.perf_counter() - t0
            tool_calls += len(results)
            tool_errors += sum(r.error for r in results)
            session.messages.extend(r.message for r in results)
        return answer(RolloutStatus.COMPLETED, "max_turns")
    except TrainerCallError as e:
        return answer(RolloutStatus.ERROR, "error", f"trainer callback failed: {e}")
    except TokenizerLoadError as e:
        return answer(RolloutStatus.ERROR, "error", f"tokenizer failed: {e}")
    except Exception as e:  # e.g. a template that rejects the conversation: never a 500
        log.exception("rollout %s: unexpected error", req.rollout_id)
        return answer(RolloutStatus.ERROR, "error",
                      f"rollout failed in the agent loop: {type(e).__name__}: {e}")


__all__ = ["AppState", "execute_rollout"]
