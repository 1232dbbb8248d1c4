"""What every benchmark shares: the machine it ran on, the load around it, interleaved arms and
rounds, arms in processes of their own, percentiles, and the one results writer.

The rules it keeps (docs/benchmarks.md, "Running the benchmarks"): arms that are compared run in
the same session, interleaved, their order reversed every other round; the load average is read
before and after; every run appends one JSON line to `RESULTS_DIR/NAME.jsonl` and writes its
Markdown, headed by the provenance line benchmarks/RESULTS.md quotes, to `RESULTS_DIR/NAME.md`.

No torch and no relayrl here: a benchmark's child in another venv (AReaL's) imports this too.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(os.environ.get("RELAYRL_BENCH_RESULTS") or ROOT / "benchmarks" / "results")
"""Where runs are written unless `--results-dir` says otherwise (ignored by git)."""
ISA_FLAGS = (("amx_bf16", "AMX-BF16"), ("amx_tile", "AMX-TILE"), ("avx512_bf16", "AVX512-BF16"),
             ("avx512f", "AVX512F"), ("avx2", "AVX2"))
"""The /proc/cpuinfo flags that decide which kernels an engine or trainer can use, and their names."""
SMOKE_SHAPES = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256,
                "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}
"""The smoke runs' stand-in model: the default model's tokenizer, vocabulary and head size, two
narrow layers (seconds where the real model takes minutes on a loaded 2-core machine)."""


# -- the machine and its load ---------------------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    """What a figure was measured on."""

    cpu: str
    cores: int
    isa: tuple[str, ...]
    torch: str
    python: str

    def describe(self) -> str:
        """One line: CPU, cores, ISA, torch and Python versions."""
        isa = ", ".join(self.isa) if self.isa else "none of AMX, AVX-512, AVX2"
        return (f"{self.cpu}, {self.cores} cores, ISA: {isa}; torch {self.torch}, "
                f"Python {self.python}")


def parse_cpuinfo(text: str) -> tuple[str, tuple[str, ...]]:
    """(CPU model name, the ISA_FLAGS it has, by their names) from /proc/cpuinfo's text."""
    name, flags = "unknown CPU", set[str]()
    for line in text.splitlines():  # the first processor's block says it for all
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name == "unknown CPU":
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return name, tuple(label for flag, label in ISA_FLAGS if flag in flags)


@functools.cache
def machine() -> Machine:
    """This machine, read once: /proc/cpuinfo, the cores this process may use, package versions."""
    info = Path("/proc/cpuinfo")
    cpu, isa = parse_cpuinfo(info.read_text()) if info.exists() else (platform.processor(), ())
    try:  # the installed version, without importing torch (a gateway benchmark needs none)
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "not installed"
    return Machine(cpu or "unknown CPU", len(os.sched_getaffinity(0)), isa, torch,
                   platform.python_version())


def load_average() -> float:
    """The one-minute load average now."""
    return os.getloadavg()[0]


def utc_now() -> str:
    """The date and time, UTC, as RESULTS.md writes them."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


# -- interleaving -----------------------------------------------------------------------------------


def order(arms: Sequence[T], round_index: int) -> list[T]:
    """The arms in the order they run in round `round_index`: as given, reversed every other round."""
    return list(arms) if round_index % 2 == 0 else list(arms)[::-1]


def rounds(arms: Sequence[T], n: int, offset: int = 0) -> Iterator[tuple[int, T]]:
    """(round, arm) for `n` rounds of every arm, A B then B A (`offset` shifts which comes first)."""
    for r in range(n):
        for arm in order(arms, r + offset):
            yield r, arm


def best_of_rounds(measures: dict[str, Callable[[], R]], n: int, seconds: Callable[[R], float],
                   warmup: int = 0, each: Callable[[str, int], None] | None = None) -> dict[str, R]:
    """The fastest result of each measurement over `n` interleaved rounds after `warmup` rounds.

    On a shared machine other work only ever slows a run down, and it comes and goes: the best
    run of each, with every arm sampled in every round, keeps the comparison fair.
    """
    best: dict[str, R] = {}
    for r, name in rounds(list(measures), warmup + n):
        result = measures[name]()
        if each is not None:
            each(name, r)
        if r >= warmup and (name not in best or seconds(result) < seconds(best[name])):
            best[name] = result
    return {name: best[name] for name in measures if name in best}


@dataclass
class Timings(Generic[R]):
    """What `timed_rounds` measured."""

    seconds: dict[str, list[float]]
    """Each measured round's wall time, by arm, in round order."""
    warmup_s: dict[str, float]
    """Each arm's last warm-up round."""
    last: dict[str, R]
    """Each arm's last result."""


