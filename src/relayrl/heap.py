"""The process's C heap: kept for the next training step, or handed back to the system.

A training process frees and allocates the same gigabytes every update. glibc's defaults hand
large freed blocks back to the kernel (its mmap threshold, which grows to at most 32 MiB; a
thread arena's 64 MiB heaps; trimming the top of the heap) and the next update faults the same
memory in again page by page: 150-250 thousand faults and 1-3 s of kernel time an update of the
main job's rows (benchmarks/RESULTS.md, "The allocator"). `keep_freed_heap` (the launchers call
it before a run starts threads; `train.keep_heap`) makes every thread allocate from one arena
and returns nothing below 2 GiB. A gateway alone hands free pages back after many sessions went
(`malloc_trim`); in a process that keeps its heap it does not (`kept`), since each trim would
make the next update fault its memory in again (about a million faults a step, measured).

Imports: the standard library only. Both do nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ctypes import _NamedFuncPointer  # what CDLL's attributes are, in the type stubs only

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_INT_MAX = 2**31 - 1

_kept = False


def _libc_function(name: str) -> _NamedFuncPointer | None:
    try:
        return getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None


def keep_freed_heap() -> bool:
    """Have glibc keep the memory a training step frees for the next step; False if not glibc.

    One arena, no trimming and no mmap below 2 GiB: an update reuses what the last one freed,
    and the process holds its peak heap between updates instead of returning it. The arena
    limit binds arenas made after it, so call this before the process starts threads.
    """
    global _kept
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _kept = all([mallopt(_M_ARENA_MAX, 1), mallopt(_M_TRIM_THRESHOLD, _INT_MAX),
                 mallopt(_M_MMAP_THRESHOLD, _INT_MAX)])
    return _kept


def kept() -> bool:
    """Whether this process keeps its freed heap (`keep_freed_heap` ran and glibc took it)."""
    return _kept


def _malloc_trim() -> _NamedFuncPointer | None:
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim.restype = ctypes.c_int
    return trim


MALLOC_TRIM: Callable[[int], int] | None = _malloc_trim()
"""glibc's `malloc_trim` (hands free heap pages back to the system), or None without glibc."""
