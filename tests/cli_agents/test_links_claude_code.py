"""The real Claude Code CLI, driven offline by the scripted engine, starts a sub-agent (its `Agent`
tool) and compacts its history (`/compact`): the gateway records each as its own segment linked to
the call it continues, and every call trains under the episode's reward."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from relayrl.trajectory import BranchReason
from tests.cli_agents.conftest import cli_binary, tool_call
from tests.gateway.conftest import Gateway

CLAUDE = cli_binary("claude")
pytestmark = pytest.mark.skipif(
    CLAUDE is None, reason="Claude Code is not installed (scripts/install_clis.sh)")
TASK = "Find the file notes.txt in this directory and report its path."
SUMMARY_LINES = ("The user asked to create hello.txt containing hello.",
                 "It was written with the Write tool and nothing is pending.")


def _env(gw: Gateway, session: dict, home: Path) -> dict[str, str]:
    home.mkdir()
    return {"PATH": os.environ["PATH"], "HOME": str(home),
            "ANTHROPIC_BASE_URL": session["base_url"].removesuffix("/v1"),
            "ANTHROPIC_API_KEY": session["api_key"],
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
            "IS_SANDBOX": "1"}


def _finalize(gw: Gateway, session: dict, reward: float) -> None:
    import httpx

    httpx.post(gw.url + "/rl/v1/finalize", json={"final_reward": reward}, timeout=60,
               headers={"authorization": f"Bearer {session['api_key']}"}).raise_for_status()


def test_claude_code_subagent_is_a_linked_segment_trained_with_the_episode(
        gw: Gateway, tmp_path: Path) -> None:
    assert gw.script is not None and CLAUDE is not None
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("notes")
    gw.script.replies += [tool_call("Agent", {"description": "find notes", "prompt": TASK,
                                              "subagent_type": "general-purpose"}),
                          "It is ./notes.txt.",  # the sub-agent's answer
                          "The file is ./notes.txt."]
    s = gw.start_session()
    done = subprocess.run(
        [CLAUDE, "-p", "Where is notes.txt? Use a sub-agent.", "--dangerously-skip-permissions",
         "--model", "policy"], cwd=work, env=_env(gw, s, tmp_path / "home"),
        capture_output=True, text=True, timeout=180, check=False)
    assert "The file is ./notes.txt." in done.stdout, done.stdout + done.stderr
    session = gw.deps.store.get(s["session_id"])
    main1, sub, main2 = session.interactions
    assert sub.branch_reason == BranchReason.SUBAGENT and sub.parent_id == main1.id
    assert sub.metadata["link_rule"] == "tool:Agent"
    assert TASK in next(m.content for m in sub.conversation.messages if m.role == "user")
    assert main2.segment_id == main1.segment_id  # the main agent goes on in its own segment
    seg = next(g for g in session.segments() if g.id == sub.segment_id)
    assert seg.parent_segment_id == main1.segment_id
    _finalize(gw, s, 1.0)
    rows = gw.export(s["session_id"], style="concat")
    assert {r["metadata"]["branch_reason"] for r in rows} == {"first", "subagent"}
    for r in rows:  # the sub-agent's row trains under the episode's reward too
        assert r["reward"] == 1.0 and sum(r["loss_mask"]) > 0


def test_claude_code_compact_links_the_continuation_to_the_summary_call(
        gw: Gateway, tmp_path: Path) -> None:
    assert gw.script is not None and CLAUDE is not None
    work = tmp_path / "work"
    work.mkdir()
    summary = ("<analysis>\nThe conversation is short.\n</analysis>\n<summary>\n"
               + "\n".join(SUMMARY_LINES) + "\n</summary>")
    gw.script.replies += [tool_call("Write", {"file_path": str(work / "hello.txt"),
                                              "content": "hello"}),
                          "Created hello.txt.", summary, "It holds hello."]
    s = gw.start_session()
    # one process, three user turns sent one at a time (stream-json): the second is /compact
    proc = subprocess.Popen(
        [CLAUDE, "-p", "--input-format", "stream-json", "--output-format", "stream-json",
         "--verbose", "--dangerously-skip-permissions", "--model", "policy"],
        cwd=work, env=_env(gw, s, tmp_path / "home"), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    results = []
    try:
        for text in ("Create hello.txt containing hello.", "/compact", "What does it hold?"):
            proc.stdin.write(json.dumps({"type": "user", "message": {"role": "user",
                                                                      "content": text}}) + "\n")
            proc.stdin.flush()
            for line in proc.stdout:  # until this turn's result
                event = json.loads(line)
                if event.get("type") == "result":
                    results.append(event.get("result"))
                    break
        proc.stdin.close()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert results[0] == "Created hello.txt." and results[2] == "It holds hello.", results
    session = gw.deps.store.get(s["session_id"])
    work1, work2, writer, cont = session.interactions
    # Claude Code's summarisation request extends the conversation it summarises
    assert writer.metadata["compaction"] == "summary_request:claude_code"
    assert writer.segment_id == work1.segment_id and writer.reply.content == summary
    # the next call re-sends the summary as input: a compaction segment under the writer
    assert cont.branch_reason == BranchReason.COMPACTION and cont.parent_id == writer.id
    assert cont.metadata["link_rule"] == "summary_prefix:claude_code"
    carried = "\n".join(m.content for m in cont.conversation.messages if m.role == "user")
    assert all(line in carried for line in SUMMARY_LINES)
    _finalize(gw, s, 1.0)
    rows = {r["metadata"]["branch_reason"]: r for r in gw.export(s["session_id"],
                                                                style="concat")}
    main, after = rows["first"], rows["compaction"]
    assert main["interaction_ids"][-1] == writer.id
    start, end = main["turn_spans"][-1]
    assert sum(main["loss_mask"][start:end]) == end - start > 0  # the summary is trained
    assert main["turn_rewards"][-1] == 1.0  # with the episode's reward
    # in the continuation the summary is prompt: only the new answer carries loss
    assert sum(after["loss_mask"]) == len(cont.output_ids)
    assert after["metadata"]["parent_segment_id"] == work1.segment_id
    assert work2.segment_id == work1.segment_id
