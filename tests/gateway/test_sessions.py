"""Sessions, keys, rewards, export and capacity over HTTP."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

from tests.gateway.conftest import ADMIN, Gateway, fake_gateway
from tests.gateway.test_openai_chat import ADD_TOOL, call


def chat(gw: Gateway, key: str, messages: list, base: str | None = None, **kw):
    client = OpenAI(base_url=base or gw.url + "/v1", api_key=key, max_retries=0)
    return client.chat.completions.create(model="m", messages=messages, **kw)


def test_a_five_turn_tool_episode_exports_as_one_sequence_equal_to_the_engine_tokens(
        gw: Gateway) -> None:
    gw.script.replies += [call("add", a=i, b=1) for i in range(4)] + ["Done: 4."]
    s = gw.start_session(task_id="five")
    messages: list = [{"role": "system", "content": "Use tools."},
                      {"role": "user", "content": "Count up with add."}]
    for turn in range(5):
        r = chat(gw, s["api_key"], messages, tools=[ADD_TOOL])
        msg = r.choices[0].message
        messages.append(msg.model_dump())
        for tc in msg.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": str(turn + 1)})
    httpx.post(gw.url + "/rl/set_reward", json={"reward": 1.0},
               headers={"authorization": f"Bearer {s['api_key']}"}).raise_for_status()
    rows = gw.export(s["session_id"], style="concat", discount=0.5)
    assert len(rows) == 1
    row = rows[0]
    reqs = gw.script.requests
    last = reqs[-1]
    # the segment is the last prompt followed by the last output, and each earlier prompt is a prefix
    assert row["input_ids"][: len(last.prompt_ids)] == list(last.prompt_ids)
    for r in reqs:
        assert row["input_ids"][: len(r.prompt_ids)] == list(r.prompt_ids)
    n = len(row["input_ids"])
    assert len(row["loss_mask"]) == len(row["logprobs"]) == len(row["versions"]) == n
    sampled = [i for i in range(n) if row["loss_mask"][i] == 1]
    assert all(row["versions"][i] >= 0 for i in sampled)
    assert all(row["versions"][i] == -1 for i in range(n) if row["loss_mask"][i] == 0)
    assert all(row["logprobs"][i] < 0 for i in sampled)
    assert row["reward"] == pytest.approx(1.0)
    individual = gw.export(s["session_id"], style="individual", discount=0.5)
    assert [r["reward"] for r in individual] == pytest.approx([0.0625, 0.125, 0.25, 0.5, 1.0])


def test_export_is_idempotent_until_acknowledged(gw: Gateway) -> None:
    s = gw.start_session()
    chat(gw, s["api_key"], [{"role": "user", "content": "hi"}])
    first = gw.export(s["session_id"])
    assert gw.export(s["session_id"]) == first
    with gw.admin() as c:
        c.post("/rl/ack_export", json={"session_id": s["session_id"]}).raise_for_status()
        assert c.post("/export_trajectories",
                      json={"session_id": s["session_id"]}).status_code == 404


def test_a_session_key_reaches_only_its_own_session(gw: Gateway) -> None:
    a, b = gw.start_session(), gw.start_session()
    chat(gw, a["api_key"], [{"role": "user", "content": "a"}])
    h = {"authorization": f"Bearer {b['api_key']}"}
    # b's key cannot end or reward a (rewards apply to the caller's own session only)
    r = httpx.post(gw.url + "/rl/set_reward", json={"reward": 1.0}, headers=h)
    assert r.status_code == 404  # b has no calls; a's are not reachable with b's key
    # nor can it call admin routes
    r = httpx.post(gw.url + "/export_trajectories", json={"session_id": a["session_id"]},
                   headers=h)
    assert r.status_code == 401
    # and an interaction id of a's is unknown within b
    iid = gw.export(a["session_id"])[0]["interaction_ids"][0]
    r = httpx.post(gw.url + "/rl/set_reward", json={"interaction_id": iid, "reward": 1.0},
                   headers=h)
    assert r.status_code == 404


def test_calls_after_end_session_get_409(gw: Gateway) -> None:
    s = gw.start_session()
    h = {"authorization": f"Bearer {s['api_key']}"}
    httpx.post(gw.url + "/rl/end_session", headers=h).raise_for_status()
    with pytest.raises(openai.ConflictError):
        chat(gw, s["api_key"], [{"role": "user", "content": "late"}])


def test_sessions_are_reached_by_key_never_by_id(gw: Gateway) -> None:
    s = gw.start_session()
    # the base URL carries the session key, not the id
    assert s["base_url"].endswith(f"/s/{s['api_key']}/v1") and s["session_id"] not in s["base_url"]
    chat(gw, "anything", [{"role": "user", "content": "hi"}], base=s["base_url"])
    assert len(gw.export(s["session_id"])) == 1
    # the id-addressed form and the `?session_id=` query parameter are gone: an id opens nothing
    for base in (gw.url + f"/sessions/{s['session_id']}/v1", gw.url + "/sessions/x/v1"):
        with pytest.raises(openai.NotFoundError):
            chat(gw, s["api_key"], [{"role": "user", "content": "hi"}], base=base)
    r = httpx.post(gw.url + "/v1/chat/completions", params={"session_id": s["session_id"]},
                   json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401
    assert len(gw.export(s["session_id"])) == 1  # nothing landed in the session


def test_control_routes_need_the_admin_key(gw: Gateway) -> None:
    for path in ("/grant_capacity", "/rl/start_session", "/export_trajectories",
                 "/rl/ack_export"):
        assert httpx.post(gw.url + path, json={}).status_code == 401
        assert httpx.post(gw.url + path, json={},
                          headers={"authorization": "Bearer nope"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        chat(gw, "not-a-key", [{"role": "user", "content": "x"}])


def test_capacity_follows_the_staleness_rule_and_429s_when_spent(model_dir: str) -> None:
    g = fake_gateway(model_dir, max_staleness=0, batch_size=2)
    try:
        with g.admin() as c:
            assert c.post("/grant_capacity").json() == {"capacity": 2}
            for _ in range(2):
                c.post("/rl/start_session", json={}).raise_for_status()
            assert c.post("/grant_capacity").json() == {"capacity": 0}
            r = c.post("/rl/start_session", json={})
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    finally:
        g.thread.stop()


def test_the_rl_v1_spellings_work(gw: Gateway) -> None:
    with gw.admin() as c:
        s = c.post("/rl/v1/start_session", json={"task_id": "t"}).json()
    r = chat(gw, s["api_key"], [{"role": "user", "content": "x"}])
    h = {"authorization": f"Bearer {s['api_key']}"}
    httpx.post(gw.url + "/rl/v1/set_reward", json={"completion_id": r.id, "reward": 0.5},
               headers=h).raise_for_status()
    httpx.post(gw.url + "/rl/v1/finalize", json={"final_reward": 0.5},
               headers=h).raise_for_status()
    rows = gw.export(s["session_id"], credit="outcome")
    assert rows[0]["reward"] == pytest.approx(0.5)


def test_rewards_must_be_finite_numbers(gw: Gateway) -> None:
    s = gw.start_session()
    chat(gw, s["api_key"], [{"role": "user", "content": "x"}])
    h = {"authorization": f"Bearer {s['api_key']}", "content-type": "application/json"}
    for body in (b'{"reward": "high"}', b'{"reward": NaN}', b"{}"):
        r = httpx.post(gw.url + "/rl/set_reward", content=body, headers=h)
        assert r.status_code == 400, body
    assert ADMIN  # the admin key stays out of error messages
    assert ADMIN not in r.text


def test_an_edited_history_opens_a_sibling_segment(gw: Gateway) -> None:
    gw.script.replies += ["first answer", "second answer"]
    s = gw.start_session()
    r1 = chat(gw, s["api_key"], [{"role": "user", "content": "q"}])
    edited = [{"role": "user", "content": "q"},
              {"role": "assistant", "content": "an answer the model never gave"},
              {"role": "user", "content": "next"}]
    chat(gw, s["api_key"], edited)
    rows = gw.export(s["session_id"], style="concat")
    assert len(rows) == 2
    assert r1.choices[0].message.content == "first answer"
    session = gw.deps.store.get(s["session_id"])
    assert session.stats().branch_reasons.get("history_edited") == 1


def test_an_aborted_session_gives_its_capacity_back_and_is_never_exported(model_dir: str) -> None:
    g = fake_gateway(model_dir, max_staleness=0, batch_size=1)
    try:
        with g.admin() as c:
            s = c.post("/rl/start_session", json={}).json()
            assert c.post("/grant_capacity").json() == {"capacity": 0}
            r = c.post("/rl/abort_session", json={"session_id": s["session_id"]})
            assert r.json()["state"] == "aborted"
            assert c.post("/grant_capacity").json() == {"capacity": 1}
            r = c.post("/export_trajectories", json={"session_id": s["session_id"]})
            assert r.status_code == 409
        with pytest.raises(openai.ConflictError):
            chat(g, s["api_key"], [{"role": "user", "content": "late"}])
    finally:
        g.thread.stop()


def test_a_client_that_leaves_stops_its_generation_and_nothing_is_recorded(model_dir: str) -> None:
    import time

    from relayrl.engine.fake import FakeEngine
    from relayrl.gateway.config import GatewayConfig
    from relayrl.gateway.server import GatewayThread, build_deps
    from tests.gateway.conftest import Gateway

    slow = FakeEngine(["word " * 60], tokenizer_path=model_dir, token_delay_s=0.05)  # ~3 s
    cfg = GatewayConfig(model=model_dir, engine="fake", admin_key=ADMIN)
    thread = GatewayThread(build_deps(cfg, engine=slow)).start()
    g = Gateway(thread.url, thread)
    try:
        s = g.start_session()
        client = OpenAI(base_url=g.url + "/v1", api_key=s["api_key"], max_retries=0, timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        time.sleep(3.5)  # longer than the whole generation would have taken
        assert g.export(s["session_id"]) == []
    finally:
        thread.stop()


def test_a_gateway_without_a_trainer_applies_no_staleness_rule(model_dir: str) -> None:
    g = fake_gateway(model_dir)  # the defaults of `relayrl gateway`
    try:
        with g.admin() as c:
            for _ in range(40):  # used to stop at 16 (a 1 x 8 rule nobody could advance)
                s = c.post("/rl/start_session", json={})
                assert s.status_code == 200, s.text
                c.post("/rl/abort_session", json={"session_id": s.json()["session_id"]})
    finally:
        g.thread.stop()


def test_an_external_trainer_announces_its_version_and_capacity_follows(model_dir: str) -> None:
    g = fake_gateway(model_dir, max_staleness=0, batch_size=2)
    try:
        with g.admin() as c:
            for _ in range(2):
                c.post("/rl/start_session", json={}).raise_for_status()
            assert c.post("/rl/start_session", json={}).status_code == 429
            r = c.post("/rl/v1/set_version", json={"version": 1})
            assert r.json() == {"version": 1, "capacity": 2}
            c.post("/rl/start_session", json={}).raise_for_status()
            back = c.post("/rl/v1/set_version", json={"version": 0})
            assert back.status_code == 400 and "only move forward" in back.text
            assert httpx.get(g.url + "/rl/v1/status").json()["policy_version"] == 1
        assert httpx.post(g.url + "/rl/v1/set_version", json={"version": 5}).status_code == 401
    finally:
        g.thread.stop()
