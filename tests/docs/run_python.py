"""Run one Python block of the docs: `python run_python.py BLOCK.py`.

Top-level `await` / `async with` / `async for` are allowed (the block then runs in a fresh event
loop, as in `python -m asyncio`), because docs show async snippets at top level.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import os
import sys
import types


def main(path: str) -> None:
    """Compile the block with top-level await allowed and run it as `__main__`."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    code = compile(source, path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    module = types.ModuleType("__main__")
    module.__file__ = path
    sys.modules["__main__"] = module
    sys.argv = [path]
    sys.path[0] = os.path.dirname(os.path.abspath(path))  # as `python BLOCK.py` would have it
    result = eval(code, module.__dict__)  # the repository's own doc
    if inspect.iscoroutine(result):
        asyncio.run(result)


if __name__ == "__main__":
    main(sys.argv[1])
