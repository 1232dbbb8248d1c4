"""The whole protocol on the real default model: trainer gateway (LocalEngine) <-> rollout server.

The workflow opens a session, the reference server runs the calculator agent and calls the
gateway back for each turn; every response_mask it sends must agree with the gateway's record.
Two worked examples in the prompt (with no tool list, which this 135M model follows far better)
make the untrained model call `add` greedily, so the rollout has a real second turn to check.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from relayrl.client.session_client import SessionClient
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.remote_rollout.workflow import RemoteRolloutConfig, RemoteRolloutWorkflow
from relayrl.workflow.context import EpisodeContext, episode_scope

from .conftest import ADMIN, start_rollout_server

pytestmark = pytest.mark.slow


def _call(i: int, name: str, a: int, b: int) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": name, "arguments": json.dumps({"a": a, "b": b})}}]}


SHOTS = [
    {"role": "system", "content": "You are a calculator assistant. Always call a tool first."},
    {"role": "user", "content": "What is 2 + 3?"}, _call(0, "add", 2, 3),
    {"role": "tool", "content": "5", "tool_call_id": "call_0"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "What is 4 * 6?"}, _call(1, "multiply", 4, 6),
    {"role": "tool", "content": "24", "tool_call_id": "call_1"},
    {"role": "assistant", "content": "24"},
    {"role": "user", "content": "What is 7 + 8?"},
]


def answer_reward(final_messages: list[dict], data: dict) -> float:
    """1 when the last assistant message contains the answer."""
    return 1.0 if data["answer"] in (final_messages[-1].get("content") or "") else 0.0


@pytest.fixture(scope="module")
def real_gateway(model_dir: str) -> Iterator[GatewayThread]:
    cfg = GatewayConfig(model=model_dir, engine="local", admin_key=ADMIN, max_staleness=None)
    thread = GatewayThread(build_deps(cfg)).start()
    yield thread
    thread.stop()


def test_calculator_rollout_on_the_real_model(real_gateway: GatewayThread) -> None:
    server, state = start_rollout_server(tool_delay_min_s=0.01, tool_delay_max_s=0.1,
                                         tool_seed=0)

    async def go():
        client = SessionClient(real_gateway.url, admin_key=ADMIN, timeout_s=300)
        wf = RemoteRolloutWorkflow(server.url, client, answer_reward, RemoteRolloutConfig(
            sampling={"max_tokens": 40, "temperature": 0.0}, max_turns=3, tools=[]))
        try:
            with episode_scope(EpisodeContext(task_id="t", episode_id="e2e", group_id="g")):
                return await wf.arun_episode(None, {"messages": SHOTS, "answer": "15"}), wf
        finally:
            await wf.aclose()
            await client.aclose()

    try:
        rows, wf = asyncio.run(go())
    finally:
        server.stop()
    assert rows is not None
    row = next(iter(rows.values()))
    summary = row.metadata["remote_rollout"]
    calls = summary["metrics"]["num_llm_calls"]
    assert calls >= 2, "the model made no tool call, so no mask was checked after a tool turn"
    assert summary["metrics"]["num_tool_calls"] >= 1
    # every call's mask was checked against the gateway's own prompt, and all agreed
    assert summary["mask_checks"] == calls and summary["mask_mismatches"] == 0
    assert len(row.interaction_ids) == calls  # one segment: each prompt extended the last
    assert row.reward in (0.0, 1.0) and wf.stats["completed"] == 1
    assert state.completed == 1 and state.errors == 0
