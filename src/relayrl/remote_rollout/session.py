"""`RolloutSession`: one rollout's conversation and its `response_mask` bookkeeping.

Before each LLM call the session renders its messages with the chat template; every token past
`last_prompt_length` was added by the server since the previous call (tool outputs, the
template's glue and generation prompt), so it is sent as a 0 in `response_mask`. The first call
sends None. After the call, `last_prompt_length` = prompt length + sampled tokens. The
arithmetic assumes the template re-renders the model's reply as the very tokens it sampled; the
trainer checks that (relayrl counts a disagreement). May import this package's schemas and
tokenizer protocol, and httpx; nothing of relayrl's gateway.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import httpx
from pydantic import ValidationError

from relayrl.remote_rollout.schemas import (
    CompletionsResponse,
    Message,
    SamplingParams,
    ToolCall,
    ToolDefinition,
)
from relayrl.remote_rollout.tokenizer import ChatTokenizer


class TrainerCallError(Exception):
    """The trainer's completions endpoint failed, refused the call, or answered junk."""


class RolloutSession:
    """The conversation of one rollout, the token count the trainer has seen, and the callback."""

    def __init__(self, rollout_id: str, messages: Sequence[Message], tokenizer: ChatTokenizer,
                 http_client: httpx.AsyncClient | None, server_url: str,
                 api_key: str | None = None, tools: Sequence[ToolDefinition] | None = None,
                 model: str = "default") -> None:
        self.rollout_id = rollout_id
        self.messages: list[Message] = list(messages)
        self.tokenizer = tokenizer
        self.http_client = http_client
        self.server_url = server_url.rstrip("/")
        self._api_key = api_key
        self.tools = list(tools or [])
        self.model = model
        self.last_prompt_length = 0
        """Tokens of the trajectory the trainer has seen: last prompt + its sampled reply."""
        self.num_llm_calls = 0
        self.completion_tokens = 0
        self.last_prompt_tokens = 0
        self.llm_latency_s = 0.0
        self.masks: list[list[int] | None] = []
        """Every response_mask sent, in call order (for tests and debugging)."""
        self._rendered: tuple[int, int] | None = None

    @property
    def completions_url(self) -> str:
        """Where the callbacks go."""
        return f"{self.server_url}/v1/chat/completions"

    def prompt_length(self) -> int:
        """Tokens of the current conversation rendered with the generation prompt."""
        # the agent loop asks twice per turn (budget, then mask); messages are only appended
        n = len(self.messages)
        if self._rendered is not None and self._rendered[0] == n:
            return self._rendered[1]
        length = len(self.tokenizer.apply_chat_template(
            [m.to_wire() for m in self.messages],
            [t.model_dump() for t in self.tools] or None, add_generation_prompt=True))
        self._rendered = (n, length)
        return length

    def next_mask(self) -> tuple[list[int] | None, int]:
        """The response_mask for the next call, and the prompt length it was computed from."""
        length = self.prompt_length()
        new = length - self.last_prompt_length
        mask = [0] * new if self.last_prompt_length > 0 and new > 0 else None
        return mask, length

    def record_reply(self, prompt_length: int, token_ids: Sequence[int]) -> None:
        """Advance the bookkeeping past a call whose prompt had `prompt_length` tokens."""
        self.last_prompt_length = prompt_length + len(token_ids)

    def request_body(self, params: SamplingParams, mask: list[int] | None,
                     max_tokens: int | None = None) -> dict[str, Any]:
        """The callback's JSON body."""
        body: dict[str, Any] = {
            **params.model_dump(exclude_none=True),
            "model": self.model,
            "messages": [m.to_wire() for m in self.messages],
            "rollout_id": self.rollout_id,
            "response_mask": mask,
            "return_token_ids": True,
        }
        if self.tools:
            body["tools"] = [t.model_dump() for t in self.tools]
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if not params.logprobs:
            body.pop("logprobs", None)
        return body

    async def call_llm(self, params: SamplingParams,
                       max_tokens: int | None = None) -> CompletionsResponse:
        """One callback: send the messages and mask, append the reply, advance the bookkeeping."""
        if self.http_client is None:
            raise TrainerCallError("the session has no HTTP client")
        mask, length = self.next_mask()
        headers = {"authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        start = time.perf_counter()
        try:
            resp = await self.http_client.post(self.completions_url, headers=headers,
                                               json=self.request_body(params, mask, max_tokens))
        except httpx.HTTPError as e:
            raise TrainerCallError(f"could not reach the trainer at {self.completions_url}: "
                                   f"{type(e).__name__}: {e}") from e
        finally:
            self.llm_latency_s += time.perf_counter() - start
        if resp.status_code >= 400:
            raise TrainerCallError(f"the trainer answered {resp.status_code}: {_error_text(resp)}")
        try:
            reply = CompletionsResponse.model_validate(resp.json())
        except (ValueError, ValidationError) as e:
            raise TrainerCallError(f"the trainer's answer is not a completions response with "
                                   f"token_ids: {_first_line(e)}") from None
        self.masks.append(mask)
        self.num_llm_calls += 1
        self.completion_tokens += len(reply.token_ids)
        self.last_prompt_tokens = length
        self.record_reply(length, reply.token_ids)
        self.messages.append(assistant_message(reply))
        return reply


def assistant_message(reply: CompletionsResponse) -> Message:
    """The first choice's assistant message as a protocol message."""
    msg = reply.choices[0].message
    calls = [ToolCall.model_validate(c) for c in msg.tool_calls or ()]
    return Message(role="assistant", content=msg.content, tool_calls=calls or None)


def _error_text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])[:500]
    return str(body)[:500]


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


__all__ = ["RolloutSession", "TrainerCallError", "assistant_message"]
