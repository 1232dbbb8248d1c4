"""Compaction and sub-agents through the gateway (real HTTP, the fake engine's scripted replies,
the real tokenizer), exported as ATIF: copied context after compaction, sub-agent references,
validated by Harbor's own models and validator (in .venv-harbor)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from relayrl.cli import main
from relayrl.trajectory.links import SUMMARY_PREFIXES, SUMMARY_REQUEST_MARKERS
from tests.gateway.conftest import fake_gateway
from tests.trajectory.harbor import harbor_validate, needs_harbor

AGENT_TOOL = {"type": "function", "function": {
    "name": "Agent", "description": "Start a sub-agent.",
    "parameters": {"type": "object", "properties": {"description": {"type": "string"},
                                                    "prompt": {"type": "string"}}}}}
SUMMARY = ("The user wants the word count of notes.txt.\n"
           "A search sub-agent found notes.txt in the docs folder.\n"
           "Next step: count the words of docs/notes.txt and answer.")
TASK = "Find the file notes.txt in this repository and report its path."


def chat(url: str, key: str, messages: list[dict], headers: dict | None = None,
         **kw: object) -> dict:
    r = httpx.post(url + "/v1/chat/completions",
                   headers={"authorization": f"Bearer {key}", **(headers or {})},
                   json={"model": "m", "messages": messages, **kw}, timeout=60)
    r.raise_for_status()
    return r.json()


@pytest.fixture
def recorded(model_dir: str, tmp_path: Path) -> tuple[Path, str, dict]:
    """A session: a sub-agent (Claude Code's Agent tool), then a Codex-style compaction."""
    log = tmp_path / "gw.sqlite"
    gw = fake_gateway(model_dir, tmp_log=str(log))
    assert gw.script is not None
    call = json.dumps({"name": "Agent", "arguments": {"description": "find file", "prompt": TASK}})
    gw.script.replies += [f"<tool_call>\n{call}\n</tool_call>", "It is docs/notes.txt.",
                          "The file is docs/notes.txt.", SUMMARY, "It has 42 words."]
    try:
        s = gw.start_session(task_id="count-1")
        key = s["api_key"]
        h = [{"role": "system", "content": "You are a coding agent."},
             {"role": "user", "content": "How many words are in notes.txt?"}]
        r1 = chat(gw.url, key, h, tools=[AGENT_TOOL])["choices"][0]["message"]
        # the sub-agent: its own system prompt, the Agent call's prompt as its first message
        chat(gw.url, key, [{"role": "system", "content": "You are a file search sub-agent."},
                           {"role": "user", "content": TASK}])
        tool = {"role": "tool", "tool_call_id": r1["tool_calls"][0]["id"],
                "content": "It is docs/notes.txt."}
        h += [r1, tool]
        r2 = chat(gw.url, key, h, tools=[AGENT_TOOL])["choices"][0]["message"]
        # Codex's local compaction: the compact prompt as the latest user turn
        h += [r2, {"role": "user", "content": dict(SUMMARY_REQUEST_MARKERS)["codex"]}]
        summary = chat(gw.url, key, h, tools=[AGENT_TOOL])["choices"][0]["message"]["content"]
        assert summary == SUMMARY
        compacted = [h[0], h[1], {"role": "user",
                                  "content": dict(SUMMARY_PREFIXES)["codex"] + "\n" + summary}]
        chat(gw.url, key, compacted, tools=[AGENT_TOOL])
        auth = {"authorization": f"Bearer {key}"}
        # the episode's reward: credited to every leaf, the sub-agent's last call included
        httpx.post(gw.url + "/rl/v1/finalize", json={"final_reward": 1.0}, headers=auth,
                   timeout=60).raise_for_status()
        session = gw.deps.store.get(s["session_id"])
        segs = {str(g.reason): g for g in session.segments()}
        return log, s["session_id"], segs
    finally:
        gw.thread.stop()


def test_gateway_links_subagent_and_compaction_segments(recorded: tuple[Path, str, dict],
                                                        tmp_path: Path) -> None:
    log, _sid, segs = recorded
    assert set(segs) == {"first", "subagent", "compaction"}
    first = segs["first"]
    assert segs["subagent"].parent_segment_id == first.id
    assert segs["subagent"].link_rule == "tool:Agent"
    assert segs["compaction"].parent_segment_id == first.id
    assert segs["compaction"].link_rule == "summary_prefix:codex"
    out = tmp_path / "rows"
    assert main(["export", str(log), "--format", "jsonl", "--out", str(out)]) == 0
    rows = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    by = {r["metadata"]["branch_reason"]: r for r in rows}
    main_row = by["first"]
    # the summary-writing call is the last call of the first segment: trained, with the reward
    summary_span = main_row["turn_spans"][-1]
    assert sum(main_row["loss_mask"][summary_span[0]:summary_span[1]]) > 0
    assert main_row["turn_rewards"][-1] == 1.0
    assert by["compaction"]["metadata"]["parent_segment_id"] == first.id
    assert by["subagent"]["reward"] == 1.0 and by["compaction"]["reward"] == 1.0


def test_atif_marks_copied_context_and_references_the_subagent(
        recorded: tuple[Path, str, dict], tmp_path: Path) -> None:
    log, sid, segs = recorded
    out = tmp_path / "atif"
    assert main(["export", str(log), "--format", "atif", "--out", str(out)]) == 0
    traj = json.loads((out / f"{sid}.json").read_text())
    subs = {t["extra"]["branch_reason"]: t for t in traj["subagent_trajectories"]}
    cont = subs["compaction"]
    assert cont["extra"]["parent_segment_id"] == segs["first"].id
    copied = [st for st in cont["steps"] if st.get("is_copied_context")]
    # the system prompt, the kept user message and the summary message were copied
    assert [st["source"] for st in copied] == ["system", "user", "user"]
    assert SUMMARY.splitlines()[0] in copied[-1]["message"]
    assert not cont["steps"][-1].get("is_copied_context")  # the continuation's own answer
    # the summary is an agent step of the main trajectory, with its tokens
    summary_step = [st for st in traj["steps"] if st["source"] == "agent"][-1]
    assert summary_step["message"] == SUMMARY and summary_step["metrics"]["completion_token_ids"]
    refs = [r for st in traj["steps"] for r in (st.get("observation") or {}).get("results", ())
            if "subagent_trajectory_ref" in r]
    assert {r["extra"]["branch_reason"] for r in refs} == {"subagent", "compaction"}
    assert subs["subagent"]["extra"]["link_rule"] == "tool:Agent"


@needs_harbor
def test_harbor_validates_the_linked_export(recorded: tuple[Path, str, dict],
                                            tmp_path: Path) -> None:
    log, sid, _ = recorded
    out = tmp_path / "atif"
    assert main(["export", str(log), "--format", "atif", "--out", str(out)]) == 0
    copied = "sum(bool(s.is_copied_context) for x in subs for s in x.steps)"
    assert harbor_validate(out / f"{sid}.json", "len(subs)", copied) == [2, 3]
