"""The Responses tool kinds coding agents send (namespace, custom, local_shell, hosted tools),
served over a real gateway through the real `openai` SDK, and echoed back as the next turn."""

from __future__ import annotations

import json
from typing import Any

import httpx
from openai import OpenAI

from tests.gateway.conftest import Gateway

NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
             "tools": [{"type": "function", "name": "spawn_agent", "description": "Start one.",
                        "strict": False,
                        "parameters": {"type": "object",
                                       "properties": {"task": {"type": "string"}}}}]}
PATCH_GRAMMAR = 'start: "*** Begin Patch" LF hunk+ "*** End Patch"'
CUSTOM = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
          "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}}
SHELL = {"type": "local_shell"}
HOSTED = {"type": "web_search", "external_web_access": False}
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"


def tool_call(name: str, args: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def client_for(gw: Gateway, session: dict) -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key=session["api_key"], max_retries=0)


def post(gw: Gateway, session: dict, body: dict[str, Any]) -> dict[str, Any]:
    r = client_for(gw, session).post("/responses", body=body, cast_to=object)
    assert isinstance(r, dict)
    return r


def segments(gw: Gateway, session: dict) -> int:
    return gw.deps.store.get(session["session_id"]).stats().segments


def test_a_namespaced_tool_is_rendered_and_called_back_with_its_namespace(gw: Gateway) -> None:
    gw.script.replies += [tool_call("multi_agent_v1.spawn_agent", {"task": "t"}), "Started."]
    s = gw.start_session()
    user = [{"role": "user", "content": "go"}]
    r1 = post(gw, s, {"model": "m", "input": user, "tools": [NAMESPACE]})
    prompt = gw.deps.renderer.decode(gw.script.requests[0].prompt_ids)
    assert "multi_agent_v1.spawn_agent" in prompt and "Start one." in prompt
    call = r1["output"][-1]
    assert (call["type"], call["namespace"], call["name"]) == (
        "function_call", "multi_agent_v1", "spawn_agent")
    follow = [*user, call, {"type": "function_call_output", "call_id": call["call_id"],
                            "output": "agent 7"}]
    r2 = post(gw, s, {"model": "m", "input": follow, "tools": [NAMESPACE]})
    assert r2["output"][-1]["content"][0]["text"] == "Started."
    assert segments(gw, s) == 1  # the echoed call extends the recorded tokens


def test_a_custom_tool_call_carries_its_input_and_comes_back_as_the_same_call(
        gw: Gateway) -> None:
    gw.script.replies += [tool_call("apply_patch", {"input": PATCH}), "Patched."]
    s = gw.start_session()
    user = [{"role": "user", "content": "add a.txt"}]
    r1 = post(gw, s, {"model": "m", "input": user, "tools": [CUSTOM]})
    rendered = gw.deps.renderer.decode(gw.script.requests[0].prompt_ids)
    assert json.dumps(PATCH_GRAMMAR)[1:-1] in rendered  # the tools are rendered as JSON
    call = r1["output"][-1]
    assert (call["type"], call["name"], call["input"]) == ("custom_tool_call", "apply_patch",
                                                           PATCH)
    follow = [*user, call, {"type": "custom_tool_call_output", "call_id": call["call_id"],
                            "output": "Done!"}]
    r2 = post(gw, s, {"model": "m", "input": follow, "tools": [CUSTOM]})
    assert r2["status"] == "completed"
    assert segments(gw, s) == 1
    tool_turn = gw.deps.renderer.decode(gw.script.requests[1].prompt_ids)
    assert "Done!" in tool_turn


def test_a_local_shell_call_is_an_exec_action_and_its_echo_extends_the_segment(
        gw: Gateway) -> None:
    gw.script.replies += [tool_call("local_shell", {"command": ["ls", "-a"]}), "Listed."]
    s = gw.start_session()
    user = [{"role": "user", "content": "list"}]
    call = post(gw, s, {"model": "m", "input": user, "tools": [SHELL]})["output"][-1]
    assert call["type"] == "local_shell_call"
    assert call["action"] == {"type": "exec", "command": ["ls", "-a"]}
    # what a client sends back fills the action's unset fields with nulls
    echoed = {**call, "action": {**call["action"], "timeout_ms": None,
                                 "working_directory": None, "env": None, "user": None}}
    follow = [*user, echoed, {"type": "function_call_output", "call_id": call["call_id"],
                              "output": ". .."}]
    post(gw, s, {"model": "m", "input": follow, "tools": [SHELL]})
    assert segments(gw, s) == 1


def test_hosted_tools_and_their_items_are_left_out_and_named_in_the_metadata(
        gw: Gateway) -> None:
    s = gw.start_session()
    searched = {"type": "web_search_call", "status": "completed",
                "action": {"type": "search", "query": "q"}}
    body = {"model": "m", "tools": [HOSTED, CUSTOM],
            "input": [{"role": "user", "content": "hi"}, searched]}
    assert post(gw, s, body)["status"] == "completed"
    prompt = gw.deps.renderer.decode(gw.script.requests[0].prompt_ids)
    assert "web_search" not in prompt
    meta = gw.deps.store.get(s["session_id"]).interactions[0].metadata
    assert meta["responses_tools"]["hosted"] == ["web_search"]
    assert meta["left_out_items"] == ["web_search_call"]


def test_streamed_custom_and_namespaced_calls_end_as_the_items_a_client_expects(
        gw: Gateway) -> None:
    gw.script.replies.append(tool_call("apply_patch", {"input": PATCH}) + "\n"
                             + tool_call("multi_agent_v1.spawn_agent", {"task": "x"}))
    s = gw.start_session()
    tools = [CUSTOM, NAMESPACE]
    with client_for(gw, s).responses.stream(model="m", input="go", tools=tools) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_response()
    custom, spawn = final.output[-2:]
    assert custom.type == "custom_tool_call" and custom.input == PATCH
    assert spawn.type == "function_call" and spawn.name == "spawn_agent"
    assert spawn.namespace == "multi_agent_v1"  # type: ignore[attr-defined]
    assert "response.custom_tool_call_input.done" in kinds
    assert "response.function_call_arguments.delta" in kinds


def test_no_max_output_tokens_leaves_the_reply_the_whole_context(gw: Gateway) -> None:
    long_reply = " ".join(["word"] * 1500)  # over the 1,024 a chat call gets by default
    gw.script.replies.append(long_reply)
    s = gw.start_session()
    r = post(gw, s, {"model": "m", "input": "talk"})
    assert r["status"] == "completed"
    assert r["usage"]["output_tokens"] > 1024
    assert r["max_output_tokens"] is not None and r["max_output_tokens"] > 8000


def test_a_base_url_answers_a_reachability_check(gw: Gateway) -> None:
    s = gw.start_session()
    with httpx.Client() as c:
        for url in (gw.url + "/", s["base_url"].removesuffix("/v1"),
                    s["base_url"].removesuffix("/v1") + "/"):
            assert c.head(url).status_code == 200, url
            assert c.get(url).json()["status"] == "ok"
