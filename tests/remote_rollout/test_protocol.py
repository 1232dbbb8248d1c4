"""Both sides of the protocol over loopback HTTP: the rollout server calls a fake-engine gateway.

The fake engine scripts the model's replies; the tokenizer, chat template, gateway, rollout
server and HTTP are real, so the masks the server sends are checked against the gateway's own
incremental prompts.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from relayrl.gateway.rollout_callback import METADATA_KEY
from relayrl.remote_rollout.schemas import RolloutResponse

from .conftest import FakeGateway, start_rollout_server, tool_call_text

QUESTION = [{"role": "system", "content": "Use the calculator tools."},
            {"role": "user", "content": "What is 15 * 23?"}]


def rollout(server_url: str, gw: FakeGateway, session: dict, **extra) -> RolloutResponse:
    body = {"rollout_id": "r-1", "messages": QUESTION,
            "server_url": session["base_url"].removesuffix("/v1"),
            "callback_api_key": session["api_key"],
            "sampling_params": {"temperature": 0.0, "max_tokens": 256}, **extra}
    r = httpx.post(f"{server_url}/rollout", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return RolloutResponse.model_validate(r.json())


def mask_stats(gw: FakeGateway, session: dict) -> dict:
    rows = gw.export(session["session_id"])
    return rows[0]["metadata"]["session"][METADATA_KEY]


def test_calculator_rollout_masks_agree(gw: FakeGateway, rollout_server) -> None:
    server, _state = rollout_server
    gw.script.replies += [tool_call_text("multiply", a=15, b=23), "The answer is 345."]
    session = gw.start_session()
    resp = rollout(server.url, gw, session)
    assert resp.status == "COMPLETED" and resp.finish_reason == "stop"
    roles = [m.role for m in resp.final_messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert resp.final_messages[3].content == "345"
    assert resp.final_messages[-1].content == "The answer is 345."
    assert resp.metrics.num_llm_calls == 2 and resp.metrics.num_tool_calls == 1
    stats = mask_stats(gw, session)
    assert stats["mask_checks"] == 2 and stats["mask_mismatches"] == 0
    assert stats["rollouts"] == {"r-1": {"checks": 2, "mismatches": 0}}
    # the tools the server offered reached the prompt the gateway rendered
    prompt_text = gw.deps.renderer.decode(gw.script.requests[0].prompt_ids)
    assert '"name": "divide"' in prompt_text


def test_different_template_is_detected(gw: FakeGateway, model_dir: str, tmp_path: Path) -> None:
    from .conftest import different_template_dir

    other = different_template_dir(model_dir, tmp_path)
    server, _ = start_rollout_server(default_tokenizer=str(other))
    try:
        gw.script.replies += [tool_call_text("add", a=2, b=3), "5"]
        session = gw.start_session()
        resp = rollout(server.url, gw, session)
        assert resp.status == "COMPLETED" and resp.metrics.num_llm_calls == 2
        stats = mask_stats(gw, session)
        assert stats["mask_checks"] == 2 and stats["mask_mismatches"] == 1
        example = stats["mismatch_examples"][0]
        assert example["rollout_id"] == "r-1" and example["expected_len"] != example["got_len"]
    finally:
        server.stop()


def test_division_by_zero_is_told_to_the_model(gw: FakeGateway, rollout_server) -> None:
    server, _ = rollout_server
    gw.script.replies += [tool_call_text("divide", a=1, b=0), "It cannot be divided."]
    session = gw.start_session()
    resp = rollout(server.url, gw, session)
    assert resp.status == "COMPLETED" and resp.finish_reason == "stop"
    tool = resp.final_messages[3]
    assert tool.role == "tool" and tool.content.startswith("Error: division by zero")
    assert resp.metrics.num_tool_errors == 1
    # the error text was in the prompt of the second call
    assert "division by zero" in gw.deps.renderer.decode(gw.script.requests[1].prompt_ids)


def test_parallel_tool_calls_in_one_turn(gw: FakeGateway, rollout_server) -> None:
    server, _ = rollout_server
    two = tool_call_text("add", a=1, b=2) + "\n" + tool_call_text("multiply", a=3, b=4)
    gw.script.replies += [two, "3 and 12"]
    session = gw.start_session()
    resp = rollout(server.url, gw, session)
    assert [m.content for m in resp.final_messages if m.role == "tool"] == ["3", "12"]
    assert resp.metrics.num_tool_calls == 2
    assert mask_stats(gw, session)["mask_mismatches"] == 0


def test_max_turns(gw: FakeGateway, rollout_server) -> None:
    server, _ = rollout_server
    gw.script.replies += [tool_call_text("add", a=1, b=i) for i in range(5)]
    session = gw.start_session()
    resp = rollout(server.url, gw, session, max_turns=2)
    assert resp.status == "COMPLETED" and resp.finish_reason == "max_turns"
    assert resp.metrics.num_llm_calls == 2 and len(gw.script.requests) == 2


def test_max_tokens_total(gw: FakeGateway, rollout_server) -> None:
    server, _ = rollout_server
    gw.script.replies += [tool_call_text("add", a=1, b=i) for i in range(5)]
    session = gw.start_session()
    # room for the first prompt and a little more, not for a second turn
    first = rollout(server.url, gw, gw.start_session(), max_turns=1)
    budget = first.metrics.prompt_tokens + 40
    gw.script.replies[:] = [tool_call_text("add", a=1, b=i) for i in range(5)]
    resp = rollout(server.url, gw, session, max_tokens_total=budget, max_turns=10)
    assert resp.status == "COMPLETED" and resp.finish_reason == "max_tokens"
    assert resp.metrics.num_llm_calls == 1
    # the one call was asked for no more tokens than the budget left
    assert gw.script.requests[-1].params.max_new_tokens <= 40


def test_errors_are_status_error_or_422(gw: FakeGateway, rollout_server) -> None:
    server, _ = rollout_server
    r = httpx.post(f"{server.url}/rollout", json={"rollout_id": "x", "messages": []}, timeout=30)
    assert r.status_code == 422
    session = gw.start_session()
    # a tokenizer the server was configured with, that fails to load: a failed rollout
    broken, _ = start_rollout_server(default_tokenizer="/nonexistent/tokenizer")
    try:
        resp = rollout(broken.url, gw, session)
    finally:
        broken.stop()
    assert resp.status == "ERROR" and resp.finish_reason == "error"
    assert resp.error_message.startswith("tokenizer load failed")
    # nobody listens on the callback: an HTTP error, reported, not raised
    body = {"rollout_id": "y", "messages": QUESTION, "server_url": "http://127.0.0.1:9",
            "callback_api_key": "k"}
    r = httpx.post(f"{server.url}/rollout", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ERROR"
    assert r.json()["error_message"].startswith("trainer callback failed")
    # a closed session answers 409, which the server reports
    gw.script.replies += ["fine"]
    with gw.admin() as c:
        c.post("/rl/end_session", headers={"authorization": f"Bearer {session['api_key']}"})
    resp = rollout(server.url, gw, session)
    assert resp.status == "ERROR" and "409" in resp.error_message
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    assert health["status"] == "ok" and health["errors"] == 2


def test_tools_endpoint(rollout_server) -> None:
    server, _ = rollout_server
    tools = httpx.get(f"{server.url}/tools", timeout=10).json()["tools"]
    assert [t["function"]["name"] for t in tools] == ["add", "subtract", "multiply", "divide"]


def test_gateway_returns_token_ids_and_refuses_bad_protocol_calls(gw: FakeGateway) -> None:
    gw.script.replies += ["hello"]
    session = gw.start_session()
    url = session["base_url"] + "/chat/completions"
    auth = {"authorization": f"Bearer {session['api_key']}"}
    body = {"messages": [{"role": "user", "content": "hi"}], "return_token_ids": True}
    r = httpx.post(url, json=body, headers=auth, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    renderer = gw.deps.renderer
    assert out["prompt_token_ids"] == gw.script.requests[0].prompt_ids
    assert renderer.decode(out["token_ids"]) == "hello<|im_end|>"
    assert out["choices"][0]["token_ids"] == out["token_ids"]
    # a mask with something other than 0/1 is a 400 in OpenAI's error shape
    bad = {**body, "rollout_id": "r", "response_mask": [0, 2]}
    r = httpx.post(url, json=bad, headers=auth, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_mask"
    # protocol calls are not streamed
    r = httpx.post(url, json={**body, "rollout_id": "r", "response_mask": None, "stream": True},
                   headers=auth, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    # outside a session, relayrl has no record to check against
    r = httpx.post(f"{gw.url}/v1/chat/completions", json={**body, "rollout_id": "r"},
                   headers={"authorization": "Bearer admin-test-key"}, timeout=30)
    assert r.status_code == 400


@pytest.mark.parametrize("mask", [None, [0, 0]])
def test_first_call_mask(gw: FakeGateway, mask) -> None:
    gw.script.replies += ["a"]
    session = gw.start_session()
    body = {"messages": [{"role": "user", "content": "hi"}], "rollout_id": "r",
            "response_mask": mask}
    r = httpx.post(session["base_url"] + "/chat/completions", json=body,
                   headers={"authorization": f"Bearer {session['api_key']}"}, timeout=30)
    assert r.status_code == 200
    stats = mask_stats(gw, session)
    assert stats["mask_checks"] == 1
    # a first call carries no mask; a mask there claims tokens relayrl never saw added
    assert stats["mask_mismatches"] == (0 if mask is None else 1)
