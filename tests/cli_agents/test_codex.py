"""The real Codex CLI (npm `@openai/codex`) against the gateway: its Responses requests as it
sends them (namespace, custom and hosted tools included), driven through a tool-using episode."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.cli_agents.conftest import assert_one_segment, cli_binary, tool_call
from tests.gateway.conftest import Gateway

CODEX = cli_binary("codex")
pytestmark = pytest.mark.skipif(CODEX is None,
                                reason="the Codex CLI is not installed (scripts/install_clis.sh)")


def run_codex(gw: Gateway, session: dict, home: Path, work: Path, prompt: str) -> str:
    """One non-interactive Codex run with its provider pointed at the session."""
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        'model = "policy"\nmodel_provider = "relayrl"\n'
        "[model_providers.relayrl]\n"
        f'name = "relayrl"\nbase_url = "{gw.url}/v1"\nwire_api = "responses"\n'
        'env_key = "RELAYRL_SESSION_KEY"\nrequest_max_retries = 0\nstream_max_retries = 0\n')
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home),
           "RELAYRL_SESSION_KEY": session["api_key"]}
    assert CODEX is not None
    done = subprocess.run(
        [CODEX, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
         prompt], cwd=work, env=env, capture_output=True, text=True, timeout=120, check=False)
    return done.stdout + done.stderr



def test_codex_runs_a_tool_using_episode_recorded_as_one_segment(gw: Gateway,
                                                                  tmp_path: Path) -> None:
    assert gw.script is not None
    gw.script.replies += [tool_call("exec_command", {"cmd": "printf hello > hello.txt"}),
                          "Created hello.txt."]
    work = tmp_path / "work"
    work.mkdir()
    s = gw.start_session()
    out = run_codex(gw, s, tmp_path / "home", work, "Create hello.txt containing hello.")
    assert (work / "hello.txt").read_text() == "hello", out
    assert "Created hello.txt." in out
    first, _ = assert_one_segment(gw, s)  # Codex resends its whole history: one token sequence
    meta = first.metadata
    assert meta["wire"] == "openai.responses"
    assert "web_search" in meta["responses_tools"]["hosted"]
    assert any(ns == "multi_agent_v1" for ns, _ in meta["responses_tools"]["namespaced"].values())
    rows = gw.export(s["session_id"], style="concat")
    assert len(rows) == 1
