"""Clients of the gateway: `SessionClient` over HTTP, `DirectClient` in-process."""

from relayrl.client.direct import DirectClient
from relayrl.client.session_client import SessionClient, SessionHandle

__all__ = ["DirectClient", "SessionClient", "SessionHandle"]
