"""The router's inbound HTTP/1.1 server (`relayrl.router.http`), spoken to over raw loopback
sockets: keep-alive, pipelining, framing both ways, 100-continue, errors, a client leaving, and
stopping."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from relayrl.router.http import RouterHttpServer

Message = dict[str, Any]


class App:
    """Echoes the request (method, path, query, body) and streams on `/stream`; records what it
    received after the body."""

    def __init__(self) -> None:
        self.after_body: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        body = b""
        while True:  # until the whole body is in
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/boom":
            raise RuntimeError("boom")
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for i in range(3):
                await send({"type": "http.response.body", "body": b"data: %d\n\n" % i,
                            "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        if scope["path"] == "/wait-for-leave":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"started", "more_body": True})
            self.after_body.append((await receive())["type"])
            return
        if scope["path"] == "/scheme":
            body = scope["scheme"].encode()
        echo = b"%s %s ?%s %s" % (scope["method"].encode(), scope["path"].encode(),
                                  scope["query_string"], body)
        await send({"type": "http.response.start", "status": 201,
                    "headers": [(b"x-echo", b"1")]})
        await send({"type": "http.response.body", "body": echo})


@asynccontextmanager
async def serving(app: App, **timeouts: float) -> AsyncIterator[RouterHttpServer]:
    server = RouterHttpServer(app, "127.0.0.1", 0, keep_alive_s=5, graceful_s=1, **timeouts)
    server.install_signal_handlers = lambda: None
    task = asyncio.create_task(server.serve())
    for _ in range(200):  # bounded wait for the socket
        if server.started:
            break
        await asyncio.sleep(0.01)
    try:
        yield server
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def _connect(server: RouterHttpServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    port = server.servers[0].sockets[0].getsockname()[1]
    return await asyncio.open_connection("127.0.0.1", port)


async def _answer(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """One answer: status line, headers (lowercased), body (content-length or chunked)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    status, *lines = head[:-4].split(b"\r\n")
    headers = {k.lower(): v for k, v in (line.split(b": ", 1) for line in lines)}
    if b"content-length" in headers:
        return status, headers, await reader.readexactly(int(headers[b"content-length"]))
    body = b""
    while True:  # chunked, ends with the zero chunk
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return status, headers, body
        body += data[:-2]


async def test_keep_alive_and_pipelined_requests_are_answered_in_order() -> None:
    async with serving(App()) as server:
        reader, writer = await _connect(server)
        writer.write(b"POST /a%20b?x=1 HTTP/1.1\r\nhost: r\r\ncontent-length: 3\r\n\r\nabc")
        status, headers, body = await _answer(reader)
        assert status == b"HTTP/1.1 201 Created" and body == b"POST /a b ?x=1 abc"
        assert headers[b"x-echo"] == b"1" and headers[b"content-length"] == b"18"
        assert b"date" in headers
        writer.write(b"GET /one HTTP/1.1\r\nhost: r\r\n\r\n"
                     b"POST /two HTTP/1.1\r\nhost: r\r\ntransfer-encoding: chunked\r\n\r\n"
                     b"2\r\nhi\r\n3\r\nyou\r\n0\r\n\r\n")
        assert (await _answer(reader))[2] == b"GET /one ? "
        assert (await _answer(reader))[2] == b"POST /two ? hiyou"
        writer.close()


async def test_a_stream_is_chunked_and_the_connection_carries_on() -> None:
    async with serving(App()) as server:
        reader, writer = await _connect(server)
        for _ in range(2):
            writer.write(b"GET /stream HTTP/1.1\r\nhost: r\r\n\r\n")
            _, headers, body = await _answer(reader)
            assert headers[b"transfer-encoding"] == b"chunked"
            assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        writer.close()


