"""Process-wide set-up a launcher does before a run starts: allocator settings, import paths.

These change the whole process, so they belong to whoever owns the process (the launcher, the
CLI), never to a library layer such as the trainer. Imports: the standard library only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from pathlib import Path


def limit_heap_growth(threshold_bytes: int = 1 << 20) -> bool:
    """Serve large allocations with mmap so freed tensors go back to the OS (glibc only).

    Training and rollouts allocate tensors of ever-changing shapes from several threads; glibc's
    heap keeps the freed blocks and the process grew by about 1 GB a minute until the OOM killer
    ended it (measured: a main-job run reached 20 GB). A fixed mmap threshold keeps it flat.
    """
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(-3, threshold_bytes))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        return False


def add_import_path(folder: str | Path) -> None:
    """Let names like `agent.MathAgent` in a config import from the config's own folder."""
    path = str(Path(folder).resolve())
    if path not in sys.path:
        sys.path.insert(0, path)
