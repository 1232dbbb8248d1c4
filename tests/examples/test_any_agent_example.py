"""examples/any_agent/run.py, short: the math agent in its own process trains a `relayrl serve`."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_an_external_agent_process_trains_the_service(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, str(ROOT / "examples" / "any_agent" / "run.py"), "--steps", "2",
           "--group-size", "2", "--batch-size", "1", "--eval-items", "2", "--sft-rows", "8",
           "--max-tokens", "24", "--concurrency", "4", "--fileroot", str(tmp_path),
           "--trial", "ci", "--port", str(port), "--step-timeout-s", "900"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "held-out reward before RL" in proc.stdout
    assert "-> after 2 batches" in proc.stdout
    assert "round 1:" in proc.stdout and "batches" in proc.stdout
    run = tmp_path / "any_agent" / "ci"
    assert list((run / "checkpoints").glob("step_*")), "SIGTERM leaves a checkpoint"
    assert "relayrl: held-out reward" in (run / "serve.log").read_text()  # a clean shutdown
