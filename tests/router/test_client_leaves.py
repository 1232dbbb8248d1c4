"""A client that hangs up mid-stream on the router: the router closes its upstream stream, so the
gateway stops sampling and notes the call as aborted, as when the client hangs up on it directly."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import openai

from relayrl.engine.fake import FakeEngine
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.router import Router, RouterConfig, RouterThread
from tests.router.conftest import ADMIN

LONG_REPLY = " ".join(f"word{i}" for i in range(400))
"""About 1,200 tokens: at 5 ms a token the reply is far from done when the client leaves."""


def _wait(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # bounded
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_hanging_up_on_the_router_aborts_the_call_on_the_gateway(model_dir: str) -> None:
    engine = FakeEngine(lambda _r: LONG_REPLY, tokenizer_path=model_dir, token_delay_s=0.005)
    cfg = GatewayConfig(model=model_dir, engine="fake", admin_key=ADMIN, model_label="m")
    gateway = GatewayThread(build_deps(cfg, engine=engine)).start()
    router = RouterThread(RouterConfig(backends=[gateway.url])).start()
    try:
        r = httpx.post(router.url + "/rl/v1/start_session", json={},
                       headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200, r.text
        s = r.json()
        client = openai.OpenAI(base_url=router.url + "/v1", api_key=s["api_key"], max_retries=0)
        stream = client.chat.completions.create(
            model="m", stream=True, max_tokens=2000,
            messages=[{"role": "user", "content": "count"}])
        for read, _ in enumerate(stream, 1):  # bounded by the break
            if read == 5:
                break
        stream.close()
        session = gateway.deps.store.get(s["session_id"], touch=False)
        _wait(lambda: len(session.aborted_calls) == 1)
        assert session.interactions == ()  # never a finished call with a cut reply
        cut = session.aborted_calls[0]
        assert cut.output_tokens is not None and 0 < cut.output_tokens < 1000
    finally:
        router.stop()
        gateway.stop()


async def test_a_client_leaving_mid_body_sends_nothing_to_the_gateway() -> None:
    requests: list[bytes] = []

    async def gateway(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(await reader.read(65536))  # b"" when the router only health-checks
        writer.close()

    server = await asyncio.start_server(gateway, "127.0.0.1", 0)
    router = Router(RouterConfig(backends=[f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"]))
    router.backends[0].healthy = True
    messages = [{"type": "http.request", "body": b'{"model": "m", ', "more_body": True},
                {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "raw_path": b"/v1/chat/completions", "query_string": b"", "headers": [
                 (b"content-length", b"40"), (b"authorization", b"Bearer k")]}
    try:
        await asyncio.wait_for(router.app()(scope, receive, send), 5)
        await asyncio.sleep(0.1)
    finally:
        await router.aclose()
        server.close()
        await server.wait_closed()
    assert requests == [] and sent == []
