"""How many CPU cores this process may run on (the engine and the trainer split them).

Imports: nothing of ours.
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
