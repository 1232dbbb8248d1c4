"""Loopback servers for the remote rollout tests: the rollout server, fake-engine gateways."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from relayrl.engine.fake import FakeEngine
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.remote_rollout.config import ServerConfig
from relayrl.remote_rollout.executor import AppState
from relayrl.remote_rollout.server import create_app
from relayrl.types import GenerateRequest

ADMIN = "admin-test-key"


class AppThread:
    """Any ASGI app served by uvicorn on a loopback port (0: a free one) in a daemon thread."""

    def __init__(self, app: Any) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level="warning", access_log=False))
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def start(self, timeout_s: float = 30.0) -> AppThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)


@dataclass
class Script:
    """Replies the fake engine gives, in order ("ok" once they run out); records requests."""

    replies: list[str] = field(default_factory=list)
    requests: list[GenerateRequest] = field(default_factory=list)

    def __call__(self, request: GenerateRequest) -> str:
        self.requests.append(request)
        return self.replies.pop(0) if self.replies else "ok"


@dataclass
class FakeGateway:
    url: str
    thread: GatewayThread
    script: Script

    @property
    def deps(self):
        return self.thread.deps

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {ADMIN}"},
                            timeout=60)

    def start_session(self) -> dict:
        with self.admin() as c:
            r = c.post("/rl/start_session", json={})
            r.raise_for_status()
            return r.json()

    def export(self, session_id: str) -> list[dict]:
        with self.admin() as c:
            r = c.post("/export_trajectories", json={"session_id": session_id})
            r.raise_for_status()
            return r.json()["rows"]


@pytest.fixture
def gw(model_dir: str) -> Iterator[FakeGateway]:
    """A fake-engine gateway (real tokenizer and template, scripted replies) on loopback."""
    script = Script()
    engine = FakeEngine(script, tokenizer_path=model_dir)
    cfg = GatewayConfig(model=model_dir, engine="fake", admin_key=ADMIN, max_staleness=None,
                        model_label="relayrl-test")
    thread = GatewayThread(build_deps(cfg, engine=engine)).start()
    yield FakeGateway(thread.url, thread, script)
    thread.stop()


def start_rollout_server(**config: Any) -> tuple[AppThread, AppState]:
    """A rollout server on loopback; tool delays off unless asked for."""
    config = {"tool_delay_min_s": 0.0, "tool_delay_max_s": 0.0, **config}
    state = AppState.create(ServerConfig(port=0, **config))
    return AppThread(create_app(state)).start(), state


@pytest.fixture
def rollout_server() -> Iterator[tuple[AppThread, AppState]]:
    """The reference rollout server (calculator, default tokenizer) with no tool delays."""
    thread, state = start_rollout_server()
    yield thread, state
    thread.stop()


def tool_call_text(name: str, **args: Any) -> str:
    """A Hermes tool call written exactly as the default model's template renders one."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def different_template_dir(model_dir: str, tmp: Path) -> Path:
    """The default model's tokenizer with a chat template that wraps tool results differently."""
    out = tmp / "other-template"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model_dir) / name, out / name)
    template = (Path(model_dir) / "chat_template.jinja").read_text()
    changed = template.replace("<tool_response>", "<tool_result>\\nresult:")
    assert changed != template
    (out / "chat_template.jinja").write_text(changed)
    return out
