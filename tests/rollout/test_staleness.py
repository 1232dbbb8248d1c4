"""The staleness rule is never exceeded, whatever the order of completions, bumps and batches."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.errors import CapacityExhausted
from relayrl.rollout import RolloutConfig, RolloutController, StalenessGate
from relayrl.workflow import RolloutWorkflow
from relayrl.workflow import workflow_context as wc
from tests.workflow.helpers import make_td


class GatedWorkflow(RolloutWorkflow):
    """Episodes wait until the test tells each one how to end (ok / none / raise)."""

    def __init__(self) -> None:
        self.waiting: dict[str, tuple[str, asyncio.Future[str]]] = {}
        self.groups: dict[str, list[str | None]] = {}  # group id -> member outcomes so far

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        ctx = wc.get()
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.waiting[ctx.episode_id] = (ctx.group_id, fut)
        self.groups.setdefault(ctx.group_id, [])
        how = await fut
        self.groups[ctx.group_id].append(how)
        if how == "raise":
            raise RuntimeError("boom")
        return None if how == "none" else make_td(1, 4)

    def complete(self, pick: int, how: str) -> None:
        episode_id = sorted(self.waiting)[pick % len(self.waiting)]
        _, fut = self.waiting.pop(episode_id)
        fut.set_result(how)

    def counts(self, group_size: int) -> tuple[int, int]:
        """(accepted, running) groups as the test sees them."""
        done = {g: o for g, o in self.groups.items() if len(o) == group_size}
        accepted = sum(1 for o in done.values() if "ok" in o)
        return accepted, len(self.groups) - len(done)


Op = tuple[str, int, str]
ops = st.lists(
    st.one_of(
        st.tuples(st.just("complete"), st.integers(0, 50), st.sampled_from(["ok", "none",
                                                                             "raise"])),
        st.tuples(st.just("bump"), st.just(0), st.just("")),
        st.tuples(st.just("batch"), st.just(0), st.just("")),
    ),
    min_size=1, max_size=60,
)


async def _settle() -> None:
    for _ in range(8):  # let the feeder and the group tasks react
        await asyncio.sleep(0)


async def _play(schedule: list[Op], group_size: int, batch_size: int, max_staleness: int,
                max_concurrent: int) -> None:
    cfg = RolloutConfig(group_size=group_size, batch_size=batch_size,
                        max_staleness=max_staleness, max_concurrent_rollouts=max_concurrent,
                        progress=False, shuffle=False)
    wf = GatedWorkflow()
    rc = RolloutController(wf, [{"i": i} for i in range(5)], cfg)
    version = 0
    rc.start()
    try:
        for kind, pick, how in schedule:
            await _settle()
            if kind == "complete" and wf.waiting:
                wf.complete(pick, how)
            elif kind == "bump":
                version += 1
                rc.set_version(version)
            elif kind == "batch" and rc.stats().groups_queued >= batch_size:
                batch = await rc.next_batch()
                assert len(batch.group_sizes) == batch_size
            await _settle()
            accepted, running = wf.counts(group_size)
            limit = (version + max_staleness + 1) * batch_size
            assert accepted + running <= limit, (accepted, running, version)
            assert len(wf.waiting) <= max_concurrent
            assert (rc.gate.accepted, rc.gate.running) == (accepted, running)
    finally:
        await rc.aclose()


@settings(max_examples=40, deadline=None)
@given(schedule=ops, group_size=st.integers(1, 3), batch_size=st.integers(1, 3),
       max_staleness=st.integers(0, 2), extra_concurrency=st.integers(0, 6))
def test_accepted_plus_running_groups_never_exceed_the_limit(
        schedule, group_size, batch_size, max_staleness, extra_concurrency) -> None:
    asyncio.run(_play(schedule, group_size, batch_size, max_staleness,
                      group_size + extra_concurrency))


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["admit", "finish", "bump"]), st.booleans()),
                      max_size=80),
       batch_size=st.integers(1, 4), max_staleness=st.integers(0, 3))
def test_the_gate_refuses_exactly_what_the_rule_forbids(steps, batch_size, max_staleness) -> None:
    gate = StalenessGate(batch_size, max_staleness)
    version = 0
    for kind, flag in steps:
        if kind == "admit":
            allowed = gate.submitted + 1 <= (version + max_staleness + 1) * batch_size
            if allowed:
                gate.admit(version)
            else:
                with pytest.raises(CapacityExhausted):
                    gate.admit(version)
        elif kind == "finish" and gate.running:
            gate.finish(accepted=flag)
        elif kind == "bump":
            version += 1
        assert gate.submitted <= gate.limit(version)
        assert gate.capacity(version) == max(0, gate.limit(version) - gate.submitted)
