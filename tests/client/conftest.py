"""Gateways on loopback for the AgentSession tests (FakeEngine: routing is what is tested here)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gateway.conftest import ADMIN, Gateway, fake_gateway, real_gw  # noqa: F401


@pytest.fixture
def svc(model_dir: str) -> Iterator[Gateway]:
    """A fake-engine gateway with an admin key and no staleness rule (capacity is not tested)."""
    g = fake_gateway(model_dir, max_staleness=None)
    yield g
    g.thread.stop()


@pytest.fixture
def open_svc(model_dir: str) -> Iterator[Gateway]:
    """A loopback gateway as `relayrl gateway` starts one, for the manual-trajectory example.

    It has an admin key (a gateway never runs with its control routes open); the example's code
    stays as written and finds the key in the environment (`RELAYRL_API_KEY`).
    """
    g = fake_gateway(model_dir, max_staleness=None)
    yield g
    g.thread.stop()


def admin_headers() -> dict[str, str]:
    """Headers carrying the test gateways' admin key."""
    return {"authorization": f"Bearer {ADMIN}"}
