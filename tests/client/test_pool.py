"""The shared rollout client, and a session client's own, drop idle connections before the
gateway would close them."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from relayrl.client.pool import KEEPALIVE_EXPIRY_S, pooled_client
from relayrl.client.session_client import SessionClient
from relayrl.gateway.config import GatewayConfig


async def _keep_alive_server() -> tuple[asyncio.Server, list[int]]:
    """A loopback HTTP/1.1 server that never closes a connection and counts the ones it gets."""
    connections: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            for _ in range(100):  # bounded: a test makes a handful of requests
                head = await reader.readuntil(b"\r\n\r\n")
                if not head:
                    break
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, connections


def test_the_expiry_is_under_the_gateways_keep_alive() -> None:
    # Equal values are the race: a request sent on a connection the server is closing fails.
    assert GatewayConfig().keep_alive_timeout_s > KEEPALIVE_EXPIRY_S


def _session_clients_own(url: str) -> httpx.AsyncClient:
    # the client that drives sessions (start, end, export, abort): an abort after an episode's
    # 5 s timeout once raced the gateway's close of the idle connection and left the session open
    return SessionClient(url).http


@pytest.mark.parametrize("make", [lambda url: pooled_client(5.0), _session_clients_own],
                         ids=["pooled_client", "SessionClient"])
async def test_an_idle_pooled_connection_is_not_reused_after_the_expiry(make) -> None:
    server, connections = await _keep_alive_server()
    port = server.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}/"
    client = make(url)
    try:
        for _ in range(3):
            assert (await client.get(url)).text == "ok"
        assert len(connections) == 1  # back to back: one pooled connection
        await asyncio.sleep(KEEPALIVE_EXPIRY_S + 0.3)
        assert (await client.get(url)).text == "ok"
        assert len(connections) == 2  # after the expiry: a fresh one
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()
