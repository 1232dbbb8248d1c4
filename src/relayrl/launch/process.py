"""Process-wide set-up a launcher does before a run starts: import paths.

These change the whole process, so they belong to whoever owns the process (the launcher, the
CLI), never to a library layer such as the trainer. Imports: the standard library only.
"""

from __future__ import annotations

import sys
from pathlib import Path


def add_import_path(folder: str | Path) -> None:
    """Let names like `agent.MathAgent` in a config import from the config's own folder."""
    path = str(Path(folder).resolve())
    if path not in sys.path:
        sys.path.insert(0, path)
