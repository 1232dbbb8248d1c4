"""`POST /v1/messages/count_tokens` (Claude Code and the anthropic SDK call it) through the SDK."""

from __future__ import annotations

import anthropic
import pytest

from tests.gateway.conftest import Gateway
from tests.gateway.test_anthropic import ADD, client_for

MESSAGES = [{"role": "user", "content": "What is 1 + 6?"}]


def test_count_tokens_matches_the_prompt_a_call_would_get(gw: Gateway) -> None:
    s = gw.start_session()
    client = client_for(gw, s)
    counted = client.messages.count_tokens(model="m", system="Use tools.", tools=[ADD],
                                           messages=MESSAGES)
    gw.script.replies.append("7")
    m = client.messages.create(model="m", max_tokens=8, system="Use tools.", tools=[ADD],
                               messages=MESSAGES)
    assert counted.input_tokens == m.usage.input_tokens == len(gw.script.requests[0].prompt_ids)
    without_tools = client.messages.count_tokens(model="m", messages=MESSAGES)
    assert without_tools.input_tokens < counted.input_tokens
    assert len(gw.export(s["session_id"])) == 1  # counting recorded nothing


def test_count_tokens_on_the_session_path_and_with_beta_query(gw: Gateway) -> None:
    s = gw.start_session()
    root = gw.url + f"/s/{s['api_key']}"
    client = anthropic.Anthropic(base_url=root, api_key="unused", max_retries=0)
    counted = client.beta.messages.count_tokens(model="m", messages=MESSAGES)
    assert counted.input_tokens > 0


def test_count_tokens_refuses_a_bad_body_and_a_bad_key(gw: Gateway) -> None:
    s = gw.start_session()
    with pytest.raises(anthropic.BadRequestError):
        client_for(gw, s).messages.count_tokens(model="m", messages=[{"role": "robot"}])
    bad = anthropic.Anthropic(base_url=gw.url, api_key="not-a-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.count_tokens(model="m", messages=MESSAGES)
