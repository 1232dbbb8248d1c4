from __future__ import annotations

from typing import Any

import pytest

from relayrl.errors import (
    AuthenticationFailed,
    CapacityExhausted,
    InvalidRequest,
    NotFound,
    SessionClosed,
)
from relayrl.gateway.session_store import SessionStore
from relayrl.trajectory import EventKind, Session, SessionState, export_session

from . import call, three_turn_session, user


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# ---- rewards and lifecycle ----------------------------------------------------------------------


def test_set_reward_without_id_rewards_the_last_call() -> None:
    s = Session("s")
    c1, _, c3 = three_turn_session(s)
    assert s.set_reward(None, 1.5) == c3.id
    assert s.get(c3.id).reward == 1.5 and s.get(c1.id).reward is None
    assert s.stats().rewarded == 1


def test_set_reward_replaces_the_record_and_leaves_old_references_alone() -> None:
    s = Session("s")
    c1, *_ = three_turn_session(s)
    assert s.set_reward(c1.id, 0.5) == c1.id
    updated = s.get(c1.id)
    assert updated.reward == 0.5 and c1.reward is None
    assert updated.token_ids == c1.token_ids


def test_rewarding_an_unknown_call_or_an_empty_session_is_not_found() -> None:
    s = Session("s")
    with pytest.raises(NotFound):
        s.set_reward(None, 1.0)
    three_turn_session(s)
    with pytest.raises(NotFound):
        s.set_reward("nope", 1.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "high"])
def test_non_finite_or_non_numeric_rewards_are_refused(bad: Any) -> None:
    s = Session("s")
    three_turn_session(s)
    with pytest.raises(InvalidRequest):
        s.set_reward(None, bad)


def test_ended_sessions_take_rewards_but_no_calls_and_exported_ones_take_nothing() -> None:
    s = Session("s")
    three_turn_session(s)
    s.end()
    s.set_reward(None, 1.0)
    s.set_final_reward(2.0)
    with pytest.raises(SessionClosed):
        call(s, [user("again")], "x")
    s.mark_exported()
    assert s.state == SessionState.EXPORTED
    with pytest.raises(SessionClosed):
        s.set_reward(None, 0.0)
    s.abort()  # no-op once exported
    assert s.state == SessionState.EXPORTED


class RecordingJournal:
    def __init__(self, fail: bool = False) -> None:
        self.events: list[tuple[str, str]] = []
        self.fail = fail

    def append(self, session_id: str, kind: EventKind, body: dict[str, Any]) -> None:
        if self.fail:
            raise OSError("disk full")
        self.events.append((session_id, str(kind)))


def test_every_change_is_journaled_in_order() -> None:
    j = RecordingJournal()
    s = Session("s", journal=j)
    three_turn_session(s)
    s.set_reward(None, 1.0)
    s.set_final_reward(1.0)
    s.end()
    s.mark_exported()
    kinds = [k for _, k in j.events]
    assert kinds == ["start", "interaction", "interaction", "interaction", "reward",
                     "final_reward", "end", "exported"]


def test_a_failed_journal_write_leaves_the_session_unchanged() -> None:
    j = RecordingJournal()
    s = Session("s", journal=j)
    c1, *_ = three_turn_session(s)
    j.fail = True
    with pytest.raises(OSError):
        call(s, [user("fresh")], "x")
    with pytest.raises(OSError):
        s.set_reward(c1.id, 1.0)
    with pytest.raises(OSError):
        s.end()
    assert s.stats().calls == 3 and s.get(c1.id).reward is None
    assert s.state == SessionState.OPEN


# ---- the store ----------------------------------------------------------------------------------


def test_idle_sessions_expire_as_aborted_never_as_a_zero_reward() -> None:
    clock = Clock()
    store = SessionStore(ttl_s=60, clock=clock)
    idle = store.start_session(task_id="t")
    busy = store.start_session(task_id="t")
    three_turn_session(idle)
    clock.t += 30
    store.get(busy.id)  # activity through the store keeps it alive
    clock.t += 40
    expired = store.expire()
    assert expired == [idle]
    assert idle.state == SessionState.ABORTED and busy.state == SessionState.OPEN
    assert all(c.reward is None for c in idle.interactions)
    with pytest.raises(SessionClosed):
        export_session(idle)


def test_activity_inside_the_session_also_counts_against_expiry() -> None:
    clock = Clock()
    store = SessionStore(ttl_s=60, clock=clock)
    s = store.start_session()
    clock.t += 50
    s.set_final_reward(0.0)  # touches the session without going through the store
    clock.t += 50
    assert store.expire() == []


