"""Every benchmark of the suite runs: `python -m benchmarks NAME --smoke` in a subprocess each.

A smoke run takes tiny sizes and one round on a narrow stand-in of the default model (its
tokenizer and vocabulary, two small layers): it checks that the benchmark's code, arms and report
still work and that the harness wrote its run (a JSON line with the machine, ISA and load, and the
Markdown with its provenance line). It measures nothing. What a full run needs beyond this
machine (a GPU, AReaL's venv, a vLLM-CPU server) each benchmark's smoke replaces with what exists
here, and says so (`python -m benchmarks list` names it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks.registry import BENCHMARKS, Benchmark

ROOT = Path(__file__).resolve().parents[2]


def _timeout_s(bench: Benchmark) -> float:
    """The benchmark's smoke limit, stretched on a machine busier than its cores (at most 8x)."""
    busy = os.getloadavg()[0] / len(os.sched_getaffinity(0))
    return bench.smoke_timeout_s * min(8.0, max(1.0, busy))


def _env() -> dict[str, str]:
    """This checkout's `src` and root first, so the benchmarks run the code under test."""
    paths = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


# Benchmarks whose smoke is known to crash the process (name -> the bug), marked strict xfail so
# that the fix makes the mark fail and be removed. None now.
KNOWN_CRASHES: dict[str, str] = {}


def _param(bench: Benchmark) -> object:
    """The benchmark as a test case, marked as a known crash where it is one."""
    reason = KNOWN_CRASHES.get(bench.name)
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(bench, id=bench.name, marks=marks)


@pytest.mark.slow
@pytest.mark.parametrize("bench", [_param(b) for b in BENCHMARKS])
def test_smoke_run_of_every_benchmark(bench: Benchmark, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", bench.name, "--smoke", "--results-dir",
         str(tmp_path)], cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=_timeout_s(bench))
    output = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, output
    assert "ISA:" in proc.stdout and "SMOKE RUN" in proc.stdout, output
    lines = (tmp_path / f"{bench.name}.jsonl").read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["benchmark"] == bench.name and record["smoke"] is True
    assert record["command"].startswith(f"python -m benchmarks {bench.name} --smoke")
    assert record["machine"]["cores"] >= 1 and isinstance(record["machine"]["isa"], list)
    assert record["load_average"]["before"] >= 0 and record["load_average"]["after"] >= 0
    markdown = (tmp_path / f"{bench.name}.md").read_text()
    assert markdown.startswith(f"`python -m benchmarks {bench.name} --smoke")
    assert record["markdown"].strip() and record["markdown"].strip() in markdown
