"""Gateways for the framework zoo: a real-model one shared by the module tests, fake ones per test.

Each gateway's app is wrapped so the tests see every response's status: a framework whose calls
draw a 4xx/5xx fails its test even where the framework itself swallows the error.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from relayrl.engine.fake import FakeEngine
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps
from tests.gateway.conftest import ADMIN, Script

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "frameworks"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))  # the examples import `mathtask` and `harness` as scripts

from harness import Episode, episode  # noqa: E402


@dataclass
class StatusLog:
    """ASGI wrapper recording (method, path, status) of every response."""

    app: Any
    seen: list[tuple[str, str, int]] = field(default_factory=list)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_and_log(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.seen.append((scope["method"], scope["path"], message["status"]))
            await send(message)

        await self.app(scope, receive, send_and_log)


@dataclass
class ZooGateway:
    """A running gateway, its status log, and (fake engine only) its script."""

    thread: GatewayThread
    log: StatusLog
    script: Script | None = None

    @property
    def url(self) -> str:
        return self.thread.url

    async def episode(self, run: Any, **kwargs: Any) -> Episode:
        """One episode of `run`; fails on any 4xx/5xx the session's calls drew."""
        start = len(self.log.seen)
        ep = await episode(self.url, ADMIN, run, **kwargs)
        errors = [s for s in self.log.seen[start:] if s[2] >= 400]
        assert not errors, f"the framework's calls drew errors: {errors}"
        # sessions are reached by key: the session's base URL is /s/{key}/..., the key a secret
        completion_calls = [s for s in self.log.seen[start:] if s[1].startswith("/s/")
                            and s[0] == "POST"]
        assert completion_calls, "the framework made no call through the session's URL"
        assert ep.rows, "the session recorded no call"
        return ep


def _serve(deps: Any) -> ZooGateway:
    thread = GatewayThread(deps)
    log = StatusLog(thread.app)
    thread.server.config.app = log  # uvicorn loads the app from its config when it starts
    thread.start()
    return ZooGateway(thread, log)


@pytest.fixture(scope="session")
def zoo_real(model_dir: str) -> Iterator[ZooGateway]:
    """One gateway over the real default model, shared by every framework's real-model test."""
    cfg = GatewayConfig(model=model_dir, engine="local", admin_key=ADMIN, model_label="default")
    gw = _serve(build_deps(cfg))
    yield gw
    gw.thread.stop()


@pytest.fixture(scope="session")
def zoo_fake_server(model_dir: str) -> Iterator[ZooGateway]:
    """One scripted FakeEngine gateway for the whole run (each episode has its own session)."""
    script = Script()
    engine = FakeEngine(script, tokenizer_path=model_dir, context_length=8192)
    cfg = GatewayConfig(model=model_dir, engine="fake", admin_key=ADMIN, model_label="default")
    gw = _serve(build_deps(cfg, engine=engine))
    gw.script = script
    yield gw
    gw.thread.stop()


@pytest.fixture
def zoo_fake(zoo_fake_server: ZooGateway) -> ZooGateway:
    """The scripted gateway with an empty script and log, for the paths a 135M model rarely takes."""
    assert zoo_fake_server.script is not None
    zoo_fake_server.script.replies.clear()
    zoo_fake_server.script.requests.clear()
    zoo_fake_server.log.seen.clear()
    return zoo_fake_server


def assert_trainable(ep: Episode) -> None:
    """At least one recorded call, with the model's own tokens under the loss mask."""
    assert ep.rows, "the session exported no rows"
    assert ep.trained_tokens > 0, "no token of any row is under the loss mask"
    for row in ep.rows:
        assert len(row["loss_mask"]) == len(row["input_ids"])


def tool_result_reached_model(gw: ZooGateway, text: str = "42") -> bool:
    """Whether a later prompt the engine saw carries the tool's result (absent from the question)."""
    assert gw.script is not None
    renderer = gw.thread.deps.renderer
    return any(text in renderer.decode(list(r.prompt_ids)) for r in gw.script.requests[1:])
