"""Held-out reward per question form at each eval of a run, from its trajectory dumps.

    python examples/math_agent/train.py rollout.dump_root=/tmp/dump trial_name=t
    python examples/math_agent/forms.py /tmp/dump/math_agent/t

Prints one table: a row per form (the `form` field of eval.jsonl), a column per eval (the dump's
version: 0 before RL, N after step N; the base model's eval writes no dumps), each cell the mean
reward and the tool sequences the episodes called (`a` add, `m` multiply: `a-m x8` is eight
episodes that added, then multiplied).
A lift that is small on average is often large gains and losses on different forms; this shows
which (benchmarks/RESULTS.md, "What seed 3 learns instead").
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from relayrl.errors import ConfigError

HERE = Path(__file__).resolve().parent
_CALL = re.compile(r'<tool_call>\s*\{"name":\s*"(\w+)"')


def tool_sequence(completion: str) -> str:
    """The tools an episode called, in order, as initials joined by dashes ("" for none)."""
    return "-".join(name[:1] for name in _CALL.findall(completion))


def load_evals(trial_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """Each eval's dumped episodes, by version (eval-rollout/<version>/*.jsonl)."""
    root = trial_dir / "eval-rollout"
    if not root.is_dir():
        raise ConfigError(f"{root} does not exist: run with rollout.dump_root set")
    evals: dict[int, list[dict[str, Any]]] = {}
    for version_dir in sorted(root.iterdir()):
        if version_dir.is_dir() and version_dir.name.isdigit():
            evals[int(version_dir.name)] = [
                json.loads(line) for f in sorted(version_dir.glob("*.jsonl"))
                for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not evals:
        raise ConfigError(f"no eval dumps under {root}")
    return evals


def form_table(evals: dict[int, list[dict[str, Any]]], forms: list[str]) -> str:
    """A markdown table: per form, per eval, mean reward and tool sequences."""
    cells: dict[tuple[str, int], list[tuple[float, str]]] = defaultdict(list)
    for version, episodes in evals.items():
        for ep in episodes:
            task = int(ep["task_id"])  # eval task ids count the items in file order
            if task >= len(forms):
                raise ConfigError(f"task {task} is past the {len(forms)} eval items given")
            cells[forms[task], version].append((float(ep["reward"]),
                                                tool_sequence(ep["completion"])))
    versions = sorted(evals)
    lines = ["| form | " + " | ".join(f"v{v}" for v in versions) + " |",
             "| --- |" + " --- |" * len(versions)]
    for form in dict.fromkeys(forms):  # in order of first appearance
        row = []
        for v in versions:
            got = cells.get((form, v), [])
            if not got:
                row.append("-")
                continue
            mean = sum(r for r, _ in got) / len(got)
            seqs = Counter(s or "none" for _, s in got).most_common()
            row.append(f"{mean:.2f} ({', '.join(f'{s} x{n}' for s, n in seqs)})")
        lines.append(f"| {form} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Print the per-form table of one trial's dumps."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trial_dir", help="<dump_root>/<experiment_name>/<trial_name>")
    p.add_argument("--eval", default=str(HERE / "eval.jsonl"), help="the run's eval items")
    args = p.parse_args(argv)
    items = [json.loads(line) for line in Path(args.eval).read_text(encoding="utf-8").splitlines()
             if line.strip()]
    forms = [str(item.get("form", "?")) for item in items]
    print(form_table(load_evals(Path(args.trial_dir)), forms))


if __name__ == "__main__":
    main()