async def test_expect_100_continue_and_head() -> None:
    async with serving(App()) as server:
        reader, writer = await _connect(server)
        writer.write(b"POST /e HTTP/1.1\r\nhost: r\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n")
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"ok")
        assert (await _answer(reader))[2] == b"POST /e ? ok"
        writer.write(b"HEAD /h HTTP/1.1\r\nhost: r\r\n\r\nGET /after HTTP/1.1\r\nhost: r\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert b"content-length: 10" in head  # the length of the answer, whose bytes are not sent
        assert (await _answer(reader))[2] == b"GET /after ? "
        writer.close()


async def test_errors_close_the_connection() -> None:
    async with serving(App()) as server:
        reader, writer = await _connect(server)
        writer.write(b"GET /boom HTTP/1.1\r\nhost: r\r\n\r\n")
        status, headers, _ = await _answer(reader)
        assert status.startswith(b"HTTP/1.1 500") and headers[b"connection"] == b"close"
        assert await asyncio.wait_for(reader.read(), 5) == b""
        reader, writer = await _connect(server)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        status, _, _ = await _answer(reader)
        assert status.startswith(b"HTTP/1.1 400")
        assert await asyncio.wait_for(reader.read(), 5) == b""
        reader, writer = await _connect(server)
        writer.write(b"GET /x HTTP/1.1\r\nhost: r\r\nconnection: close\r\n\r\n")
        assert (await _answer(reader))[1][b"connection"] == b"close"
        assert await asyncio.wait_for(reader.read(), 5) == b""


async def test_a_client_leaving_is_a_disconnect_for_the_app() -> None:
    app = App()
    async with serving(app) as server:
        reader, writer = await _connect(server)
        writer.write(b"GET /wait-for-leave HTTP/1.1\r\nhost: r\r\n\r\n")
        await asyncio.wait_for(reader.readuntil(b"started"), 5)
        writer.close()
        for _ in range(200):  # bounded
            if app.after_body:
                break
            await asyncio.sleep(0.01)
        assert app.after_body == ["http.disconnect"]


async def test_stopping_closes_idle_connections() -> None:
    async with serving(App()) as server:
        reader, writer = await _connect(server)
        writer.write(b"GET /x HTTP/1.1\r\nhost: r\r\n\r\n")
        await _answer(reader)
        server.should_exit = True
        assert await asyncio.wait_for(reader.read(), 5) == b""


async def test_a_local_tls_proxy_sets_the_scheme() -> None:
    async with serving(App()) as server:
        reader, writer = await _connect(server)
        writer.write(b"GET /scheme HTTP/1.1\r\nhost: r\r\nx-forwarded-proto: https\r\n\r\n"
                     b"GET /scheme HTTP/1.1\r\nhost: r\r\n\r\n"
                     b"GET /scheme HTTP/1.1\r\nhost: r\r\nx-forwarded-proto: gopher\r\n\r\n")
        assert [(await _answer(reader))[2] for _ in range(3)] == [
            b"GET /scheme ? https", b"GET /scheme ? http", b"GET /scheme ? http"]
        writer.close()


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """True when the server closes the connection (EOF) within `seconds`."""
    try:
        return await asyncio.wait_for(reader.read(), seconds) == b""
    except TimeoutError:
        return False
    except ConnectionError:  # we wrote after the close: the peer answered with a reset
        return True


async def test_a_head_sent_a_byte_at_a_time_is_cut_off_at_the_header_timeout() -> None:
    async with serving(App(), header_timeout_s=0.5, body_timeout_s=5) as server:
        reader, writer = await _connect(server)
        head = b"GET /slow HTTP/1.1\r\nhost: r\r\n"
        started = asyncio.get_running_loop().time()
        for byte in head[:8]:  # bounded: 8 bytes, 50 ms apart, none of them resetting the clock
            writer.write(bytes([byte]))
            await asyncio.sleep(0.05)
        assert await _closed_within(reader, 2.0)
        assert asyncio.get_running_loop().time() - started < 1.5
        writer.close()


async def test_a_body_that_stalls_is_cut_off_and_a_slow_one_is_answered() -> None:
    async with serving(App(), header_timeout_s=5, body_timeout_s=0.5) as server:
        reader, writer = await _connect(server)
        writer.write(b"POST /stall HTTP/1.1\r\nhost: r\r\ncontent-length: 10\r\n\r\nabc")
        assert await _closed_within(reader, 2.0)
        writer.close()
        # every piece restarts the body deadline: 10 pieces 0.2 s apart take 2 s, and pass
        reader, writer = await _connect(server)
        writer.write(b"POST /slow HTTP/1.1\r\nhost: r\r\ncontent-length: 10\r\n\r\n")
        for byte in b"0123456789":
            await asyncio.sleep(0.2)
            writer.write(bytes([byte]))
        status, _, body = await _answer(reader)
        assert status == b"HTTP/1.1 201 Created" and body.endswith(b"0123456789")
        writer.close()

