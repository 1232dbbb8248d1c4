"""Real gateways (FakeEngine, uvicorn on loopback) behind a real router on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from relayrl.engine.fake import FakeEngine
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.router import RouterConfig, RouterThread

ADMIN = "admin-test-key"


@dataclass
class Sent:
    """What a gateway put on the wire: (path, status, body bytes) of every answer."""

    answers: list[tuple[str, int, bytes]] = field(default_factory=list)


class Recorder:
    """ASGI wrapper that records each answer's bytes exactly as the gateway sends them."""

    def __init__(self, app, sent: Sent) -> None:
        self.app, self.sent = app, sent

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status, chunks = 0, []

        async def spy(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    self.sent.answers.append((scope["path"], status, b"".join(chunks)))
            await send(message)

        await self.app(scope, receive, spy)


@dataclass
class Backend:
    url: str
    thread: GatewayThread
    sent: Sent
    admin_key: str

    @property
    def deps(self):
        return self.thread.deps

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30,
                            headers={"authorization": f"Bearer {self.admin_key}"})

    def holds(self, session_id: str) -> bool:
        """Whether this gateway holds `session_id` (asked over its own HTTP API)."""
        with self.admin() as c:
            r = c.post("/export_trajectories", json={"session_id": session_id})
        assert r.status_code in (200, 404), r.text
        return r.status_code == 200

    def stop(self) -> None:
        self.thread.stop()


def start_backend(model_dir: str, admin_key: str = ADMIN, **config) -> Backend:
    """A fake-engine gateway on loopback (`config`: more GatewayConfig settings)."""
    engine = FakeEngine(["hello there", "second reply", "third"], tokenizer_path=model_dir)
    cfg = GatewayConfig(model=model_dir, engine="fake", admin_key=admin_key,
                        model_label="relayrl-test", **config)
    thread = GatewayThread(build_deps(cfg, engine=engine))
    sent = Sent()
    thread.server.config.app = Recorder(thread.app, sent)
    thread.start()
    return Backend(thread.url, thread, sent, admin_key)


@pytest.fixture
def backends(model_dir: str) -> Iterator[list[Backend]]:
    """Two fresh gateways."""
    bs = [start_backend(model_dir), start_backend(model_dir)]
    yield bs
    for b in bs:
        b.stop()


def start_router(config: RouterConfig) -> RouterThread:
    return RouterThread(config).start()


@pytest.fixture
def router(backends: list[Backend]) -> Iterator[RouterThread]:
    """A router in front of `backends` (health checks every 0.2 s)."""
    r = start_router(RouterConfig(backends=[b.url for b in backends], health_interval_s=0.2,
                                  health_timeout_s=1.0))
    yield r
    r.stop()
