"""What the viewer shows, as JSON: session summaries, one episode's tokens, the run's metrics.

Sessions come from a `SessionSource`: a live gateway's store (plus its durable log, for sessions
already exported and dropped from memory) or a finished run's SQLite log. An episode is shown as
its export rows (`concat` style, so each segment path is one token sequence with its loss mask,
logprobs, weight versions and turn spans), each token decoded on its own with the policy's
tokenizer.

May import: `relayrl.trajectory`, `relayrl.errors` (no torch, no gateway).
"""

from __future__ import annotations

import asyncio
import json
import math
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from relayrl.errors import RelayError
from relayrl.trajectory import InteractionLog, Session, SessionState
from relayrl.trajectory.export import ExportStyle, export_session

Decode = Callable[[Sequence[int]], str]
"""Token ids -> text (the renderer's or tokenizer's `decode`)."""

MAX_SESSIONS = 2000
"""Most sessions one listing returns (newest first): the page stays responsive on long runs."""


class SessionSource(Protocol):
    """Where sessions come from."""

    def sessions(self) -> list[Session]:
        """Every session known now (any state)."""
        ...


@runtime_checkable
class LiveSessionSource(SessionSource, Protocol):
    """A source whose sessions change under an event loop (`live`): read them on that loop."""

    live: bool

    async def asessions(self) -> list[Session]:
        """`sessions`, read on the event loop."""
        ...


class LogSource:
    """Sessions replayed from a durable log (`sessions.db`), re-read only when it changed, and
    at most every `min_interval_s` (a replay costs time proportional to the whole log)."""

    def __init__(self, path: str | Path, min_interval_s: float = 0.0) -> None:
        self.path = Path(path)
        self.min_interval_s = min_interval_s
        self._read_at = float("-inf")
        self._seen: int | None = None
        self._sessions: list[Session] = []
        self._lock = threading.Lock()

    def _last_seq(self) -> int:
        # read-only: the viewer must never write to (or create) a run's log
        conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
        try:
            row = conn.execute("SELECT COALESCE(MAX(seq), 0), COUNT(*) FROM events").fetchone()
            return int(row[0]) * 1_000_003 + int(row[1])  # grows on append, changes on compaction
        finally:
            conn.close()

    def sessions(self) -> list[Session]:
        """Every session in the log, exported and aborted ones included."""
        if not self.path.is_file():
            return []
        with self._lock:
            if time.monotonic() - self._read_at < self.min_interval_s:
                return list(self._sessions)
            try:
                mark = self._last_seq()
            except sqlite3.Error:
                return list(self._sessions)
            if mark != self._seen:
                log = InteractionLog(self.path)
                try:
                    self._sessions = log.recover(include_closed=True)
                finally:
                    log.close()
                self._seen = mark
                self._read_at = time.monotonic()
            return list(self._sessions)


class StoreSource:
    """A live gateway's sessions: those in memory, then those only its durable log still holds
    (exported or aborted ones the store let go; the log is replayed at most every
    `log_interval_s`, so a page left open does not load a busy gateway)."""

    def __init__(self, store: Iterable[Session], log_path: str | Path | None = None,
                 log_interval_s: float = 15.0) -> None:
        self.store = store
        self.log = LogSource(log_path, log_interval_s) if log_path else None

    live = True
    """Its sessions change under the gateway's event loop: read them on that loop, not a thread."""

    def sessions(self) -> list[Session]:
        """Live sessions first; logged ones the store no longer holds after them."""
        return self._merge(list(self.store), self.log.sessions() if self.log else [])

    async def asessions(self) -> list[Session]:
        """`sessions`, from the event loop: the store is read there, the log in a thread."""
        live = list(self.store)
        logged = await asyncio.to_thread(self.log.sessions) if self.log else []
        return self._merge(live, logged)

    @staticmethod
    def _merge(live: list[Session], logged: list[Session]) -> list[Session]:
        ids = {s.id for s in live}
        return live + [s for s in logged if s.id not in ids]


