"""The real Qwen Code CLI (npm `@qwen-code/qwen-code`) against the gateway over Chat
Completions, driven through a tool-using episode."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli_agents.conftest import cli_binary, tool_call
from tests.gateway.conftest import Gateway, fake_gateway

QWEN = cli_binary("qwen")
pytestmark = pytest.mark.skipif(
    QWEN is None, reason="Qwen Code is not installed (scripts/install_clis.sh)")


@pytest.fixture
def gw(model_dir: str) -> Iterator[Gateway]:
    # Qwen Code's first prompt (system prompt and tool schemas) is ~18k tokens
    g = fake_gateway(model_dir, context_length=65536)
    yield g
    g.thread.stop()


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
    calls = gw.deps.store.get(s["session_id"]).interactions
    assert len(calls) == 2
    first, second = calls
    assert second.parent_id == first.id and second.segment_id == first.segment_id
    assert second.prompt_ids[: len(first.token_ids)] == first.token_ids
    assert first.metadata["wire"] == "openai.chat"
