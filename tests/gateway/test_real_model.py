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
    # the reply was echoed exactly (cut by max_tokens or not), so the second call extended it
    assert len(rows) == 1
    row = rows[0]
    sampled = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
    assert tok.decode(sampled).startswith(text)
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


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of sampled (loss_mask 1) tokens."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def _ask(api: str, gw: Gateway, key: str, history: list[dict], max_tokens: int) -> tuple[dict, str]:
    """One call in `api`; returns (the assistant turn to echo, the wire's finish reason)."""
    if api == "anthropic":
        client = anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0)
        m = client.messages.create(model="m", max_tokens=max_tokens, messages=history,
                                   extra_body={"temperature": 0})
        return {"role": "assistant", "content": m.content[0].text}, str(m.stop_reason)
    client = OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    if api == "responses":
        r = client.responses.create(model="m", input=history, max_output_tokens=max_tokens,
                                    temperature=0)
        reason = r.incomplete_details.reason if r.incomplete_details else "completed"
        return {"role": "assistant", "content": r.output_text}, str(reason)
    stream = api == "chat-stream"
    if stream:
        text, reason = "", ""
        for c in client.chat.completions.create(model="m", messages=history, stream=True,
                                                max_tokens=max_tokens, temperature=0):
            if c.choices:
                text += c.choices[0].delta.content or ""
                reason = c.choices[0].finish_reason or reason
        return {"role": "assistant", "content": text}, reason
    r = client.chat.completions.create(model="m", messages=history, max_tokens=max_tokens,
                                       temperature=0)
    return {"role": "assistant", "content": r.choices[0].message.content}, \
        str(r.choices[0].finish_reason)


@pytest.mark.parametrize("api", ["chat", "chat-stream", "responses", "anthropic"])
def test_a_reply_cut_by_max_tokens_and_echoed_stays_one_row(real_gw: Gateway, api: str) -> None:
    s = real_gw.start_session()
    history = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    first, reason = _ask(api, real_gw, s["api_key"], history, max_tokens=6)
    assert reason in ("length", "max_tokens", "max_output_tokens")  # the cut really happened
    history += [first, {"role": "user", "content": "Go on."}]
    _ask(api, real_gw, s["api_key"], history, max_tokens=4)
    rows = real_gw.export(s["session_id"], style="concat")
    assert len(rows) == 1  # one linear conversation: its shared prefix is trained once
    row, tok = rows[0], real_gw.deps.renderer
    (a0, a1), (b0, _) = _spans(row["loss_mask"])
    assert a1 - a0 == 6 and tok.decode(row["input_ids"][a0:a1]).startswith(first["content"])
    # what the template closes the cut turn with is prompt: not trained, no policy version
    glue = row["input_ids"][a1:b0]
    assert glue[0] == tok.encode("<|im_end|>")[0]
    assert all(v == -1 for v in row["versions"][a1:b0])
    assert tok.decode(glue).startswith("<|im_end|>\n<|im_start|>user\nGo on.")


def test_a_cut_reply_echoed_with_other_text_opens_a_new_segment(real_gw: Gateway) -> None:
    s = real_gw.start_session()
    history = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    first, _ = _ask("chat", real_gw, s["api_key"], history, max_tokens=6)
    edited = {"role": "assistant", "content": first["content"] + " and then it ended."}
    _ask("chat", real_gw, s["api_key"], [*history, edited, {"role": "user", "content": "Ok"}], 4)
    session = real_gw.deps.store.get(s["session_id"], touch=False)
    assert [str(c.branch_reason) for c in session.interactions] == ["first", "history_edited"]
    assert len(real_gw.export(s["session_id"], style="concat")) == 2