def test_sessions_are_found_by_key_and_wrong_keys_are_refused() -> None:
    store = SessionStore()
    a = store.start_session(api_key="key-a")
    b = store.start_session()
    assert store.by_key("key-a") is a
    assert b.api_key is not None and store.by_key(b.api_key) is b
    with pytest.raises(AuthenticationFailed):
        store.by_key("key-zzz")
    assert store.authorize(a.id, "key-a") is a
    with pytest.raises(AuthenticationFailed):
        store.authorize(a.id, b.api_key)
    with pytest.raises(NotFound):
        store.get("missing")


def test_a_full_store_evicts_exported_and_aborted_sessions_first() -> None:
    clock = Clock()
    store = SessionStore(ttl_s=60, max_sessions=3, clock=clock)
    exported, kept, stale = (store.start_session() for _ in range(3))
    exported.end()
    exported.mark_exported()
    clock.t += 30
    store.get(kept.id)
    clock.t += 40  # `stale` is now past its TTL, `kept` is not
    fresh = store.start_session()
    assert set(s.id for s in store) == {kept.id, fresh.id}
    assert stale.state == SessionState.ABORTED
    with pytest.raises(AuthenticationFailed):
        store.by_key(exported.api_key or "")


def test_a_store_full_of_unexported_sessions_refuses_rather_than_drops_data() -> None:
    store = SessionStore(max_sessions=2)
    a, b = store.start_session(), store.start_session()
    a.end()
    with pytest.raises(CapacityExhausted, match="full"):
        store.start_session()
    assert len(store) == 2 and b.state == SessionState.OPEN


def test_grant_capacity_follows_the_staleness_rule() -> None:
    store = SessionStore()
    # submitted <= (version + max_staleness + 1) * batch_size
    assert store.grant_capacity(version=0, max_staleness=1, batch_size=4) == 8
    for _ in range(8):
        store.start_session()
    assert store.grant_capacity(0, 1, 4) == 0
    with pytest.raises(CapacityExhausted, match="staleness"):
        store.start_session()
    assert store.grant_capacity(1, 1, 4) == 4
    store.start_session()
    assert store.submitted == 9 and store.grant_capacity(1, 1, 4) == 3


def test_grant_capacity_refuses_nonsense() -> None:
    store = SessionStore()
    with pytest.raises(InvalidRequest):
        store.grant_capacity(0, -1, 4)
    with pytest.raises(InvalidRequest):
        store.grant_capacity(0, 0, 0)


def test_counters_report_sessions_by_state() -> None:
    store = SessionStore()
    a = store.start_session()
    store.start_session()
    a.abort()
    assert store.stats() == {"submitted": 2, "open": 1, "ended": 0, "exported": 0,
                             "aborted": 1, "aborted_total": 0, "expired_total": 0,
                             "exported_total": 0}  # a.abort() bypassed the store's count


def test_ended_sessions_nobody_exports_expire_as_aborted_and_are_then_forgotten() -> None:
    clock = Clock()
    store = SessionStore(ttl_s=60, ended_ttl_s=600, clock=clock)
    store.grant_capacity(version=0, max_staleness=0, batch_size=2)
    ended = store.start_session()
    three_turn_session(ended)
    ended.end()
    assert store.grant_capacity(0, 0, 2) == 1
    clock.t += 300  # past the open TTL, not the ended one: still waiting for a trainer
    assert store.expire() == [] and ended.state == SessionState.ENDED
    clock.t += 301
    assert store.expire() == [ended] and ended.state == SessionState.ABORTED
    assert store.grant_capacity(0, 0, 2) == 2  # its slot came back
    assert ended.id in store  # a late caller still learns it closed ...
    clock.t += 61
    store.expire()
    assert ended.id not in store and len(store) == 0  # ... then it is forgotten
    assert store.stats()["aborted_total"] == 1 and store.stats()["expired_total"] == 1


def test_a_store_full_of_ended_sessions_admits_again_after_their_ttl() -> None:
    clock = Clock()
    store = SessionStore(ttl_s=60, ended_ttl_s=120, max_sessions=2, clock=clock)
    for _ in range(2):
        store.start_session().end()  # e.g. DirectClient sessions exported but never acknowledged
    with pytest.raises(CapacityExhausted, match="full"):
        store.start_session()
    clock.t += 121
    store.start_session()
    assert len(store) == 1


def test_aborted_sessions_are_forgotten_a_ttl_after_they_closed() -> None:
    clock = Clock()
    store = SessionStore(ttl_s=60, clock=clock)
    s = store.start_session()
    clock.t += 50
    store.abort(s.id)
    clock.t += 50  # 100 s after its last call, 50 s after it closed
    store.expire()
    assert s.id in store
    clock.t += 11
    store.expire()
    assert s.id not in store
    assert store.stats()["aborted_total"] == 1 and store.stats()["expired_total"] == 0
