"""Runs one command as the leader of its own process group, and kills that group when the process
that started it dies, however it dies (`kill -9` included).

Usage: `python -I -S _reaper.py FD -- ARGV...`. FD is the read end of a pipe whose write end only
the starting process holds: the kernel closes it when that process exits, so EOF on FD means the
starter is gone, and the reaper kills its whole group (the command and everything the command
started that stayed in the group). The command itself also gets `PR_SET_PDEATHSIG` (SIGKILL) on
Linux, so it dies even if the reaper is killed. When the command ends on its own, the reaper exits
the same way (its exit code, or the same signal).

Standard library only, and run as a file (never imported by relayrl), so it starts in tens of
milliseconds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the reaper (a single-threaded parent) dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _watch(fd: int) -> None:
    """Block until the starter's end of the pipe closes, then kill the group (this process too)."""
    while True:
        try:
            if not os.read(fd, 4096):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    os.killpg(os.getpgrp(), signal.SIGKILL)


def main(args: list[str]) -> int:
    """Start the command, watch the pipe, mirror how the command ended."""
    if len(args) < 3 or args[1] != "--":
        print("usage: _reaper.py FD -- ARGV...", file=sys.stderr)
        return 2
    fd = int(args[0])
    try:
        proc = subprocess.Popen(args[2:], preexec_fn=_die_with_parent)
    except OSError as e:
        print(f"relayrl reaper: cannot start {args[2]}: {e}", file=sys.stderr, flush=True)
        return 127
    # a starter that died before this line closed the pipe already: the watch sees EOF at once
    threading.Thread(target=_watch, args=(fd,), daemon=True).start()
    rc = proc.wait()
    if rc < 0:  # end the same way, so the starter sees the command's signal
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
