"""The real Codex CLI, driven offline by the scripted engine, compacts its history automatically
(`model_auto_compact_token_limit`) and starts a sub-agent (`spawn_agent`): its summarisation
request and the continuation that carries the summary are recorded as linked segments, the
summary trained under the episode's reward, and the spawned thread's calls form a `subagent`
segment under the call that spawned it."""

from __future__ import annotations

import os
import re
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from relayrl.engine.fake import FakeEngine
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.trajectory import BranchReason
from relayrl.types import GenerateRequest
from tests.cli_agents.conftest import assert_summary_trained_once, cli_binary, tool_call
from tests.gateway.conftest import ADMIN, Gateway

CODEX = cli_binary("codex")
pytestmark = pytest.mark.skipif(CODEX is None,
                                reason="the Codex CLI is not installed (scripts/install_clis.sh)")
SUMMARY = ("The user asked to create hello.txt containing hello.\n"
           "It was created with printf; nothing is pending.")


def test_codex_auto_compaction_links_the_continuation_to_the_summary_call(
        gw: Gateway, tmp_path: Path) -> None:
    assert gw.script is not None and CODEX is not None
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    # a token limit below Codex's own first prompt: it compacts after the first tool call
    (home / "config.toml").write_text(
        'model = "policy"\nmodel_provider = "relayrl"\nmodel_auto_compact_token_limit = 3000\n'
        "[model_providers.relayrl]\n"
        f'name = "relayrl"\nbase_url = "{gw.url}/v1"\nwire_api = "responses"\n'
        'env_key = "RELAYRL_SESSION_KEY"\nrequest_max_retries = 0\nstream_max_retries = 0\n')
    gw.script.replies += [tool_call("exec_command", {"cmd": "printf hello > hello.txt"}),
                          SUMMARY, "Created hello.txt."]
    s = gw.start_session()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home),
           "RELAYRL_SESSION_KEY": s["api_key"]}
    done = subprocess.run(
        [CODEX, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
         "Create hello.txt containing hello."], cwd=work, env=env, capture_output=True,
        text=True, timeout=180, check=False)
    out = done.stdout + done.stderr
    assert (work / "hello.txt").read_text() == "hello", out
    assert "context compacted" in out and "Created hello.txt." in out
    session = gw.deps.store.get(s["session_id"])
    work1, writer, cont = session.interactions
    # the compact prompt (codex-rs templates/compact/prompt.md) as the latest user turn, sent
    # without tools: a new segment that still hangs under the call it summarises
    assert writer.metadata["compaction"] == "summary_request:codex"
    assert writer.parent_id == work1.id and writer.reply.content == SUMMARY
    # the compacted history: the summary behind Codex's prefix, linked to the writer
    assert cont.branch_reason == BranchReason.COMPACTION and cont.parent_id == writer.id
    assert cont.metadata["link_rule"] == "summary_prefix:codex"
    assert not any(m.role == "assistant" for m in cont.conversation.messages)
    assert_summary_trained_once(gw, s, writer, cont)


class _SpawnScript:
    """Replies by what the prompt holds (the main agent and its sub-agent run concurrently)."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.main_calls = 0
        self.lock = threading.Lock()

    def __call__(self, request: GenerateRequest) -> str:
        text = self.tok.decode(request.prompt_ids)
        with self.lock:
            if MAIN_PROMPT not in text:  # the sub-agent's thread: it sees only its message
                return "There is one file: a.txt."
            self.main_calls += 1
            if self.main_calls == 1:
                return tool_call("multi_agent_v1.spawn_agent", {"message": SUB_TASK})
            if self.main_calls == 2:
                agent = re.findall(r'"agent_id":\s*"([^"]+)"', text)[-1]
                return tool_call("multi_agent_v1.wait_agent",
                                 {"targets": [agent], "timeout_ms": 10000})
            return "There is one file."


MAIN_PROMPT = "How many files are in this directory? Ask a sub-agent."
SUB_TASK = "List the files in the current directory and report them."


def test_codex_spawn_agent_calls_form_a_linked_subagent_segment(model_dir: str,
                                                                 tmp_path: Path) -> None:
    assert CODEX is not None
    engine = FakeEngine(_SpawnScript(model_dir), tokenizer_path=model_dir, context_length=65536)
    cfg = GatewayConfig(model=model_dir, engine="fake", admin_key=ADMIN,
                        model_label="relayrl-test")
    thread = GatewayThread(build_deps(cfg, engine=engine)).start()
    gw = Gateway(thread.url, thread)
    try:
        work, home = tmp_path / "work", tmp_path / "home"
        work.mkdir()
        home.mkdir()
        (work / "a.txt").write_text("a")
        (home / "config.toml").write_text(
            'model = "policy"\nmodel_provider = "relayrl"\n[model_providers.relayrl]\n'
            f'name = "relayrl"\nbase_url = "{gw.url}/v1"\nwire_api = "responses"\n'
            'env_key = "RELAYRL_SESSION_KEY"\nrequest_max_retries = 0\nstream_max_retries = 0\n')
        s = gw.start_session()
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home),
               "RELAYRL_SESSION_KEY": s["api_key"]}
        done = subprocess.run(
            [CODEX, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
             MAIN_PROMPT], cwd=work, env=env, capture_output=True, text=True, timeout=180,
            check=False)
        out = done.stdout + done.stderr
        assert "There is one file." in out, out
        session = gw.deps.store.get(s["session_id"])
        calls = session.interactions
        spawn = next(c for c in calls if any(t.name.endswith("spawn_agent")
                                             for t in c.reply.tool_calls))
        (sub,) = [c for c in calls if c.branch_reason == BranchReason.SUBAGENT]
        # Codex tags the thread's requests (x-openai-subagent: collab_spawn); the spawn_agent
        # call whose message opens the thread is its parent
        assert sub.parent_id == spawn.id
        assert sub.metadata["link_rule"] == "signal:codex_header+tool:multi_agent_v1.spawn_agent"
        main = [c for c in calls if c is not sub]
        assert len(main) == 3 and {c.segment_id for c in main} == {spawn.segment_id}
        httpx.post(gw.url + "/rl/v1/finalize", json={"final_reward": 1.0}, timeout=60,
                   headers={"authorization": f"Bearer {s['api_key']}"}).raise_for_status()
        rows = gw.export(s["session_id"], style="concat")
        by = {r["metadata"]["branch_reason"]: r for r in rows}
        assert set(by) == {"first", "subagent"}
        assert by["subagent"]["metadata"]["parent_segment_id"] == spawn.segment_id
        assert by["subagent"]["reward"] == 1.0 and sum(by["subagent"]["loss_mask"]) > 0
    finally:
        gw.thread.stop()
