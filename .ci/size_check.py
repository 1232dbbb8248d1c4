"""Warn about functions over 100 lines and modules over 800 lines (STYLE R10); schemas exempt."""

from __future__ import annotations

import ast
import pathlib
import sys

root = pathlib.Path(__file__).resolve().parent.parent / "src" / "relayrl"
warnings = []
lengths = []
for path in sorted(root.rglob("*.py")):
    text = path.read_text()
    lines = text.count("\n")
    if lines > 800 and "schema" not in path.parts:
        warnings.append(f"{path.relative_to(root)}: {lines} lines (> 800)")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            lengths.append(n)
            first = text.splitlines()[node.lineno - 2] if node.lineno > 1 else ""
            if n > 100 and "# size:" not in first:
                warnings.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {n} lines")
lengths.sort()
if lengths:
    over = sum(n > 50 for n in lengths) / len(lengths)
    print(f"size check: {len(lengths)} functions, median {lengths[len(lengths) // 2]} lines, "
          f"{over:.1%} over 50")
for w in warnings:
    print("size warning:", w)
sys.exit(1 if warnings else 0)
