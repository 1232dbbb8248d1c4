"""Gateways on loopback for the tests: a scripted FakeEngine one (fast) and a real-model one."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from relayrl.engine.fake import FakeEngine
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.types import GenerateRequest

ADMIN = "admin-test-key"


@dataclass
class Script:
    """Replies the fake engine gives, in order; "ok" once they run out. Records every request."""

    replies: list[str] = field(default_factory=list)
    requests: list[GenerateRequest] = field(default_factory=list)

    def __call__(self, request: GenerateRequest) -> str:
        self.requests.append(request)
        return self.replies.pop(0) if self.replies else "ok"


@dataclass
class Gateway:
    """A running gateway and handy ways to talk to it."""

    url: str
    thread: GatewayThread
    script: Script | None = None

    @property
    def deps(self):
        return self.thread.deps

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {ADMIN}"},
                            timeout=60)

    def start_session(self, **body) -> dict:
        with self.admin() as c:
            r = c.post("/rl/start_session", json=body)
            r.raise_for_status()
            return r.json()

    def export(self, session_id: str, **body) -> list[dict]:
        with self.admin() as c:
            r = c.post("/export_trajectories", json={"session_id": session_id, **body})
            r.raise_for_status()
            return r.json()["rows"]


def fake_gateway(model_dir: str, tmp_log: str | None = None, context_length: int = 8192,
                 **config) -> Gateway:
    script = Script()
    engine = FakeEngine(script, tokenizer_path=model_dir, context_length=context_length)
    cfg = GatewayConfig(model=model_dir, engine="fake", admin_key=ADMIN, log_path=tmp_log,
                        model_label="relayrl-test", **config)
    thread = GatewayThread(build_deps(cfg, engine=engine)).start()
    return Gateway(thread.url, thread, script)


@pytest.fixture
def gw(model_dir: str) -> Iterator[Gateway]:
    """A fresh fake-engine gateway per test (sessions do not leak between tests)."""
    g = fake_gateway(model_dir)
    yield g
    g.thread.stop()


@pytest.fixture(scope="session")
def real_gw(model_dir: str) -> Iterator[Gateway]:
    """A gateway over the real default model (LocalEngine), shared by the tests that need one."""
    cfg = GatewayConfig(model=model_dir, engine="local", admin_key=ADMIN,
                        model_label="relayrl-test")
    thread = GatewayThread(build_deps(cfg)).start()
    yield Gateway(thread.url, thread)
    thread.stop()
