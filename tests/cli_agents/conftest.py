"""Shared helpers for the tests that run real coding CLIs (installed by scripts/install_clis.sh)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cli_binary(name: str) -> str | None:
    """A CLI from the repository's `.clis/` (scripts/install_clis.sh), else one on PATH."""
    local = ROOT / ".clis" / "node_modules" / ".bin" / name
    return str(local) if local.exists() else shutil.which(name)


def tool_call(name: str, args: dict[str, object]) -> str:
    """A reply the scripted engine gives: one Hermes-style tool call the gateway parses."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"
