"""Process-wide set-up a launcher does before a run starts: import paths, the C heap.

These change the whole process, so they belong to whoever owns the process (the launcher, the
CLI), never to a library layer such as the trainer. Imports: the standard library only.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_INT_MAX = 2**31 - 1


def add_import_path(folder: str | Path) -> None:
    """Let names like `agent.MathAgent` in a config import from the config's own folder."""
    path = str(Path(folder).resolve())
    if path not in sys.path:
        sys.path.insert(0, path)


def keep_freed_heap() -> bool:
    """Have glibc keep the memory a training step frees for the next step; False if not glibc.

    By default glibc hands large freed blocks back to the kernel: tensors above its mmap
    threshold (which grows to at most 32 MiB), the top of a heap above its trim threshold, and,
    for a thread's own arena, whatever outgrows the arena's 64 MiB heaps. The next update then
    faults the same memory in again page by page: 150-250 thousand faults and 1-3 s of kernel
    time an update of the main job's rows, 8% of its wall time (benchmarks/RESULTS.md, "The
    allocator"). With one arena, no trimming and no mmap under 2 GiB, an update reuses what the
    last one freed; the process holds its peak heap between updates instead of returning it.
    The arena limit binds arenas made after it, so this runs before the run starts threads.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all([mallopt(_M_ARENA_MAX, 1), mallopt(_M_TRIM_THRESHOLD, _INT_MAX),
                mallopt(_M_MMAP_THRESHOLD, _INT_MAX)])