def timed_rounds(arms: dict[str, Callable[[], R]], n: int, warmup: int = 1,
                 each: Callable[[str, int], None] | None = None) -> Timings[R]:
    """Wall time of every arm in `warmup` rounds, then `n` measured ones, interleaved."""
    out: Timings[R] = Timings({name: [] for name in arms}, {}, {})
    for r, name in rounds(list(arms), warmup + n):
        start = time.perf_counter()
        out.last[name] = arms[name]()
        elapsed = time.perf_counter() - start
        if r < warmup:
            out.warmup_s[name] = elapsed
        else:
            out.seconds[name].append(elapsed)
        if each is not None:
            each(name, r)
    return out


def rounds_table(seconds: dict[str, list[float]]) -> list[str]:
    """A Markdown table of every round's seconds, one column an arm."""
    names = list(seconds)
    lines = ["| round | " + " | ".join(f"{n} s" for n in names) + " |",
             "| ---: |" + " ---: |" * len(names)]
    for i in range(min(len(v) for v in seconds.values())):
        lines.append(f"| {i + 1} | " + " | ".join(f"{seconds[n][i]:.2f}" for n in names) + " |")
    return lines


def per_round_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """a / b round by round (both measured in the same rounds)."""
    return [x / y for x, y in zip(a, b, strict=True)]


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of xs, nearest rank."""
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- processes ----------------------------------------------------------------------------------------


def child_env(src: str | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a benchmark's child: `benchmarks` importable, `src` (if given) first."""
    env = dict(os.environ if base is None else base)
    paths = [p for p in (src, str(ROOT), env.get("PYTHONPATH", "")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def child_command(name: str, *args: str, python: str = sys.executable) -> list[str]:
    """The command line that runs benchmark `name` (a registry name) with `args` in a new process."""
    return [python, "-m", "benchmarks", name, *args]


def alternate(name: str, arms: dict[str, list[str]], n: int,
              timeout_s: float) -> list[tuple[int, str, dict[str, Any]]]:
    """Run benchmark `name` with each arm's arguments once a round, each in a fresh process.

    A process per arm keeps what is process-wide its own (allocator options set before any thread,
    peak RSS). Each child prints one JSON line last; returns (round, arm, that JSON) as run.
    """
    out = []
    for r, arm in rounds(list(arms), n):
        print(f"round {r + 1}/{n}: {arm} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(child_command(name, *arms[arm]), capture_output=True, text=True,
                              check=True, timeout=timeout_s, env=child_env())
        out.append((r + 1, arm, json.loads(proc.stdout.strip().splitlines()[-1])))
    return out


def free_port() -> int:
    """A loopback port nothing listens on at the moment."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- arguments and the results writer --------------------------------------------------------------------


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """Benchmark `name`'s argument parser, with the options every benchmark takes."""
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks {name}",
                                 description=doc.strip().splitlines()[0] if doc else None)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes and one round: checks that the benchmark runs, measures nothing")
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR,
                    help="where the run's JSON line and Markdown go")
    ap.add_argument("--no-write", action="store_true", help="print only; write no results")
    return ap