def _num(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def session_reward(s: Session) -> float | None:
    """The episode's reward: the final reward, else the last rewarded call's, else None."""
    if s.final_reward is not None:
        return s.final_reward
    rewarded = [c.reward for c in s.interactions if c.reward is not None]
    return rewarded[-1] if rewarded else None


def abort_reason(s: Session) -> str | None:
    """Why the episode did not end cleanly: the session was aborted, or a call was cut short."""
    if s.state == SessionState.ABORTED:
        return str(s.metadata.get("abort_reason") or "session_aborted")
    finishes = {c.finish_reason for c in s.interactions}
    if "abort" in finishes:
        return "call_aborted"
    if "length" in finishes:
        return "length"
    return None


def session_summary(s: Session) -> dict[str, Any]:
    """One row of the session list."""
    calls = s.interactions
    return {
        "id": s.id,
        "task_id": s.task_id,
        "state": str(s.state),
        "created": s.created,
        "last_active": s.last_active,
        "calls": len(calls),
        "segments": len(s.segments()),
        "tokens_sampled": sum(len(c.output_ids) for c in calls),
        "tool_calls": sum(len(c.reply.tool_calls) for c in calls),
        "reward": _num(session_reward(s)),
        "final_reward": _num(s.final_reward),
        "branch_reasons": sorted({str(c.branch_reason) for c in calls if c.branch_reason}),
        "finish_reasons": dict(Counter(c.finish_reason for c in calls)),
        "abort_reason": abort_reason(s),
        "versions": sorted({v for c in calls for v in c.versions}),
    }


def _in_range(x: float | None, lo: float | None, hi: float | None) -> bool:
    if lo is None and hi is None:
        return True
    if x is None:
        return False
    return (lo is None or x >= lo) and (hi is None or x <= hi)


def list_sessions(
    sessions: Sequence[Session],
    *,
    min_reward: float | None = None,
    max_reward: float | None = None,
    state: str | None = None,
    abort: str | None = None,
    branch: str | None = None,
) -> dict[str, Any]:
    """Summaries (newest first) that pass the filters, and the values each filter can take."""
    rows = [session_summary(s) for s in sessions]
    facets = {
        "state": sorted({r["state"] for r in rows}),
        "abort_reason": sorted({r["abort_reason"] for r in rows if r["abort_reason"]}),
        "branch_reason": sorted({b for r in rows for b in r["branch_reasons"]}),
    }
    keep = [
        r for r in rows
        if _in_range(r["reward"], min_reward, max_reward)
        and (not state or r["state"] == state)
        and (not abort or (r["abort_reason"] or "none") == abort)
        and (not branch or branch in r["branch_reasons"])
    ]
    keep.sort(key=lambda r: r["last_active"], reverse=True)
    return {"total": len(rows), "matched": len(keep), "sessions": keep[:MAX_SESSIONS],
            "facets": facets}


def episode_detail(s: Session, decode: Decode) -> dict[str, Any]:
    """One episode: each segment path as tokens (text, mask, logprob, version), calls, rewards."""
    try:
        rows = export_session(s, ExportStyle.CONCAT, allow_aborted=True)
        note = None
    except RelayError as exc:  # e.g. a reward the credit rule rejects: still show the tokens
        rows, note = [], f"could not export: {exc}"
    calls = {c.id: c for c in s.interactions}
    out_rows = []
    for row in rows:
        tokens = [
            [decode([t]), m, round(lp, 4) if m else None, v]
            for t, m, lp, v in zip(row.input_ids, row.loss_mask, row.logprobs, row.versions,
                                   strict=True)
        ]
        turns = []
        for cid, (start, end), r in zip(row.interaction_ids, row.turn_spans, row.turn_rewards,
                                        strict=True):
            c = calls[cid]
            turns.append({
                "id": cid, "start": start, "end": end, "credited_reward": _num(r),
                "reward": _num(c.reward), "finish_reason": c.finish_reason,
                "branch_reason": None if c.branch_reason is None else str(c.branch_reason),
                "tool_calls": [{"name": t.name, "arguments": t.arguments}
                               for t in c.reply.tool_calls],
                "content": c.reply.content,
            })
        out_rows.append({
            "segment_id": row.segment_id,
            "branch_reason": row.metadata.get("branch_reason"),
            "parent_segment_id": row.metadata.get("parent_segment_id"),
            "link_rule": row.metadata.get("link_rule"),
            "reward": _num(row.reward),
            "tokens": tokens,
            "turns": turns,
        })
    return {"session": session_summary(s), "metadata": _jsonable(s.metadata),
            "rows": out_rows, "note": note, "segments": segment_links(s)}


def segment_links(s: Session) -> list[dict[str, Any]]:
    """The session's segments in opening order, each with the segment and call it continues."""
    return [{"id": g.id, "reason": str(g.reason), "parent_segment_id": g.parent_segment_id,
             "parent_call_id": g.parent_id, "link_rule": g.link_rule,
             "calls": len(g.interaction_ids)} for g in s.segments()]


def _jsonable(x: Any) -> Any:
    try:
        json.dumps(x, allow_nan=False)
        return x
    except (TypeError, ValueError):
        return str(x)


def read_metrics(path: str | Path | None, limit: int = 20_000) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl file (a line being written is skipped, not an error)."""
    if path is None:
        return []
    p = Path(path)
    if not p.is_file():
        return []
    out: list[dict[str, Any]] = []
    with p.open() as f:
        for line in f:
            if len(out) >= limit:
                break
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out
