"""Shared helpers for the tests that run real coding CLIs (installed by scripts/install_clis.sh)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

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
