"""Shared helpers for the tests that run real coding CLIs (installed by scripts/install_clis.sh)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from relayrl.trajectory import Interaction
from tests.gateway.conftest import Gateway, fake_gateway

ROOT = Path(__file__).resolve().parents[2]


def cli_binary(name: str) -> str | None:
    """A CLI from the repository's `.clis/` (scripts/install_clis.sh), else one on PATH."""
    local = ROOT / ".clis" / "node_modules" / ".bin" / name
    return str(local) if local.exists() else shutil.which(name)


def tool_call(name: str, args: dict[str, object]) -> str:
    """A reply the scripted engine gives: one Hermes-style tool call the gateway parses."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


@pytest.fixture
def gw(model_dir: str) -> Iterator[Gateway]:
    """A scripted gateway with room for a CLI's first prompt (its own system prompt and tool
    schemas: about 9k tokens for Codex, 18-20k for Qwen Code and Claude Code)."""
    g = fake_gateway(model_dir, context_length=65536)
    yield g
    g.thread.stop()


def assert_one_segment(gw: Gateway, session: dict) -> tuple:
    """The session holds two calls and the second extends the first's tokens; returns them."""
    calls = gw.deps.store.get(session["session_id"]).interactions
    assert len(calls) == 2
    first, second = calls
    assert second.parent_id == first.id and second.segment_id == first.segment_id
    assert second.prompt_ids[: len(first.token_ids)] == first.token_ids
    return first, second


def assert_summary_trained_once(gw: Gateway, session: dict, writer: Interaction,
                                cont: Interaction) -> None:
    """After a compaction (`writer` wrote the summary, `cont` continues from it), end the episode
    with reward 1: the summary is trained in the writer's row under that reward, and the copy of
    it in the continuation's prompt is not trained again."""
    httpx.post(gw.url + "/rl/v1/finalize", json={"final_reward": 1.0}, timeout=60,
               headers={"authorization": f"Bearer {session['api_key']}"}).raise_for_status()
    rows = gw.export(session["session_id"], style="concat")
    by_call = {r["interaction_ids"][-1]: r for r in rows}
    summary_row = by_call[writer.id]
    start, end = summary_row["turn_spans"][-1]
    assert sum(summary_row["loss_mask"][start:end]) == end - start > 0
    assert summary_row["turn_rewards"][-1] == 1.0
    after = by_call[cont.id]
    assert after["metadata"]["branch_reason"] == "compaction"
    assert sum(after["loss_mask"]) == len(cont.output_ids)  # the copied summary is prompt
