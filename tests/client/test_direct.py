"""DirectClient: a real AsyncOpenAI bound to an in-process gateway app, no network."""

from __future__ import annotations

import pytest

from relayrl.client import DirectClient
from relayrl.engine.fake import FakeEngine
from relayrl.gateway.app import create_app
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import build_deps


@pytest.fixture
def app(model_dir: str):
    engine = FakeEngine(["first reply", "second reply"], tokenizer_path=model_dir)
    return create_app(build_deps(GatewayConfig(model=model_dir, engine="fake", admin_key="k"),
                                 engine=engine))


async def test_direct_client_records_rewards_and_exports_like_the_http_path(app) -> None:
    async with await DirectClient.open(app, task_id="direct") as client:
        msgs = [{"role": "user", "content": "hello"}]
        r1 = await client.chat.completions.create(model="m", messages=msgs)
        msgs += [r1.choices[0].message.model_dump(), {"role": "user", "content": "more"}]
        r2 = await client.chat.completions.create(model="m", messages=msgs)
        assert (r1.choices[0].message.content, r2.choices[0].message.content) == (
            "first reply", "second reply")
        await client.set_reward(r1.id, 0.5)
        await client.set_last_reward(1.0)
        rows = await client.export_interactions(style="individual", discount=1.0)
        assert [r.reward for r in rows.values()] == [pytest.approx(1.5), pytest.approx(1.0)]
        # export is idempotent: calling again (session already ended) gives the same rows
        assert client.export_interactions(style="individual") is rows
        assert await client.export_interactions(style="individual") == rows


async def test_an_unawaited_export_of_an_app_bound_client_is_never_taken_for_rows(app) -> None:
    async with await DirectClient.open(app) as client:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        client.set_last_reward(1.0)  # plain: queued, sent with the export
        pending = client.export_interactions()
        with pytest.raises(TypeError, match="awaited"):
            len(pending)
        with pytest.raises(AttributeError, match="awaited"):
            pending.items()
        rows = await pending
        assert [r.reward for r in rows.values()] == [1.0]


async def test_direct_client_streams_through_the_same_routes(app) -> None:
    async with await DirectClient.open(app) as client:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "s"}], stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == "first reply"


async def test_closing_a_direct_client_frees_its_session(app) -> None:
    store = app.state.deps.store
    async with await DirectClient.open(app) as exported:
        await exported.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        await exported.export_interactions()
    async with await DirectClient.open(app) as abandoned:
        await abandoned.chat.completions.create(model="m", messages=[{"role": "user", "content": "b"}])
    # the exported rows went to the caller: acknowledged; the other was never taken: aborted
    assert len(store) == 1 and [s.state for s in store] == ["aborted"]
    assert store.stats()["exported_total"] == 1 and store.stats()["aborted_total"] == 1
