"""Keeps session keys out of httpx's request log.

A session's OpenAI-style base URL carries its key (`{root}/s/{key}/v1`), and httpx logs every
request URL at INFO ("HTTP Request: POST http://.../s/KEY/v1/chat/completions ..."). Any process
that imports `relayrl.client` and turns INFO logging on would write keys to its log; this filter
on the `httpx` logger replaces the key with `***` first.
"""

from __future__ import annotations

import logging
import re

_KEY_IN_URL = re.compile(r"/s/[^/\s\"']+/")


class RedactSessionKeys(logging.Filter):
    """Rewrites a record's message with every `/s/{key}/` path segment as `/s/***/`."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Redact, and always let the record through."""
        message = record.getMessage()
        if "/s/" in message:
            record.msg, record.args = _KEY_IN_URL.sub("/s/***/", message), None
        return True


def install(logger_name: str = "httpx") -> None:
    """Add the filter to `logger_name` once (importing `relayrl.client` does this for httpx)."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, RedactSessionKeys) for f in logger.filters):
        logger.addFilter(RedactSessionKeys())


__all__ = ["RedactSessionKeys", "install"]
