"""The real Claude Code CLI (npm `@anthropic-ai/claude-code`) against the gateway: its Anthropic
Messages requests as it sends them (adaptive thinking, context management, output effort, a
system message mid-conversation), driven through a tool-using episode."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.cli_agents.conftest import assert_one_segment, cli_binary, tool_call
from tests.gateway.conftest import Gateway

CLAUDE = cli_binary("claude")
pytestmark = pytest.mark.skipif(
    CLAUDE is None, reason="Claude Code is not installed (scripts/install_clis.sh)")



def test_claude_code_runs_a_tool_using_episode_recorded_as_one_segment(
        gw: Gateway, tmp_path: Path) -> None:
    assert gw.script is not None and CLAUDE is not None
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    gw.script.replies += [tool_call("Write", {"file_path": str(work / "hello.txt"),
                                              "content": "hello"}),
                          "Created hello.txt."]
    s = gw.start_session()
    env = {"PATH": os.environ["PATH"], "HOME": str(home),
           "ANTHROPIC_BASE_URL": s["base_url"].removesuffix("/v1"),
           "ANTHROPIC_API_KEY": s["api_key"],
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
           "IS_SANDBOX": "1"}  # lets --dangerously-skip-permissions run as root (CI is root)
    done = subprocess.run(
        [CLAUDE, "-p", "Create hello.txt containing hello.", "--dangerously-skip-permissions",
         "--model", "policy"],
        cwd=work, env=env, capture_output=True, text=True, timeout=120, check=False)
    out = done.stdout + done.stderr
    assert (work / "hello.txt").read_text() == "hello", out
    assert "Created hello.txt." in out
    first, _ = assert_one_segment(gw, s)  # the CLI resends its history: one token sequence
    meta = first.metadata
    assert meta["wire"] == "anthropic.messages"
    assert meta["thinking"]["type"] == "adaptive"
    assert "context_management" in meta and "output_config" in meta
