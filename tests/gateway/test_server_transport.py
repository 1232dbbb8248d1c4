"""The gateway's coalescing transport: a reply's head and body leave in one write."""

from __future__ import annotations

import asyncio

import httpx

from relayrl.asgi import _CoalescingTransport
from tests.gateway.conftest import fake_gateway


class RecordingTransport(asyncio.Transport):
    """A transport that records what reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.events: list[str] = []
        self.closing = False

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.events.append("close")
        self.closing = True

    def abort(self) -> None:
        self.events.append("abort")
        self.closing = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 1) if name == "peername" else default


async def test_writes_of_one_loop_turn_leave_as_one_write_in_order() -> None:
    real = RecordingTransport()
    t = _CoalescingTransport(real, asyncio.get_running_loop())
    t.write(b"HTTP/1.1 200 OK\r\n\r\n")
    t.write(b"")
    t.writelines([b"{", b"}"])
    assert real.writes == [] and t.get_write_buffer_size() == 21
    await asyncio.sleep(0)
    assert real.writes == [b"HTTP/1.1 200 OK\r\n\r\n{}"]
    t.write(b"next")
    await asyncio.sleep(0)
    assert real.writes[-1] == b"next" and len(real.writes) == 2
    assert t.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest goes to the transport


async def test_close_sends_what_is_queued_first_and_abort_drops_it() -> None:
    loop = asyncio.get_running_loop()
    real = RecordingTransport()
    t = _CoalescingTransport(real, loop)
    t.write(b"last words")
    t.close()
    assert real.writes == [b"last words"] and real.events == ["close"]
    await asyncio.sleep(0)  # the scheduled flush finds nothing more to send
    assert real.writes == [b"last words"]

    real = RecordingTransport()
    t = _CoalescingTransport(real, loop)
    t.write(b"never sent")
    t.abort()
    await asyncio.sleep(0)
    assert real.writes == [] and real.events == ["abort"]


async def test_nothing_is_written_to_a_transport_that_is_closing() -> None:
    real = RecordingTransport()
    t = _CoalescingTransport(real, asyncio.get_running_loop())
    t.write(b"to a client that left")
    real.closing = True
    await asyncio.sleep(0)
    assert real.writes == []


def test_the_gateways_connections_write_through_it(model_dir: str, monkeypatch) -> None:
    made: list[_CoalescingTransport] = []
    init = _CoalescingTransport.__init__

    def counting(self: _CoalescingTransport, *args: object) -> None:
        init(self, *args)  # type: ignore[arg-type]
        made.append(self)

    monkeypatch.setattr(_CoalescingTransport, "__init__", counting)
    gw = fake_gateway(model_dir)
    try:
        key = gw.start_session()["api_key"]
        r = httpx.post(f"{gw.url}/v1/chat/completions", timeout=30,
                       headers={"authorization": f"Bearer {key}"},
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
        assert len(made) == 2  # the connection of start_session and this one, each wrapped
    finally:
        gw.thread.stop()
