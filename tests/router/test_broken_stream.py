"""A stream whose gateway dies mid-way ends with an error frame in its own format, not silently
(the router's relay, driven in-process over a transport that breaks after the first frame)."""

from __future__ import annotations

import json

import httpx
import pytest

from relayrl.router.app import Router
from relayrl.router.config import RouterConfig

FIRST = b'data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"content":"he"}}]}\n\n'


class _Breaks(httpx.AsyncByteStream):
    async def __aiter__(self):
        yield FIRST
        yield b"data: {\"partial"
        raise httpx.ReadError("connection reset")


@pytest.mark.parametrize(("path", "check"), [
    ("/v1/chat/completions", lambda frame: json.loads(frame.removeprefix("data: "))["error"]),
    ("/v1/messages", lambda frame: frame.startswith("event: error\n")
     and json.loads(frame.split("data: ", 1)[1])["type"] == "error"),
    ("/v1/responses", lambda frame: frame.startswith("event: error\n")
     and json.loads(frame.split("data: ", 1)[1])["code"]),
])
async def test_a_broken_stream_ends_with_an_error_frame(path: str, check) -> None:
    router = Router(RouterConfig(backends=["http://127.0.0.1:9"]))
    router.backends[0].healthy = True
    router.transport = httpx.MockTransport(lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, stream=_Breaks()))
    router._timeout = httpx.Timeout(5.0).as_dict()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router.app()),
                                 base_url="http://router") as client:
        r = await client.post(path, json={"stream": True})
    assert r.status_code == 200 and r.content.startswith(FIRST)
    frames = r.content.decode().split("\n\n")
    last = [f for f in frames if f.strip()][-1]
    assert check(last) and "mid-stream" in last
