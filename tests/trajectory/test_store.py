from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from relayrl.gateway.session_store import SessionStore
from relayrl.trajectory import (
    InteractionLog,
    Session,
    SessionState,
    export_session,
    row_to_dict,
)

from . import assistant, call, sys_msg, three_turn_session, user

TESTS_DIR = str(Path(__file__).resolve().parents[1])


def _snapshot(sessions: list[Session]) -> dict[str, Any]:
    """What must survive a restart: states, rewards, segments and the exported rows."""
    out: dict[str, Any] = {}
    for s in sorted(sessions, key=lambda s: s.id):
        out[s.id] = {
            "state": str(s.state),
            "task_id": s.task_id,
            "metadata": s.metadata,
            "final_reward": s.final_reward,
            "rewards": [c.reward for c in s.interactions],
            "segments": [[str(g.reason), list(g.interaction_ids)] for g in s.segments()],
            "rows": [row_to_dict(r) for style in ("individual", "concat")
                     for r in export_session(s, style, "discount", 0.9)],
        }
    return json.loads(json.dumps(out))


def _populate(store: SessionStore) -> list[Session]:
    done = store.start_session(task_id="t-1", metadata={"k": [1, 2]})
    calls = three_turn_session(done)
    done.set_reward(calls[0].id, 0.2)
    done.set_final_reward(1.0)
    done.end()
    live = store.start_session(task_id="t-2")
    h = [sys_msg(), user("q")]
    call(live, h, "a")
    call(live, [*h, assistant("a"), user("left")], "l", version=2)
    call(live, [*h, assistant("a"), user("right")], "r")
    call(live, [sys_msg(), user("compacted"), assistant("ok"), user("go")], "fin")
    exported = store.start_session()
    three_turn_session(exported)
    exported.end()
    exported.mark_exported()
    aborted = store.start_session()
    three_turn_session(aborted)
    aborted.abort()
    return [done, live, exported, aborted]


RECOVER_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from relayrl.trajectory import InteractionLog
    from trajectory.test_store import _snapshot
    with InteractionLog({path!r}) as log:
        sessions = log.recover()
        print(json.dumps({{"skipped": log.skipped, "sessions": _snapshot(sessions)}}))
""")


def _recover_in_subprocess(path: Path) -> dict[str, Any]:
    code = RECOVER_SCRIPT.format(tests=TESTS_DIR, path=str(path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_unexported_sessions_survive_a_restart_in_a_new_process(tmp_path: Path) -> None:
    path = tmp_path / "log.sqlite"
    with InteractionLog(path) as log:
        sessions = _populate(SessionStore(log=log))
        expected = _snapshot(sessions[:2])
    got = _recover_in_subprocess(path)
    assert got["skipped"] == 0
    assert got["sessions"] == expected  # exported and aborted sessions are not recovered


def test_closed_sessions_are_recovered_only_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "log.sqlite"
    with InteractionLog(path) as log:
        _populate(SessionStore(log=log))
    with InteractionLog(path) as log:
        states = sorted(str(s.state) for s in log.recover(include_closed=True))
    assert states == ["aborted", "ended", "exported", "open"]


def test_a_recovered_session_keeps_taking_calls_and_logging_them(tmp_path: Path) -> None:
    path = tmp_path / "log.sqlite"
    with InteractionLog(path) as log:
        s = SessionStore(log=log).start_session(api_key="secret")
        c1, c2, c3 = three_turn_session(s)
    with InteractionLog(path) as log:
        store = SessionStore(log=log)
        store.adopt(log.recover())
        s = store.by_key("secret")  # only the key's hash was logged, and that is enough
        assert s.api_key is None
        c4 = call(s, [*c3.conversation.messages, assistant("You are welcome."), user("more")],
                  "sure")
        assert c4.parent_id == c3.id and c4.segment_id == c1.segment_id
        s.set_reward(None, 1.0)
    with InteractionLog(path) as log:
        (again,) = log.recover()
        assert [c.id for c in again.interactions] == [c1.id, c2.id, c3.id, c4.id]
        assert again.get(c4.id).reward == 1.0


def test_a_corrupt_last_entry_does_not_lose_earlier_ones(tmp_path: Path) -> None:
    path = tmp_path / "log.sqlite"
    with InteractionLog(path) as log:
        sessions = _populate(SessionStore(log=log))
        expected = _snapshot(sessions[:2])
    db = sqlite3.connect(path)
    with db:
        db.execute("INSERT INTO events (session_id, kind, body, at) VALUES (?, ?, ?, 0)",
                   (sessions[1].id, "interaction", '{"id": "torn", "session_id'))
    db.close()
    with InteractionLog(path) as log:
        recovered = log.recover()
        assert log.skipped == 1
    assert _snapshot(recovered) == expected


CRASH_SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    from relayrl.gateway.session_store import SessionStore
    from relayrl.trajectory import InteractionLog
    from trajectory import three_turn_session
    log = InteractionLog({path!r})
    session = SessionStore(log=log).start_session(session_id="crashy")
    three_turn_session(session)
    os._exit(0)  # a crash: no close, no checkpoint; the WAL holds every append
""")


