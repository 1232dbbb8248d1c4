"""The router's outbound client (`relayrl.router.upstream`) against scripted loopback servers:
keep-alive reuse, answers framed every way HTTP/1.1 allows, and each way a gateway can fail."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from relayrl.router.upstream import Pool, UpstreamError, UpstreamUnreachable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[tuple[Pool, list[int]]]:
    """A loopback server running `handler` per connection; a pool to it; connections opened."""
    opened: list[int] = []

    async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        opened.append(1)
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(counted, "127.0.0.1", 0)
    pool = Pool("127.0.0.1", server.sockets[0].getsockname()[1], connect_timeout_s=5,
                read_timeout_s=5)
    try:
        yield pool, opened
    finally:
        pool.close()
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


async def test_sequential_calls_share_one_connection_whatever_the_framing() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = 0
        async for request in _requests(reader):
            seen.append(request)
            n += 1
            if n % 2:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello")
            else:  # chunked, split across writes
                writer.write(b"HTTP/1.1 201 Created\r\nX-Kept-Case: Yes\r\n"
                             b"transfer-encoding: chunked\r\n\r\n" + _chunk(b"wor"))
                await writer.drain()
                await asyncio.sleep(0.01)
                writer.write(_chunk(b"ld") + b"0\r\n\r\n")
            await writer.drain()

    async with serving(handler) as (pool, opened):
        answers = [await pool.fetch("POST", b"/v1/x?a=1", [(b"authorization", b"Bearer k")],
                                    b'{"n": %d}' % i) for i in range(6)]
    assert len(opened) == 1
    assert [a[2] for a in answers] == [b"hello", b"world"] * 3
    assert [a[0] for a in answers] == [200, 201] * 3
    assert (b"X-Kept-Case", b"Yes") in answers[1][1]  # raw headers, case as sent
    first = seen[0]
    assert first.startswith(b"POST /v1/x?a=1 HTTP/1.1\r\nhost: 127.0.0.1:")
    assert b"authorization: Bearer k\r\n" in first and b"content-length: 8\r\n" in first
    assert first.endswith(b'\r\n\r\n{"n": 0}')


async def test_a_connection_the_gateway_closes_is_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in _requests(reader):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            return  # closes after one answer, without saying so

    async with serving(handler) as (pool, opened):
        for _ in range(3):
            assert (await pool.fetch("GET", b"/", [], b""))[2] == b"ok"
            await asyncio.sleep(0.05)  # the close arrives while the connection is idle
    assert len(opened) == 3


async def test_connection_close_and_an_answer_ending_at_eof() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in _requests(reader):
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil ")
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(b"the end")
            await writer.drain()
            return

    async with serving(handler) as (pool, opened):
        assert (await pool.fetch("GET", b"/", [], b""))[2] == b"until the end"
        assert (await pool.fetch("GET", b"/", [], b""))[2] == b"until the end"
    assert len(opened) == 2


async def test_streamed_bytes_arrive_as_sent_and_a_break_is_an_error() -> None:
    frames = [b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in _requests(reader):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            for frame in frames:
                writer.write(_chunk(frame))
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(_chunk(b"data: par"))
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.transport.abort()
            return

    async with serving(handler) as (pool, _):
        conn = await pool.request("GET", b"/", [], b"")
        got = b""
        with pytest.raises(UpstreamError):
            while (chunk := await conn.next_chunk()) is not None:  # bounded by the break
                got += chunk
        assert got == b"".join(frames) + b"data: par"
        assert not pool.idle


async def test_no_byte_within_the_read_timeout_is_an_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in _requests(reader):
            await asyncio.sleep(5)

    async with serving(handler) as (pool, _):
        pool.read_timeout_s = 0.1
        with pytest.raises(UpstreamError, match="read timeout"):
            await asyncio.wait_for(pool.fetch("GET", b"/", [], b""), 3)


async def test_a_refused_connection_is_unreachable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        pool = Pool("127.0.0.1", port, connect_timeout_s=2, read_timeout_s=2)
        with pytest.raises(UpstreamUnreachable):
            await pool.fetch("GET", b"/", [], b"")


async def test_an_interim_100_continue_is_skipped() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in _requests(reader):
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n"
                         b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\ndone")
            await writer.drain()

    async with serving(handler) as (pool, opened):
        for _ in range(2):
            status, headers, body = await pool.fetch("POST", b"/", [], b"x")
            assert (status, body) == (200, b"done") and headers == [(b"content-length", b"4")]
    assert len(opened) == 1


async def test_an_answer_larger_than_the_stream_buffer_is_read_whole() -> None:
    big = b"x" * (9 << 20)  # past the unread bytes at which a stream pauses reading

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in _requests(reader):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(big) + big)
            await writer.drain()

    async with serving(handler) as (pool, _):
        assert (await asyncio.wait_for(pool.fetch("GET", b"/", [], b""), 10))[2] == big
        conn = await pool.request("GET", b"/", [], b"")
        got = b""
        while (chunk := await asyncio.wait_for(conn.next_chunk(), 10)) is not None:  # bounded
            got += chunk
            await asyncio.sleep(0.001)  # a reader slower than the socket
        assert got == big
