"""`RemoteRolloutWorkflow` against a fake-engine gateway and the reference rollout server."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from relayrl.client.session_client import SessionClient, SessionHandle
from relayrl.errors import ConfigError, EpisodeFailed
from relayrl.remote_rollout.schemas import RolloutResponse
from relayrl.remote_rollout.workflow import (
    RemoteRolloutConfig,
    RemoteRolloutWorkflow,
    build_remote_workflow,
    callback_port,
    callback_url,
)
from relayrl.workflow.context import EpisodeContext, episode_scope

from .conftest import (
    ADMIN,
    FakeGateway,
    different_template_dir,
    start_rollout_server,
    tool_call_text,
)

DATA = {"messages": [{"role": "user", "content": "What is 15 * 23?"}], "answer": "345"}


def answer_reward(final_messages: list[dict[str, Any]], data: dict[str, Any]) -> float:
    last = final_messages[-1]
    return 1.0 if last["role"] == "assistant" and data["answer"] in (last.get("content") or "") \
        else 0.0


def run_episode(gw: FakeGateway, server_url: str, **config: Any) -> tuple[Any, RemoteRolloutWorkflow]:
    async def go() -> tuple[Any, RemoteRolloutWorkflow]:
        client = SessionClient(gw.url, admin_key=ADMIN)
        wf = RemoteRolloutWorkflow(server_url, client, answer_reward,
                                   RemoteRolloutConfig(sampling={"max_tokens": 256}, **config))
        try:
            with episode_scope(EpisodeContext(task_id="t1", episode_id="ep-1", group_id="g1")):
                return await wf.arun_episode(None, dict(DATA)), wf
        finally:
            await wf.aclose()
            await client.aclose()

    return asyncio.run(go())


def test_episode_rows_reward_and_mask_summary(gw: FakeGateway, rollout_server) -> None:
    server, _ = rollout_server
    gw.script.replies += [tool_call_text("multiply", a=15, b=23), "The answer is 345."]
    rows, wf = run_episode(gw, server.url)
    assert rows is not None and len(rows) == 1  # concat: one row for the two-call segment
    row = next(iter(rows.values()))
    assert len(row.interaction_ids) == 2
    assert row.reward == 1.0
    assert row.metadata["remote_rollout"]["mask_checks"] == 2
    assert row.metadata["remote_rollout"]["mask_mismatches"] == 0
    assert row.metadata["remote_rollout"]["finish_reason"] == "stop"
    assert row.metadata["session"]["episode_id"] == "ep-1"
    assert wf.stats["completed"] == 1 and wf.stats["mask_checks"] == 2
    assert len(gw.deps.store) == 0  # exported and acknowledged


@pytest.mark.parametrize("policy", ["drop", "keep"])
def test_mask_mismatch_policy(gw: FakeGateway, model_dir: str, tmp_path: Path,
                              policy: str) -> None:
    server, _ = start_rollout_server(default_tokenizer=str(different_template_dir(model_dir,
                                                                                  tmp_path)))
    try:
        gw.script.replies += [tool_call_text("multiply", a=15, b=23), "345"]
        rows, wf = run_episode(gw, server.url, on_mask_mismatch=policy)
    finally:
        server.stop()
    assert wf.stats["mask_mismatches"] == 1 and wf.stats["mismatched_rollouts"] == 1
    if policy == "drop":
        assert rows is None and wf.stats["dropped_mask_mismatch"] == 1
    else:
        row = next(iter(rows.values()))
        assert row.metadata["remote_rollout"]["mask_mismatches"] == 1
        assert wf.stats["kept_mask_mismatch"] == 1


def test_error_status_aborts_and_releases_the_session(gw: FakeGateway) -> None:
    server, _ = start_rollout_server(default_tokenizer="/no/such/tokenizer")
    try:
        with pytest.raises(EpisodeFailed, match="tokenizer load failed"):
            run_episode(gw, server.url)
    finally:
        server.stop()
    # aborted (never trained; its capacity goes back), kept until its TTL passes
    assert [str(s.state) for s in gw.deps.store] == ["aborted"] and not gw.script.requests


def test_unreachable_server_fails_the_episode(gw: FakeGateway) -> None:
    with pytest.raises(EpisodeFailed, match="GET /tools failed"):
        run_episode(gw, "http://127.0.0.1:9")


def test_reward_from_the_server_response() -> None:
    wf = RemoteRolloutWorkflow("http://127.0.0.1:9", SessionClient("http://127.0.0.1:9"))
    with_reward = RolloutResponse.model_validate(
        {"rollout_id": "r", "status": "COMPLETED", "metrics": {"reward": 0.5}})
    assert asyncio.run(wf._score(with_reward, {})) == 0.5
    in_meta = RolloutResponse.model_validate(
        {"rollout_id": "r", "status": "COMPLETED", "metadata": {"reward": 1}})
    assert asyncio.run(wf._score(in_meta, {})) == 1.0
    none = RolloutResponse.model_validate({"rollout_id": "r", "status": "COMPLETED"})
    with pytest.raises(EpisodeFailed, match="no reward"):
        asyncio.run(wf._score(none, {}))


def test_callback_urls_and_ports() -> None:
    s = SessionHandle("abc", "key", "http://127.0.0.1:8081/sessions/abc/v1")
    assert callback_url(s) == "http://127.0.0.1:8081/sessions/abc"
    assert callback_url(s, "http://10.0.0.5:8081/") == "http://10.0.0.5:8081/sessions/abc"
    assert callback_port(8081, 0, 1) == 8081
    assert [callback_port(8081, i, 4) for i in range(4)] == [8081, 8082, 8083, 8084]
    with pytest.raises(ConfigError):
        callback_port(8081, 4, 4)


def test_build_from_config_section() -> None:
    client = SessionClient("http://127.0.0.1:9")
    wf = build_remote_workflow({"server_url": "http://127.0.0.1:9000", "max_turns": 4,
                                "reward_fn": f"{__name__}.answer_reward"}, client)
    assert wf.config.max_turns == 4 and wf._reward is not None
    with pytest.raises(ConfigError, match="unknown remote rollout options"):
        build_remote_workflow({"server_url": "http://x", "max_turn": 4}, client)
    with pytest.raises(ConfigError, match="server_url"):
        build_remote_workflow({}, client)
    with pytest.raises(ConfigError, match="on_mask_mismatch"):
        RemoteRolloutConfig(on_mask_mismatch="ignore")


def test_the_launcher_builds_workflow_remote_from_its_kwargs() -> None:
    pytest.importorskip("torch", reason="relayrl.config imports relayrl.train, which needs torch "
                        "(`pip install 'relayrl[train]'`)")
    from relayrl.launch.local import build_workflow
    from relayrl.workflow import AgentConfig, GroupedWorkflow

    client = SessionClient("http://127.0.0.1:9")
    wf = build_workflow("remote", {"server_url": "http://127.0.0.1:9000"}, 4, client,
                        AgentConfig())
    assert isinstance(wf, GroupedWorkflow) and isinstance(wf.workflow, RemoteRolloutWorkflow)
    with pytest.raises(ConfigError, match="server_url"):
        build_workflow("remote", {}, 1, client, AgentConfig())


def test_command_line_text_is_coerced() -> None:
    pytest.importorskip("torch", reason="relayrl.config imports relayrl.train, which needs torch "
                        "(`pip install 'relayrl[train]'`)")
    from relayrl.config import parse_override

    _, text = parse_override("x=24")
    _, flag = parse_override("x=keep")
    c = RemoteRolloutConfig.from_mapping({"sampling": {"max_tokens": text}, "max_turns": text,
                                          "rollout_timeout_s": text, "on_mask_mismatch": flag})
    assert c.max_turns == 24 and c.rollout_timeout_s == 24.0 and c.on_mask_mismatch == "keep"
    assert c.sampling == {"max_tokens": 24}
