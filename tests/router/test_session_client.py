"""Everything a training run's `SessionClient` and a service's status reader do works through the
router: what `gateway.replicas` launchers rely on (real gateways on FakeEngine, a real router)."""

from __future__ import annotations

import asyncio

import httpx
from openai import AsyncOpenAI

from relayrl.client import SessionClient
from relayrl.gateway.routes_rl_v1 import state_of
from relayrl.router import RouterThread
from tests.router.conftest import ADMIN, Backend


def test_the_session_client_lifecycle_works_through_the_router(
        backends: list[Backend], router: RouterThread) -> None:
    async def run() -> None:
        async with SessionClient(router.url, admin_key=ADMIN) as client:
            # no staleness rule at these gateways: each has room for max_sessions; summed
            assert await client.grant_capacity() == sum(b.deps.config.max_sessions
                                                        for b in backends)
            sessions = [await client.start_session(f"t{i}", {"i": i}) for i in range(4)]
            held = [[b.holds(s.session_id) for b in backends] for s in sessions]
            assert all(sum(h) == 1 for h in held)  # each session lives on one backend
            assert sorted(sum(h[i] for h in held) for i in range(2)) == [2, 2]  # both used
            for i, s in enumerate(sessions):
                assert s.base_url.startswith(router.url + "/s/")  # the router's, not a backend's
                llm = AsyncOpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
                reply = await llm.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": f"hi {i}"}])
                await llm.close()
                assert reply.choices[0].message.content
            assert sorted(await client.open_sessions()) == sorted(s.session_id for s in sessions)
            await client.set_reward(sessions[0], 1.0)
            await client.end_session(sessions[0])
            await client.finalize(sessions[1], 0.5)
            await client.abort_session(sessions[2].session_id)
            finished = {s["session_id"] for s in await client.finished_sessions()}
            assert finished == {sessions[0].session_id, sessions[1].session_id}
            for s, reward in ((sessions[0], 1.0), (sessions[1], 0.5)):
                rows = await client.export(s.session_id)
                assert len(rows) == 1 and rows[0]["reward"] == reward
                await client.ack_export(s.session_id)
            assert await client.finished_sessions() == []
            assert await client.open_sessions() == [sessions[3].session_id]

    asyncio.run(run())


def test_status_sums_the_counts_and_passes_a_services_own_section_through(
        backends: list[Backend], router: RouterThread) -> None:
    for n, b in enumerate(backends):
        state_of(b.thread.app).status_extra = lambda n=n: {"trainer": {"step": 7, "from": n}}
    auth = {"authorization": f"Bearer {ADMIN}"}
    for _ in range(3):
        httpx.post(router.url + "/rl/start_session", json={}, headers=auth).raise_for_status()
    status = httpx.get(router.url + "/rl/v1/status").json()
    assert status["sessions"]["open"] == 3 and status["backends"] == {"healthy": 2, "total": 2}
    assert status["trainer"]["step"] == 7  # not added up: one backend's section, as it was
    assert status["status"] == "ok"  # the router's own keys win over a backend's
