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
    """A loopback gateway started without an admin key, as seed 003's example expects."""
    from relayrl.engine.fake import FakeEngine
    from relayrl.gateway.config import GatewayConfig
    from relayrl.gateway.server import GatewayThread, build_deps
    from tests.gateway.conftest import Script

    script = Script()
    engine = FakeEngine(script, tokenizer_path=model_dir)
    cfg = GatewayConfig(model=model_dir, engine="fake", admin_key=None, max_staleness=None,
                        model_label="relayrl-test")
    thread = GatewayThread(build_deps(cfg, engine=engine)).start()
    yield Gateway(thread.url, thread, script)
    thread.stop()


def admin_headers() -> dict[str, str]:
    """Headers carrying the test gateways' admin key."""
    return {"authorization": f"Bearer {ADMIN}"}
