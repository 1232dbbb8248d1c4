"""Process-wide set-up a launcher does before a run starts: import paths, the C heap.

These change the whole process, so they belong to whoever owns the process (the launcher, the
CLI), never to a library layer such as the trainer. Imports: heap.
"""

from __future__ import annotations

import sys
from pathlib import Path

from relayrl.heap import keep_freed_heap


def add_import_path(folder: str | Path) -> None:
    """Let names like `agent.MathAgent` in a config import from the config's own folder."""
    path = str(Path(folder).resolve())
    if path not in sys.path:
        sys.path.insert(0, path)


__all__ = ["add_import_path", "keep_freed_heap"]
