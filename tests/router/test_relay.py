"""How the router relays, against scripted loopback gateways (answers framed every way HTTP/1.1
allows, and each way a gateway can fail), and what its uvicorn server does for clients
(keep-alive, pipelining, chunked bodies, 100-continue, timeouts, a local TLS proxy's scheme)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from relayrl.asgi import ServerThread, server_config
from relayrl.engine.fake import FakeEngine
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.router import Router, RouterConfig, RouterThread
from tests.router.conftest import ADMIN, Backend

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
HI = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


@asynccontextmanager
async def routed(handler: Handler, **config: float) -> AsyncIterator[tuple[httpx.AsyncClient,
                                                                          Router, list[int]]]:
    """A scripted gateway running `handler` per connection, a router in front of it (driven
    in-process), a client of the router, and a count of the connections the gateway saw."""
    opened: list[int] = []

    async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        opened.append(1)
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(counted, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    router = Router(RouterConfig(backends=[f"http://127.0.0.1:{port}"], **config))
    router.backends[0].healthy = True  # no health checks: the script answers calls only
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router.app()),
                                     base_url="http://router", timeout=30) as client:
            yield client, router, opened
    finally:
        await router.aclose()
        server.close()
        await server.wait_closed()


async def _requests(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """Each request's head and body (content-length bodies only) until the client closes."""
    while True:  # ends when the client closes
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        yield head + await reader.readexactly(length)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def test_calls_share_one_connection_and_go_out_as_the_client_sent_them() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for request in _requests(reader):
            seen.append(request)
            if len(seen) % 2:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello")
            else:  # chunked, split across writes
                writer.write(b"HTTP/1.1 201 Created\r\nX-Kept-Case: Yes\r\n"
                             b"transfer-encoding: chunked\r\n\r\n" + _chunk(b"wor"))
                await writer.drain()
                await asyncio.sleep(0.01)
                writer.write(_chunk(b"ld") + b"0\r\n\r\n")
            await writer.drain()

    async with routed(handler) as (client, _, opened):
        answers = [await client.post("/v1/x%20y?a=1", content=b'{"n": %d}' % i,
                                     headers={"authorization": "Bearer k"}) for i in range(6)]
    assert len(opened) == 1
    assert [a.content for a in answers] == [b"hello", b"world"] * 3
    assert [a.status_code for a in answers] == [200, 201] * 3
    assert (b"X-Kept-Case", b"Yes") in answers[1].headers.raw  # raw headers, case as sent
    first = seen[0]
    assert first.startswith(b"POST /v1/x%20y?a=1 HTTP/1.1\r\n")  # the target, not re-encoded
    assert b"authorization: Bearer k\r\n" in first  # the client's headers, as sent
    assert b"\r\nhost: 127.0.0.1:" in first.lower() and b"content-length: 8\r\n" in first.lower()
    assert first.endswith(b'\r\n\r\n{"n": 0}')


async def test_a_connection_the_gateway_closes_is_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in _requests(reader):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            return  # closes after one answer, without saying so

    async with routed(handler) as (client, _, opened):
        for _ in range(3):
            assert (await client.post("/v1/chat/completions", content=HI)).content == b"ok"
            await asyncio.sleep(0.05)  # the close arrives while the connection is idle
    assert len(opened) == 3


async def test_an_answer_ending_at_eof_and_an_interim_100_continue() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for request in _requests(reader):
            if b"/eof" in request:
                writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil ")
                await writer.drain()
                await asyncio.sleep(0.01)
                writer.write(b"the end")
                await writer.drain()
                return
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n"
                         b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\ndone")
            await writer.drain()

    async with routed(handler) as (client, _, _):
        assert (await client.post("/eof", content=HI)).content == b"until the end"
        r = await client.post("/v1/chat/completions", content=HI)
        assert (r.status_code, r.content) == (200, b"done")


async def test_an_answer_larger_than_a_socket_read_is_relayed_whole() -> None:
    big = b"x" * (9 << 20)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in _requests(reader):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(big) + big)
            await writer.drain()

    async with routed(handler) as (client, _, _):
        r = await asyncio.wait_for(client.post("/v1/chat/completions", content=HI), 20)
    assert r.content == big


async def test_no_byte_within_the_read_timeout_is_a_503_in_the_routes_format() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in _requests(reader):
            await asyncio.sleep(5)

    async with routed(handler, read_timeout_s=0.2) as (client, router, _):
        chat = await asyncio.wait_for(client.post("/v1/chat/completions", content=HI), 5)
        messages = await asyncio.wait_for(client.post("/v1/messages", content=HI), 5)
        assert router.backends[0].healthy  # slow is not down
    assert chat.status_code == 503 and "failed" in chat.json()["error"]["message"]
    assert messages.status_code == 503 and messages.json()["type"] == "error"


async def test_a_refused_connection_is_a_503_and_takes_the_backend_down() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        router = Router(RouterConfig(backends=[f"http://127.0.0.1:{s.getsockname()[1]}"]))
        router.backends[0].healthy = True
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router.app()),
                                         base_url="http://router") as client:
                r = await client.post("/v1/chat/completions", content=HI)
        finally:
            await router.aclose()
    assert r.status_code == 503 and "unreachable" in r.json()["error"]["message"]
    assert not router.backends[0].healthy