def smoke_model() -> str:
    """The smoke runs' model: the default model's config and tokenizer with SMOKE_SHAPES, random
    weights (made once under $RELAYRL_HOME). Only for checking that code runs; never for a figure."""
    from relayrl.models import DEFAULT_MODEL, model_path, relay_home

    shape = "-".join(str(v) for v in SMOKE_SHAPES.values())
    dst = relay_home() / "benchmarks" / f"smoke-{DEFAULT_MODEL}-{shape}"
    if not (dst / "config.json").exists():
        from benchmarks.standin_model import make_standin

        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dst.parent))
        make_standin(Path(model_path(DEFAULT_MODEL)), tmp, overrides=SMOKE_SHAPES)
        try:  # renamed into place whole: two smokes making it at once leave one complete copy
            tmp.rename(dst)
        except OSError:
            subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return str(dst)


def commit() -> str | None:
    """The checkout's short commit, if this is a git checkout."""
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


@dataclass
class Run:
    """One run of a benchmark: its command, machine and load, and where its results go."""

    name: str
    argv: list[str]
    smoke: bool = False
    results_dir: Path = RESULTS_DIR
    write: bool = True
    machine: Machine = field(default_factory=machine)
    started: str = field(default_factory=utc_now)
    load_before: float = field(default_factory=load_average)
    load_after: float | None = None
    lines: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, name: str, args: argparse.Namespace, argv: Sequence[str] | None) -> Run:
        """Begin a run (reads the load) and print the machine line every figure goes with."""
        run = cls(name, list(sys.argv[1:] if argv is None else argv), args.smoke,
                  args.results_dir, not args.no_write)
        print(f"machine: {run.machine.describe()}; load average before {run.load_before:.2f}"
              + ("; SMOKE RUN: tiny sizes, no figure" if run.smoke else ""), flush=True)
        return run

    def say(self, line: str = "") -> None:
        """Print a line of the report and keep it for the results writer."""
        print(line, flush=True)
        self.lines.append(line)

    @property
    def command(self) -> str:
        """The command that made this run, as RESULTS.md quotes it."""
        return " ".join(["python -m benchmarks", self.name, *self.argv])

    def load(self) -> str:
        """"before / after" (after read now if not yet)."""
        if self.load_after is None:
            self.load_after = load_average()
        return f"{self.load_before:.2f} / {self.load_after:.2f}"

    def provenance(self) -> str:
        """The line RESULTS.md puts above a figure: command, commit, machine, ISA, date, load."""
        self.load()
        at = f" at `{c}`" if (c := commit()) else ""
        return (f"`{self.command}`{at}, {self.machine.describe()}, {self.started}, load average "
                f"{self.load_before:.2f} before, {self.load_after:.2f} after.")

    def finish(self, markdown: str = "", metrics: dict[str, Any] | None = None) -> Path | None:
        """Write the run: a JSON line appended to NAME.jsonl, its Markdown to NAME.md.

        Returns the JSON lines file, or None with --no-write.
        """
        self.load()
        markdown = markdown or "\n".join(self.lines)
        if not self.write:
            print(f"load average after {self.load_after:.2f}", flush=True)
            return None
        self.results_dir.mkdir(parents=True, exist_ok=True)
        record = {"benchmark": self.name, "command": self.command, "commit": commit(),
                  "started": self.started, "finished": utc_now(), "smoke": self.smoke,
                  "machine": asdict(self.machine),
                  "load_average": {"before": self.load_before, "after": self.load_after},
                  "metrics": metrics or {}, "markdown": markdown}
        lines = self.results_dir / f"{self.name}.jsonl"
        with lines.open("a") as f:
            f.write(json.dumps(record) + "\n")
        (self.results_dir / f"{self.name}.md").write_text(
            self.provenance() + "\n\n" + markdown.rstrip("\n") + "\n")
        print(f"load average after {self.load_after:.2f}; written to {lines} and "
              f"{self.results_dir / (self.name + '.md')}", flush=True)
        return lines
