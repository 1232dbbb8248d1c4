"""Episodes against a fake-engine gateway: the fixtures and helpers the workflow, environment and
launcher tests share (registered for every test by tests/conftest.py's `pytest_plugins`).

`gw` is one scripted gateway per test module (every episode opens its own session anyway; a
folder's conftest.py or a module that defines its own `gw` or `client` overrides these), `client`
the admin `SessionClient` a workflow is given, with the script emptied for each test.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from relayrl.client.session_client import SessionClient
from relayrl.trajectory import SessionState
from relayrl.workflow import EpisodeContext
from tests.gateway.conftest import ADMIN, Gateway, fake_gateway


@pytest.fixture(scope="module")
def gw(model_dir: str) -> Iterator[Gateway]:
    """One fake-engine gateway for the module, batching every call a test makes."""
    g = fake_gateway(model_dir, batch_size=100_000)
    yield g
    g.thread.stop()


@pytest.fixture
async def client(gw: Gateway) -> AsyncIterator[SessionClient]:
    """The gateway's admin client, its script's replies and recorded requests emptied."""
    assert gw.script is not None
    gw.script.replies.clear()
    gw.script.requests.clear()
    async with SessionClient(gw.url, ADMIN) as c:
        yield c


def episode_ctx(i: int = 0, group: str = "grp-1", *, task_id: str = "t1",
                is_eval: bool = False) -> EpisodeContext:
    """The context of sample `i` of `group`: episode id `ep-<group>-<i>`, unique per sample."""
    return EpisodeContext(task_id=task_id, episode_id=f"ep-{group}-{i}", group_id=group,
                          sample_index=i, is_eval=is_eval)


def open_sessions(gw: Gateway) -> list[str]:
    """The ids of the gateway's sessions still open (an episode must leave none)."""
    return [s.id for s in gw.deps.store if s.state == SessionState.OPEN]