def test_a_torn_write_at_the_end_of_the_wal_keeps_the_committed_entries(tmp_path: Path) -> None:
    path = tmp_path / "log.sqlite"
    code = CRASH_SCRIPT.format(tests=TESTS_DIR, path=str(path))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    wal = Path(f"{path}-wal")
    assert wal.exists() and wal.stat().st_size > 0
    with open(wal, "r+b") as f:  # tear the last frame: the last append was cut mid-write
        f.truncate(wal.stat().st_size - 100)
    with InteractionLog(path) as log:
        (session,) = log.recover()
    assert session.id == "crashy" and session.state == SessionState.OPEN
    assert session.stats().calls == 2  # only the torn (last) call is lost


def test_log_entries_stay_small_as_a_conversation_grows(tmp_path: Path) -> None:
    path = tmp_path / "log.sqlite"
    with InteractionLog(path) as log:
        s = SessionStore(log=log).start_session()
        h = [sys_msg(), user("start")]
        for turn in range(30):
            call(s, h, f"answer {turn}")
            h += [assistant(f"answer {turn}"), user(f"question {turn}")]
    db = sqlite3.connect(path)
    sizes = [len(b) for (b,) in db.execute(
        "SELECT body FROM events WHERE kind = 'interaction' ORDER BY seq")]
    db.close()
    assert len(sizes) == 30
    assert sizes[-1] < 1.5 * sizes[1]  # linear log: no turn repeats the history before it


def test_compact_drops_only_exported_and_aborted_sessions(tmp_path: Path) -> None:
    path = tmp_path / "log.sqlite"
    with InteractionLog(path) as log:
        sessions = _populate(SessionStore(log=log))
        before = len(log)
        removed = log.compact()
        assert 0 < removed < before and len(log) == before - removed
        assert _snapshot(log.recover(include_closed=True)) == _snapshot(sessions[:2])


def test_the_log_is_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "log.sqlite"
    InteractionLog(path).close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()
    assert os.path.exists(path)


def test_a_restart_after_compaction_recovers_exactly_the_unacknowledged_sessions(
        tmp_path: Path) -> None:
    path = tmp_path / "log.sqlite"
    with InteractionLog(path) as log:
        store = SessionStore(log=log)
        sessions = _populate(store)  # ended, open, exported, aborted
        acked = store.start_session(task_id="acked")
        three_turn_session(acked)
        acked.end()
        store.acknowledge(acked.id)
        expected = _snapshot(sessions[:2])
        kept_events = len(log) - log.compact()
    got = _recover_in_subprocess(path)
    assert got["skipped"] == 0 and got["sessions"] == expected
    with InteractionLog(path) as log:
        assert len(log) == kept_events
        assert sorted(s.task_id or "" for s in log.recover(include_closed=True)) == ["t-1", "t-2"]