def test_a_stream_reaches_the_client_as_the_gateway_sends_it(model_dir: str) -> None:
    reply = " ".join(f"w{i}" for i in range(150))  # several hundred tokens, 5 ms apart
    engine = FakeEngine([reply], tokenizer_path=model_dir, token_delay_s=0.005)
    cfg = GatewayConfig(model=model_dir, engine="fake", admin_key=ADMIN, model_label="m")
    with GatewayThread(build_deps(cfg, engine=engine)) as gateway, \
            RouterThread(RouterConfig(backends=[gateway.url])) as router:
        s = httpx.post(router.url + "/rl/v1/start_session", json={},
                       headers={"authorization": f"Bearer {ADMIN}"}).json()
        arrivals: list[float] = []
        t0 = time.monotonic()
        with httpx.stream("POST", s["base_url"] + "/chat/completions", timeout=30, json={
                "model": "m", "stream": True,
                "messages": [{"role": "user", "content": "go"}]}) as r:
            for _ in r.iter_raw():
                arrivals.append(time.monotonic() - t0)
    assert r.status_code == 200 and len(arrivals) > 10
    # not buffered: the first frames arrive long before the last
    assert arrivals[0] < arrivals[-1] / 2


def _raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _read_answer(sock: socket.socket, buffered: bytearray) -> tuple[bytes, bytes]:
    """One answer's head and body (content-length bodies), from `sock` and what was read."""
    while b"\r\n\r\n" not in buffered:  # bounded by the socket's timeout
        buffered += sock.recv(65536) or b"!"
        assert not buffered.endswith(b"!"), "connection closed"
    head, _, rest = bytes(buffered).partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    buffered[:] = rest
    while len(buffered) < length:
        buffered += sock.recv(65536)
    body = bytes(buffered[:length])
    del buffered[:length]
    return head, body


def test_keep_alive_pipelining_a_chunked_body_and_100_continue(
        backends: list[Backend], router: RouterThread) -> None:
    with _raw(router.url) as sock:
        buffered = bytearray()
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: r\r\n\r\n" * 2)
        for _ in range(2):
            head, body = _read_answer(sock, buffered)
            assert head.startswith(b"HTTP/1.1 200") and b'"backends_healthy":2' in body
        sock.sendall(b"POST /rl/start_session HTTP/1.1\r\nhost: r\r\n"
                     b"authorization: Bearer " + ADMIN.encode() + b"\r\n"
                     b"content-type: application/json\r\nexpect: 100-continue\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        while b"\r\n\r\n" not in buffered:  # bounded by the socket's timeout
            buffered += sock.recv(65536)
        assert bytes(buffered).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        del buffered[:len(b"HTTP/1.1 100 Continue\r\n\r\n")]
        sock.sendall(_chunk(b'{"task_id": ') + _chunk(b'"t"}') + b"0\r\n\r\n")
        head, body = _read_answer(sock, buffered)
        assert head.startswith(b"HTTP/1.1 200") and b'"session_id"' in body


def test_a_local_tls_proxy_sets_the_scheme_of_the_urls_handed_out(
        backends: list[Backend], router: RouterThread) -> None:
    auth = {"authorization": f"Bearer {ADMIN}"}
    behind = httpx.post(router.url + "/rl/v1/start_session", json={},
                        headers={**auth, "x-forwarded-proto": "https"}).json()
    plain = httpx.post(router.url + "/rl/v1/start_session", json={}, headers=auth).json()
    odd = httpx.post(router.url + "/rl/v1/start_session", json={},
                     headers={**auth, "x-forwarded-proto": "gopher"}).json()
    assert behind["base_url"].startswith("https://")
    assert plain["base_url"].startswith("http://") and odd["base_url"].startswith("http://")


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(65536) == b""
    except TimeoutError:
        return False
    except ConnectionError:  # we wrote after the close: the peer answered with a reset
        return True


@pytest.mark.parametrize("stall", ["head", "body"])
def test_a_client_that_stalls_is_cut_off(stall: str) -> None:
    # the router's server is the gateway's (relayrl.asgi): its timeouts, shortened here
    router = Router(RouterConfig(backends=["http://127.0.0.1:9"], health_interval_s=30))
    assert RouterThread(RouterConfig(backends=["http://127.0.0.1:9"])).server.config.http \
        .__name__.startswith("Timed")
    config = server_config(router.app(), "127.0.0.1", 0, header_timeout_s=0.5,
                           body_timeout_s=0.5)
    with ServerThread(config) as server, _raw(server.url) as sock:
        started = time.monotonic()
        cut = False
        if stall == "head":
            for byte in b"GET /slow HTTP/1.1\r\n":  # a byte at a time: none resets the clock
                try:
                    sock.sendall(bytes([byte]))
                except ConnectionError:  # closed already
                    cut = True
                    break
                time.sleep(0.05)
        else:
            sock.sendall(b"POST /v1/x HTTP/1.1\r\nhost: r\r\ncontent-length: 10\r\n\r\nabc")
        assert cut or _closed_within(sock, 3.0)
        assert time.monotonic() - started < 3.0
