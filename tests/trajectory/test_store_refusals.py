"""The durable log refuses what it cannot store, whole and quickly (issue 10, item 8).

An event holding a lone UTF-16 surrogate is a 400 (`InvalidRequest`), not a SQLite error, and
nothing of it is written; a log locked by another process is an `Unavailable` (503) after a
short wait, never SQLite's 5 s default on the gateway's event loop.
"""

from __future__ import annotations

import sqlite3
import time

import pytest

from relayrl.errors import InvalidRequest, Unavailable
from relayrl.trajectory import InteractionLog
from relayrl.trajectory.records import EventKind


def test_a_lone_surrogate_is_refused_and_nothing_is_written(tmp_path) -> None:
    with InteractionLog(tmp_path / "log.sqlite") as log:
        log.append("s1", EventKind.START, {"task_id": "fine \U0001F600"})
        for body in ({"task_id": "bad \ud800"}, {"metadata": {"\udfff": 1}}):
            with pytest.raises(InvalidRequest, match="cannot record"):
                log.append("s2", EventKind.START, body)
        with pytest.raises(InvalidRequest):
            log.append("s2", EventKind.START, {"x": float("nan")})
        assert len(log) == 1


def test_a_locked_log_is_unavailable_after_a_short_wait(tmp_path) -> None:
    path = tmp_path / "log.sqlite"
    with InteractionLog(path, busy_timeout_s=0.1) as log:
        locker = sqlite3.connect(str(path), isolation_level=None, timeout=0)
        locker.execute("BEGIN EXCLUSIVE")
        try:
            t0 = time.monotonic()
            with pytest.raises(Unavailable, match="locked"):
                log.append("s1", EventKind.START, {})
            assert time.monotonic() - t0 < 2.0
        finally:
            locker.execute("ROLLBACK")
            locker.close()
        log.append("s1", EventKind.START, {})
        assert len(log) == 1
