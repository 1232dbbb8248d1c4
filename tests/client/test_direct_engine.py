"""`DirectClient(engine=engine, tokenizer=tokenizer)` inside `arun_episode`, as AReaL's docs write
the direct approach: plain (un-awaited) reward setters, `apply_reward_discount`, and
`export_interactions` returned from the episode for the trainer.

FakeEngine behind a loopback gateway; the real model runs the same in
tests/workflow/test_areal_workflows_train.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from relayrl.client import DirectClient, RunEngine, SessionClient
from relayrl.config import RelayConfig
from relayrl.errors import ConfigError, InvalidRequest, NotFound
from relayrl.launch.local import LocalServices
from relayrl.rollout import RolloutConfig
from relayrl.trajectory import TrajectoryRow
from relayrl.workflow import RolloutWorkflow
from tests.gateway.conftest import ADMIN, Gateway, fake_gateway


def compute_reward(response, answer) -> float:
    return float(response.choices[0].message.content.strip() == answer)


class MyWorkflow(RolloutWorkflow):
    """AReaL's direct approach, as written there (`ArealOpenAI` is relayrl's DirectClient)."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    async def arun_episode(self, engine, data):
        # Create client bound to engine
        client = DirectClient(engine=engine, tokenizer=self.tokenizer)

        # Use like standard OpenAI client
        response = await client.chat.completions.create(
            model="default",
            messages=data["messages"],
        )

        # Set reward and export
        reward = compute_reward(response, data["answer"])
        client.set_last_reward(reward)
        client.apply_reward_discount(turn_discount=0.9)

        return client.export_interactions(style="individual")


class RaisesAfterACall(RolloutWorkflow):
    async def arun_episode(self, engine, data):
        client = DirectClient(engine=engine)
        await client.chat.completions.create(model="default", messages=data["messages"])
        raise RuntimeError("the reward function broke")


@pytest.fixture
def gateway(model_dir: str) -> Iterator[Gateway]:
    g = fake_gateway(model_dir, max_staleness=None)
    yield g
    g.thread.stop()


@pytest.fixture
async def engine(gateway: Gateway, model_dir: str) -> Any:
    sessions = SessionClient(gateway.url, admin_key=ADMIN)
    yield RunEngine(gateway.deps.engine, sessions, model_dir=model_dir)
    await sessions.aclose()


def _services(gateway: Gateway, model_dir: str) -> LocalServices:
    client = SessionClient(gateway.url, admin_key=ADMIN)
    return LocalServices(gateway.deps.engine, gateway.thread, client, RelayConfig(), model_dir)


async def test_the_seeds_direct_workflow_trains_through_the_launchers_rollouts(
        gateway: Gateway, model_dir: str) -> None:
    gateway.script.replies[:] = ["4", "5"]
    services = _services(gateway, model_dir)
    data = [{"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}]
    rollout = RolloutConfig(group_size=2, batch_size=1, max_concurrent_rollouts=2,
                            episode_timeout_s=10, progress=False, max_consecutive_aborts=4)
    async with services.batches(MyWorkflow, None, data, rollout, version_fn=lambda: 0) as rc:
        async with asyncio.timeout(30):
            batch = await rc.next_batch()
    await services.client.aclose()
    assert batch.group_sizes == (2,) and batch.stats.aborted == 0
    assert sorted(batch.rows.rewards) == [0.0, 1.0]  # the un-awaited set_last_reward counted
    assert len(set(batch.episode_ids)) == 2
    # every episode's session was exported and acknowledged: none left open on the gateway
    assert [s.state for s in gateway.deps.store if s.state == "open"] == []


async def test_plain_reward_setters_discount_and_export_a_dict_keyed_by_id(engine) -> None:
    """AReaL's CAMEL steps by hand: two turns, rewards set without await, discount 0.9."""
    client = DirectClient(engine=engine)  # the tokenizer is optional: the model's own is used
    msgs = [{"role": "user", "content": "hello"}]
    r1 = await client.chat.completions.create(model="default", messages=msgs)
    msgs += [r1.choices[0].message.model_dump(), {"role": "user", "content": "more"}]
    r2 = await client.chat.completions.create(model="default", messages=msgs)
    client.set_reward(r1.id, 0.5)
    client.set_last_reward(1.0)
    client.apply_reward_discount(turn_discount=0.9)
    interactions = client.export_interactions(style="individual")  # a dict, no await needed
    assert len(interactions) == 2 and r1.id in interactions and r2.id in interactions
    assert set(interactions) == {row.interaction_ids[-1] for row in interactions.values()}
    assert all(isinstance(row, TrajectoryRow) for row in interactions.values())
    assert interactions[r2.id].reward == pytest.approx(1.0)
    assert interactions[r1.id].reward == pytest.approx(0.5 + 0.9 * 1.0)
    assert await client.export_interactions() is interactions  # awaiting it works too
    await client.aclose()


async def test_awaited_setters_send_at_once_and_a_bad_id_is_never_dropped(engine) -> None:
    client = DirectClient(engine=engine)
    with pytest.raises(InvalidRequest, match="no call yet"):
        client.set_last_reward(1.0)
    r = await client.chat.completions.create(model="default",
                                             messages=[{"role": "user", "content": "x"}])
    await client.set_last_reward(0.25)  # the async form still works
    with pytest.raises(NotFound):
        await client.set_reward("chatcmpl-nope", 1.0)
    client._pending.clear()
    client.set_reward("chatcmpl-nope", 1.0)  # plain: queued; the export must not swallow it
    with pytest.raises(NotFound):
        await client.export_interactions()
    client._pending.clear()
    rows = await client.export_interactions()
    assert rows[r.id].reward == pytest.approx(0.25)
    with pytest.raises(InvalidRequest, match="finite"):
        client.set_reward(r.id, float("nan"))
    await client.aclose()


async def test_a_reward_set_plainly_goes_to_the_call_before_it(engine) -> None:
    client = DirectClient(engine=engine)
    msgs = [{"role": "user", "content": "a"}]
    r1 = await client.chat.completions.create(model="default", messages=msgs)
    client.set_last_reward(0.75)  # for r1, though r2 is made before anything is sent
    msgs += [r1.choices[0].message.model_dump(), {"role": "user", "content": "b"}]
    r2 = await client.chat.completions.create(model="default", messages=msgs)
    rows = await client.export_interactions(style="individual", discount=0.0)
    assert rows[r1.id].reward == pytest.approx(0.75) and rows[r2.id].reward == 0.0
    await client.aclose()


async def test_an_episode_that_raises_leaves_no_session_open(gateway: Gateway,
                                                             model_dir: str) -> None:
    services = _services(gateway, model_dir)
    data = [{"messages": [{"role": "user", "content": "q"}], "answer": "4"}]
    rollout = RolloutConfig(group_size=2, batch_size=1, max_concurrent_rollouts=2,
                            episode_timeout_s=10, progress=False, max_consecutive_aborts=2)
    async with services.batches(RaisesAfterACall(), None, data, rollout,
                                version_fn=lambda: 0) as rc:
        with pytest.raises(Exception, match="the reward function broke"):
            async with asyncio.timeout(30):
                await rc.next_batch()
    await services.client.aclose()
    states = sorted(s.state for s in gateway.deps.store)
    assert states and set(states) == {"aborted"}


def test_a_bare_engine_is_refused_with_what_to_pass(gateway: Gateway) -> None:
    with pytest.raises(ConfigError, match="RunEngine"):
        DirectClient(engine=gateway.deps.engine)
