"""A session key in a `/s/{key}/v1` base URL never reaches the log through httpx's request log."""

from __future__ import annotations

import logging

import httpx
import pytest

import relayrl.client  # noqa: F401  (importing the client installs the filter)


def test_httpx_request_log_lines_carry_no_session_key(caplog: pytest.LogCaptureFixture) -> None:
    key = "sk-relayrl-0123456789abcdef"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json={"data": []}))
    with caplog.at_level(logging.INFO, logger="httpx"), httpx.Client(transport=transport) as c:
        c.get(f"http://127.0.0.1:8000/s/{key}/v1/models")
        c.get("http://127.0.0.1:8000/v1/models")
    lines = [r.getMessage() for r in caplog.records if r.name == "httpx"]
    assert len(lines) == 2 and key not in caplog.text
    assert "/s/***/v1/models" in lines[0] and "200 OK" in lines[0]
    assert "http://127.0.0.1:8000/v1/models" in lines[1]  # other URLs are left as they are


def test_the_filter_is_installed_once() -> None:
    from relayrl.client import redact

    redact.install()
    redact.install()
    filters = logging.getLogger("httpx").filters
    assert sum(isinstance(f, redact.RedactSessionKeys) for f in filters) == 1
