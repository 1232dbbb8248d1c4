"""The real Codex CLI, driven offline by the scripted engine, compacts its history automatically
(`model_auto_compact_token_limit`): its summarisation request and the continuation that carries
the summary are recorded as linked segments, the summary trained under the episode's reward."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from relayrl.trajectory import BranchReason
from tests.cli_agents.conftest import cli_binary, tool_call
from tests.gateway.conftest import Gateway

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
    httpx.post(gw.url + "/rl/v1/finalize", json={"final_reward": 1.0}, timeout=60,
               headers={"authorization": f"Bearer {s['api_key']}"}).raise_for_status()
    rows = gw.export(s["session_id"], style="concat")
    by_call = {r["interaction_ids"][-1]: r for r in rows}
    summary_row = by_call[writer.id]
    start, end = summary_row["turn_spans"][-1]
    assert sum(summary_row["loss_mask"][start:end]) == end - start > 0
    assert summary_row["turn_rewards"][-1] == 1.0
    after = by_call[cont.id]
    assert after["metadata"]["branch_reason"] == "compaction"
    assert sum(after["loss_mask"]) == len(cont.output_ids)  # the copied summary is prompt
