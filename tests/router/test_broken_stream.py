"""A stream whose gateway dies mid-way ends with an error frame in its own format, not silently
(the router's relay, driven in-process, against a loopback server that resets the connection
after the first frame and a half)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from relayrl.router.app import Router
from relayrl.router.config import RouterConfig

FIRST = b'data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"content":"he"}}]}\n\n'


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _breaking_gateway(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer one request with an SSE stream, then drop the connection mid-frame."""
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                 b"transfer-encoding: chunked\r\n\r\n" + _chunk(FIRST))
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.write(_chunk(b'data: {"partial'))
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.transport.abort()


@pytest.mark.parametrize(("path", "check"), [
    ("/v1/chat/completions", lambda frame: json.loads(frame.removeprefix("data: "))["error"]),
    ("/v1/messages", lambda frame: frame.startswith("event: error\n")
     and json.loads(frame.split("data: ", 1)[1])["type"] == "error"),
    ("/v1/responses", lambda frame: frame.startswith("event: error\n")
     and json.loads(frame.split("data: ", 1)[1])["code"]),
])
async def test_a_broken_stream_ends_with_an_error_frame(path: str, check) -> None:
    server = await asyncio.start_server(_breaking_gateway, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    router = Router(RouterConfig(backends=[f"http://127.0.0.1:{port}"]))
    router.backends[0].healthy = True
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router.app()),
                                     base_url="http://router") as client:
            r = await asyncio.wait_for(client.post(path, json={"stream": True}), 10)
    finally:
        await router.aclose()
        server.close()
        await server.wait_closed()
    assert r.status_code == 200 and r.content.startswith(FIRST)
    frames = r.content.decode().split("\n\n")
    last = [f for f in frames if f.strip()][-1]
    assert check(last) and "mid-stream" in last
    assert '{"partial' in r.content.decode()  # what did arrive was relayed before the error


async def test_an_unexpected_router_error_is_a_500_in_the_routes_format(monkeypatch) -> None:
    router = Router(RouterConfig(backends=["http://127.0.0.1:9"]))

    async def broken(request):
        raise RuntimeError("bug")

    monkeypatch.setattr(router, "dispatch", broken)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router.app()),
                                 base_url="http://router") as client:
        chat = await client.post("/v1/chat/completions", json={})
        messages = await client.post("/v1/messages", json={})
    assert chat.status_code == 500 and chat.json()["error"]["message"]
    assert messages.status_code == 500 and messages.json()["type"] == "error"
    assert "bug" not in chat.text  # no internals leak
