"""The real Qwen Code CLI (npm `@qwen-code/qwen-code`) against the gateway over Chat
Completions, driven through a tool-using episode."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.cli_agents.conftest import assert_one_segment, cli_binary, tool_call
from tests.gateway.conftest import Gateway

QWEN = cli_binary("qwen")
pytestmark = pytest.mark.skipif(
    QWEN is None, reason="Qwen Code is not installed (scripts/install_clis.sh)")



def test_qwen_code_runs_a_tool_using_episode_recorded_as_one_segment(
        gw: Gateway, tmp_path: Path) -> None:
    assert gw.script is not None and QWEN is not None
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    gw.script.replies += [tool_call("write_file", {"file_path": str(work / "hello.txt"),
                                                   "content": "hello"}),
                          "Created hello.txt."]
    s = gw.start_session()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "OPENAI_BASE_URL": s["base_url"],
           "OPENAI_API_KEY": s["api_key"], "OPENAI_MODEL": "policy"}
    done = subprocess.run(
        [QWEN, "--yolo", "--auth-type", "openai", "Create hello.txt containing hello."],
        cwd=work, env=env, capture_output=True, text=True, timeout=120, check=False)
    out = done.stdout + done.stderr
    assert (work / "hello.txt").read_text() == "hello", out
    assert "Created hello.txt." in out
    first, _ = assert_one_segment(gw, s)  # the CLI resends its history: one token sequence
    assert first.metadata["wire"] == "openai.chat"
