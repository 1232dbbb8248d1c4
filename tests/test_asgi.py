"""relayrl.asgi: servers take uvloop and httptools when installed, and fall back cleanly."""

from __future__ import annotations

import asyncio
import importlib.util

import httpx
import pytest

from relayrl import asgi
from relayrl.engine.fake import FakeEngine
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps

INSTALLED = all(importlib.util.find_spec(m) for m in ("uvloop", "httptools"))


@pytest.mark.skipif(not INSTALLED, reason="uvloop and httptools are core dependencies")
def test_the_fast_loop_and_parser_are_used_when_installed() -> None:
    assert asgi.uvicorn_options() == {"loop": "uvloop", "http": "httptools"}
    loop = asgi.new_event_loop()
    try:
        assert type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()


def test_fallbacks_when_missing(monkeypatch) -> None:
    monkeypatch.setattr(asgi, "_installed", lambda module: False)
    assert asgi.uvicorn_options() == {"loop": "asyncio", "http": "h11"}
    assert asgi.run(asyncio.sleep(0, "done")) == "done"


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_a_gateway_thread_serves_on_either_parser(model_dir: str, monkeypatch, http: str) -> None:
    if http == "httptools" and not INSTALLED:
        pytest.skip("httptools not installed")
    if http == "h11":  # what a machine without httptools serves on
        monkeypatch.setattr(asgi, "_installed", lambda module: module != "httptools")
    engine = FakeEngine(["hello there"], tokenizer_path=model_dir)
    cfg = GatewayConfig(model=model_dir, engine="fake", model_label="relayrl-test")
    with GatewayThread(build_deps(cfg, engine=engine)) as gw:
        parser = {"h11": "H11Protocol", "httptools": "HttpToolsProtocol"}[http]
        assert parser in [base.__name__ for base in gw.server.config.http.__mro__]
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            r = c.post("/v1/chat/completions", json={
                "model": "relayrl-test", "messages": [{"role": "user", "content": "hi"}],
                "stream": True})
            assert r.status_code == 200 and "hello" in r.text and r.text.endswith("\n\n")
            assert c.get("/v1/models").status_code == 200  # the same keep-alive connection
