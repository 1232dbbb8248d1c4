"""The real opencode CLI, driven offline by the scripted engine, starts a sub-agent with its `task`
tool: the child session's calls (opencode sends them with `x-parent-session-id`) form a
`subagent` segment linked to the call that spawned it, and every call trains under the episode's
reward. It also compacts its history when a call's usage nears the model's context: the
summary-writing call and the compacted history are linked segments."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from relayrl.harness.clis import KEY_VAR, LaunchSpec, OpenCode
from relayrl.harness.runtime import host_env
from relayrl.trajectory import BranchReason
from tests.cli_agents.conftest import assert_summary_trained_once, cli_binary, tool_call
from tests.gateway.conftest import Gateway

OPENCODE = cli_binary("opencode")
pytestmark = pytest.mark.skipif(OPENCODE is None,
                                reason="opencode is not installed (scripts/install_clis.sh)")
TASK = "Find the file notes.txt in this directory and report its path."


def test_opencode_task_subagent_is_a_linked_segment_trained_with_the_episode(
        gw: Gateway, tmp_path: Path) -> None:
    assert gw.script is not None and OPENCODE is not None
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    (work / "notes.txt").write_text("notes")
    gw.script.requests.clear()
    gw.script.replies += [tool_call("task", {"description": "find notes", "prompt": TASK,
                                             "subagent_type": "general"}),
                          "It is ./notes.txt.",  # the sub-agent's answer
                          "The file is ./notes.txt."]
    s = gw.start_session()
    launch = OpenCode().launch(LaunchSpec(
        instruction="Where is notes.txt? Use a sub-agent.", base_url=s["base_url"],
        api_key=s["api_key"], model="policy", home=home, workdir=work, executable=OPENCODE,
        context_window=65536, max_output_tokens=512, subagents=True))
    config = json.loads(Path(launch.env["OPENCODE_CONFIG"]).read_text())
    assert config["tools"]["task"] is True  # CLIAgent(subagents=True); off by default
    done = subprocess.run(launch.argv, cwd=work, env={**host_env(), **launch.env},
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0 and KEY_VAR in launch.env, done.stdout + done.stderr
    assert "The file is ./notes.txt." in done.stdout, done.stdout + done.stderr
    session = gw.deps.store.get(s["session_id"])
    main1, sub, main2 = session.interactions
    # opencode's child session: its own system prompt and tools, the task's prompt as user turn
    assert sub.branch_reason == BranchReason.SUBAGENT and sub.parent_id == main1.id
    assert sub.metadata["link_rule"] == "signal:opencode_header+tool:task"
    assert [tc.name for tc in main1.reply.tool_calls] == ["task"]
    assert TASK in next(m.content for m in sub.conversation.messages if m.role == "user")
    assert main2.segment_id == main1.segment_id  # the main agent goes on in its own segment
    assert "It is ./notes.txt." in main2.conversation.messages[-1].content  # the task's result
    seg = next(g for g in session.segments() if g.id == sub.segment_id)
    assert seg.parent_segment_id == main1.segment_id and seg.reason == BranchReason.SUBAGENT
    httpx.post(gw.url + "/rl/v1/finalize", json={"final_reward": 1.0}, timeout=60,
               headers={"authorization": f"Bearer {s['api_key']}"}).raise_for_status()
    rows = gw.export(s["session_id"], style="concat")
    assert sorted(r["metadata"]["branch_reason"] for r in rows) == ["first", "subagent"]
    for r in rows:  # the sub-agent's row trains under the episode's reward too
        assert r["reward"] == 1.0 and sum(r["loss_mask"]) > 0


SUMMARY = ("## Objective\n- Create hello.txt containing hello.\n## Work State\n"
           "- Ran printf hello > hello.txt to create the file.")


def test_opencode_auto_compaction_links_the_summary_call_and_the_continuation(
        gw: Gateway, tmp_path: Path) -> None:
    assert gw.script is not None and OPENCODE is not None
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    gw.script.requests.clear()
    gw.script.replies += [tool_call("bash", {"command": "printf hello > hello.txt",
                                             "description": "write the file"}),
                          SUMMARY, "Created hello.txt."]
    # A long first message and a context just under the first call's tokens (opencode's own
    # prompt with bash is ~3.5k, the notes ~2.5k): opencode compacts after that call, and the
    # compacted history (its prompt, the summary, the last tool call) fits below the limit.
    notes = "".join(f" Background note {i}: the file belongs in the working directory."
                    for i in range(180))
    s = gw.start_session()
    launch = OpenCode().launch(LaunchSpec(
        instruction="Create hello.txt containing hello." + notes, base_url=s["base_url"],
        api_key=s["api_key"], model="policy", home=home, workdir=work, executable=OPENCODE,
        context_window=6500, max_output_tokens=512, tools=["bash"]))
    done = subprocess.run(launch.argv, cwd=work, env={**host_env(), **launch.env},
                          capture_output=True, text=True, timeout=180, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and (work / "hello.txt").read_text() == "hello", out
    assert "Created hello.txt." in done.stdout, out
    session = gw.deps.store.get(s["session_id"])
    work1, writer, cont = session.interactions
    assert len(work1.prompt_ids) + len(work1.output_ids) >= 6500 - 512  # what set it off
    # opencode's compaction agent: another system prompt, the history written out as text
    assert writer.metadata["compaction"] == "summary_request:opencode"
    assert (writer.branch_reason, writer.parent_id) == (BranchReason.COMPACTION, work1.id)
    assert writer.metadata["link_rule"] == "summary_request:opencode"
    assert not writer.conversation.messages[0].content.startswith("You are opencode")
    # the compacted history: "What did we do so far?", the summary as the answer, the kept tail
    assert (cont.branch_reason, cont.parent_id) == (BranchReason.COMPACTION, writer.id)
    assert cont.metadata["link_rule"] == "copied_reply"
    assert any(m.role == "assistant" and m.content == SUMMARY for m in cont.conversation.messages)
    assert_summary_trained_once(gw, s, writer, cont)
