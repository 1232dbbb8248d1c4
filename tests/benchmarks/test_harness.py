"""The benchmark harness and registry: machine description, interleaving, the results writer."""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks.registry import BENCHMARKS, get

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[2]
CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""


def test_cpuinfo_names_the_cpu_and_the_isa_that_picks_kernels() -> None:
    assert harness.parse_cpuinfo(CPUINFO) == (
        "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz",
        ("AMX-BF16", "AMX-TILE", "AVX512-BF16", "AVX512F", "AVX2"))
    zen3 = "model name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2 fma\n"
    assert harness.parse_cpuinfo(zen3) == ("AMD EPYC 7B13", ("AVX2",))


def test_this_machine_is_described_with_its_isa() -> None:
    m = harness.machine()
    assert m.cores >= 1 and m.torch
    assert "ISA:" in m.describe() and m.cpu in m.describe()


def test_rounds_interleave_arms_reversing_every_other_round() -> None:
    assert list(harness.rounds(["A", "B", "C"], 3)) == [
        (0, "A"), (0, "B"), (0, "C"), (1, "C"), (1, "B"), (1, "A"), (2, "A"), (2, "B"), (2, "C")]
    assert [a for _, a in harness.rounds(["A", "B"], 1, offset=1)] == ["B", "A"]


def test_best_of_rounds_skips_warm_up_and_keeps_the_fastest() -> None:
    times = {"a": iter([9.0, 3.0, 2.0]), "b": iter([1.0, 5.0, 4.0])}
    best = harness.best_of_rounds({k: (lambda k=k: next(times[k])) for k in times}, 2,
                                  lambda s: s, warmup=1)
    assert best == {"a": 2.0, "b": 4.0}


def test_timed_rounds_and_percentiles() -> None:
    timed = harness.timed_rounds({"x": lambda: 1, "y": lambda: 2}, 3, warmup=1)
    assert [len(v) for v in timed.seconds.values()] == [3, 3]
    assert set(timed.warmup_s) == {"x", "y"} and timed.last == {"x": 1, "y": 2}
    assert harness.percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.5) == 3.0
    assert harness.percentile([1.0, 2.0], 0.99) == 2.0
    assert harness.per_round_ratios([2.0, 9.0], [1.0, 3.0]) == [2.0, 3.0]


def test_a_run_appends_one_json_line_and_writes_its_markdown(tmp_path: Path) -> None:
    args = argparse.Namespace(smoke=False, results_dir=tmp_path, no_write=False)
    for figure in ("1.5x", "1.6x"):
        run = harness.Run.start("example", args, ["--rounds", "3"])
        run.say(f"| ratio | {figure} |")
        run.finish(metrics={"ratio": figure})
    records = [json.loads(line) for line in (tmp_path / "example.jsonl").read_text().splitlines()]
    assert [r["metrics"]["ratio"] for r in records] == ["1.5x", "1.6x"]
    assert records[0]["command"] == "python -m benchmarks example --rounds 3"
    assert records[0]["machine"]["isa"] == list(harness.machine().isa)
    text = (tmp_path / "example.md").read_text()
    assert text.startswith("`python -m benchmarks example --rounds 3`")
    assert "load average" in text and text.rstrip().endswith("| ratio | 1.6x |")


def test_no_write_writes_nothing(tmp_path: Path) -> None:
    args = argparse.Namespace(smoke=True, results_dir=tmp_path / "r", no_write=True)
    assert harness.Run.start("example", args, []).finish("text") is None
    assert not (tmp_path / "r").exists()


def test_every_registered_module_exists_with_a_main_and_a_smoke_mode() -> None:
    assert len({b.name for b in BENCHMARKS}) == len(BENCHMARKS)
    for bench in BENCHMARKS:
        path = ROOT / (bench.module.replace(".", "/") + ".py")
        tree = ast.parse(path.read_text())
        mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        assert mains and mains[0].args.args[0].arg == "argv", bench.name
        assert "args.smoke" in path.read_text(), f"{bench.name} has no --smoke sizes"
        assert f'NAME = "{bench.name}"' in path.read_text(), bench.name
    with pytest.raises(KeyError):
        get("no-such-benchmark")


def test_list_names_every_benchmark_without_importing_them() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks", "list"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    for bench in BENCHMARKS:
        assert f"\n{bench.name} " in "\n" + out
    code = ("import sys, benchmarks.__main__ as m; m.main(['list']); "
            "assert 'torch' not in sys.modules and 'relayrl' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=60,
                   check=True)
    bad = subprocess.run([sys.executable, "-m", "benchmarks", "nope"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no benchmark named 'nope'" in bad.stderr
