"""Arithmetic questions for the math agent: a seeded generator, and the train/eval files it writes.

    python examples/math_agent/tasks.py            # writes train.jsonl (256) and eval.jsonl (48)
    python examples/math_agent/tasks.py --train-mix balanced --out-dir /tmp/mix  # half one-call

Six forms, each solved with one or two calls of the agent's `add` and `multiply` tools:
`a + b`, `a * b`, `(a + b) * c`, `a * b + c`, `a + b + c`, `a * b * c`, with integers in
[2, 20]. Every item has the shape of `math.jsonl`: one user message and the integer answer as a
string. The eval questions come first from the generator and the train questions after them, all
distinct up to the order of commutative operands, so no eval question is a reordered train one.

Tradeoff: answers are computed from the operands here, not by evaluating the question text, so
the teacher (which reads only the text) is checked against an independent computation; the price
is one small answer function per form.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relayrl.errors import ConfigError

HERE = Path(__file__).resolve().parent
PHRASE = "What is {expression}? Use the add and multiply tools, then give the final number."
LOW, HIGH = 2, 20
"""Operands are drawn from [LOW, HIGH]: small enough that every product stays a short number."""


@dataclass(frozen=True)
class Form:
    """One shape of question: its text pattern, answer, and the operand order that does not matter."""

    name: str
    pattern: str
    """`str.format` pattern over the operands `a`, `b`, `c`."""
    arity: int
    answer: Callable[[int, int, int], int]
    """The result from the operands (unused operands are ignored)."""
    key: Callable[[int, int, int], tuple[Any, ...]]
    """Equal for questions that differ only in the order of commutative operands."""


FORMS: tuple[Form, ...] = (
    Form("add", "{a} + {b}", 2, lambda a, b, c: a + b, lambda a, b, c: tuple(sorted((a, b)))),
    Form("multiply", "{a} * {b}", 2, lambda a, b, c: a * b,
         lambda a, b, c: tuple(sorted((a, b)))),
    Form("add_then_multiply", "({a} + {b}) * {c}", 3, lambda a, b, c: (a + b) * c,
         lambda a, b, c: (*sorted((a, b)), c)),
    Form("multiply_then_add", "{a} * {b} + {c}", 3, lambda a, b, c: a * b + c,
         lambda a, b, c: (*sorted((a, b)), c)),
    Form("add_add", "{a} + {b} + {c}", 3, lambda a, b, c: a + b + c,
         lambda a, b, c: tuple(sorted((a, b, c)))),
    Form("multiply_multiply", "{a} * {b} * {c}", 3, lambda a, b, c: a * b * c,
         lambda a, b, c: tuple(sorted((a, b, c)))),
)


def make_task(form: Form, a: int, b: int, c: int = 0) -> dict[str, Any]:
    """One dataset item (math.jsonl's shape) for `form` over the operands."""
    expression = form.pattern.format(a=a, b=b, c=c)
    return {"messages": [{"role": "user", "content": PHRASE.format(expression=expression)}],
            "answer": str(form.answer(a, b, c)), "form": form.name}


def generate_tasks(n: int, seed: int = 0, low: int = LOW, high: int = HIGH,
                   forms: tuple[Form, ...] = FORMS) -> list[dict[str, Any]]:
    """`n` distinct questions, cycling through `forms`; the same arguments give the same list."""
    return _draw([(n, forms)], random.Random(seed), low, high)[0]


def _draw(parts: list[tuple[int, tuple[Form, ...]]], rng: random.Random, low: int,
          high: int) -> list[list[dict[str, Any]]]:
    """One list per (n, forms) part, drawn in turn from one stream and distinct across all parts."""
    if any(n < 0 or not forms for n, forms in parts) or low > high:
        raise ConfigError(f"need n >= 0, low <= high and some forms; got {parts}, {low}, {high}")
    seen: set[tuple[Any, ...]] = set()
    drawn = 0  # questions so far, over all parts: the position in each part's cycle of forms
    out: list[list[dict[str, Any]]] = []
    for n, forms in parts:
        tasks: list[dict[str, Any]] = []
        # bounded: each question needs a few draws at most unless the forms run out of operands
        for _ in range(100 * n + 1000):
            if len(tasks) == n:
                break
            form = forms[drawn % len(forms)]
            a, b, c = (rng.randint(low, high) for _ in range(3))
            c = c if form.arity == 3 else 0
            key = (form.name, *form.key(a, b, c))
            if key not in seen:
                seen.add(key)
                tasks.append(make_task(form, a, b, c))
                drawn += 1
        if len(tasks) < n:
            raise ConfigError(f"could not draw {n} distinct questions from operands in "
                              f"[{low}, {high}]")
        out.append(tasks)
    return out


def _by_name(*names: str) -> tuple[Form, ...]:
    forms = {f.name: f for f in FORMS}
    return tuple(forms[name] for name in names)


MIXES: dict[str, tuple[Form, ...]] = {
    "uniform": FORMS,
    # as many one-call questions as two-call ones: with the uniform mix two of every three
    # questions need two calls, and "always call twice" scores 4/6 (benchmarks/RESULTS.md)
    "balanced": _by_name("add", "add_then_multiply", "multiply", "multiply_then_add",
                         "add", "add_add", "multiply", "multiply_multiply"),
}
"""Cycles of forms for the training questions (a form listed twice is drawn twice as often)."""


def split_tasks(n_train: int = 256, n_eval: int = 48, seed: int = 0,
                train_mix: str = "uniform") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, eval): disjoint, eval drawn first (every form alike) so it does not depend on the rest."""
    if train_mix not in MIXES:
        raise ConfigError(f"unknown train mix {train_mix!r}; one of {sorted(MIXES)}")
    held_out, train = _draw([(n_eval, FORMS), (n_train, MIXES[train_mix])], random.Random(seed),
                            LOW, HIGH)
    return train, held_out


def write_tasks(tasks: list[dict[str, Any]], path: str | Path) -> None:
    """Write one JSON object per line."""
    with open(path, "w", encoding="utf-8") as f:
        for task in tasks:
            f.write(json.dumps(task) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Write train.jsonl and eval.jsonl."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", type=int, default=256, help="questions in train.jsonl")
    p.add_argument("--eval", type=int, default=48, help="questions in eval.jsonl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-mix", choices=sorted(MIXES), default="uniform",
                   help="how often each form is drawn for train.jsonl (eval.jsonl is uniform)")
    p.add_argument("--out-dir", default=str(HERE), help="where the two files go")
    args = p.parse_args(argv)
    train, held_out = split_tasks(args.train, args.eval, args.seed, args.train_mix)
    for name, tasks in (("train.jsonl", train), ("eval.jsonl", held_out)):
        write_tasks(tasks, Path(args.out_dir) / name)
        print(f"wrote {len(tasks)} questions to {Path(args.out_dir) / name}")


if __name__ == "__main__":
    main()
