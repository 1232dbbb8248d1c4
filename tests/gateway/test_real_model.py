"""The real default model behind each API once: token-exact recording with LocalEngine."""

from __future__ import annotations

import anthropic
import pytest
from openai import OpenAI

from tests.gateway.conftest import Gateway

pytestmark = pytest.mark.slow


def test_chat_completions_stream_real_tokens_and_record_them_exactly(real_gw: Gateway) -> None:
    s = real_gw.start_session()
    client = OpenAI(base_url=real_gw.url + "/v1", api_key=s["api_key"], max_retries=0)
    msgs = [{"role": "user", "content": "Name a colour."}]
    stream = client.chat.completions.create(model="m", messages=msgs, max_tokens=12,
                                            temperature=0, stream=True, logprobs=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "Another?"}]
    r2 = client.chat.completions.create(model="m", messages=msgs, max_tokens=8, temperature=0)
    assert text and r2.choices[0].message.content is not None
    rows = real_gw.export(s["session_id"], style="concat")
    tok = real_gw.deps.renderer
    if len(rows) == 1:  # the reply was echoed exactly, so the second call extended the first
        row = rows[0]
        sampled = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        assert tok.decode(sampled).startswith(text)
    else:  # a reply cut by max_tokens is echoed without its end token: a new segment, recorded
        assert len(rows) == 2
    assert all(v == 0 for r in rows for v, m in zip(r["versions"], r["loss_mask"], strict=True) if m)


def test_responses_api_answers_from_the_real_model(real_gw: Gateway) -> None:
    s = real_gw.start_session()
    client = OpenAI(base_url=real_gw.url + "/v1", api_key=s["api_key"], max_retries=0)
    r = client.responses.create(model="m", input="Say hello.", max_output_tokens=10,
                                temperature=0)
    assert r.output_text
    assert r.usage.output_tokens <= 10
    assert len(real_gw.export(s["session_id"])) == 1


def test_anthropic_messages_stream_from_the_real_model(real_gw: Gateway) -> None:
    s = real_gw.start_session()
    client = anthropic.Anthropic(base_url=real_gw.url, api_key=s["api_key"], max_retries=0)
    with client.messages.stream(model="m", max_tokens=10, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "Count to three."}]) as st:
        pieces = list(st.text_stream)
        final = st.get_final_message()
    assert "".join(pieces) == final.content[0].text
    assert final.usage.output_tokens <= 10
    rows = real_gw.export(s["session_id"], style="individual")
    assert len(rows) == 1 and sum(rows[0]["loss_mask"]) == final.usage.output_tokens
