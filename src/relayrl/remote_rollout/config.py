"""Settings of the rollout server: one dataclass, read from the environment, overridable by flags.

Also the server's guards, which need only these settings: which callback hosts and tokenizer
names a request may name, and whether an address is loopback. Imports only the standard library.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

DEFAULT_TOKENIZER = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ServerConfig:
    """How the rollout server runs (env names in the comments)."""

    host: str = "127.0.0.1"                  # ROLLOUT_SERVER_HOST
    port: int = 9000                         # ROLLOUT_SERVER_PORT
    tokenizer_cache_size: int = 5            # TOKENIZER_CACHE_SIZE
    http_client_timeout: float = 300.0       # HTTP_CLIENT_TIMEOUT: seconds per trainer callback
    tokenizer_trust_remote_code: bool = False  # TOKENIZER_TRUST_REMOTE_CODE (transformers backend)
    tokenizer_backend: str = "relayrl"       # TOKENIZER_BACKEND: relayrl (torch-free) | transformers
    max_concurrent_rollouts: int = 100       # MAX_CONCURRENT_ROLLOUTS: the rest wait their turn
    default_tokenizer: str = DEFAULT_TOKENIZER  # ROLLOUT_TOKENIZER: when a request names none
    tool_delay_min_s: float = 0.01           # TOOL_DELAY_MIN_S
    tool_delay_max_s: float = 0.1            # TOOL_DELAY_MAX_S (0 and 0: no delay)
    tool_seed: int | None = None             # TOOL_SEED: seeds the tool delays
    api_key: str | None = field(default=None, repr=False)  # ROLLOUT_SERVER_API_KEY (/rollout, /tools)
    allowed_callback_hosts: tuple[str, ...] = ()  # ROLLOUT_ALLOWED_CALLBACK_HOSTS (comma-separated)
    allowed_tokenizers: tuple[str, ...] = ()  # ROLLOUT_ALLOWED_TOKENIZERS (comma-separated)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536 and self.port != 0:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.tokenizer_cache_size < 1 or self.max_concurrent_rollouts < 1:
            raise ValueError("tokenizer_cache_size and max_concurrent_rollouts must be >= 1")
        if self.http_client_timeout <= 0:
            raise ValueError("http_client_timeout must be > 0")
        if not 0 <= self.tool_delay_min_s <= self.tool_delay_max_s:
            raise ValueError("need 0 <= tool_delay_min_s <= tool_delay_max_s")
        if self.api_key is not None and len(self.api_key) < 16:
            raise ValueError("the API key must be at least 16 characters")
        for host in self.allowed_callback_hosts:
            if not host or ("/" in host and not _network(host)):
                raise ValueError(f"allowed callback host {host!r} is neither a host name, an "
                                 "IP address nor a network (10.0.0.0/8)")

    @property
    def tokenizer_names(self) -> tuple[str, ...]:
        """The tokenizers a request may name: the default one and the allowed ones."""
        return (self.default_tokenizer,
                *(t for t in self.allowed_tokenizers if t != self.default_tokenizer))

    def callback_refusal(self, server_url: str) -> str | None:
        """Why a request may not be called back at `server_url`, or None if it may."""
        parts = urlsplit(server_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return f"server_url {server_url!r} is not an http(s) URL with a host"
        host = parts.hostname.lower()
        if is_loopback(host) or host in (h.lower() for h in self.allowed_callback_hosts):
            return None
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            address = None
        if address is not None and any(address in net for h in self.allowed_callback_hosts
                                       if (net := _network(h)) is not None):
            return None
        return (f"callback host {host!r} is not allowed: this server calls back loopback "
                "addresses and the hosts given with --allow-callback-host "
                "(ROLLOUT_ALLOWED_CALLBACK_HOSTS)")

    def tokenizer_refusal(self, name: str | None) -> str | None:
        """Why a request may not render with tokenizer `name`, or None if it may."""
        if name is None or name in self.tokenizer_names:
            return None
        return (f"tokenizer {name!r} is not served here; allowed: {list(self.tokenizer_names)} "
                "(--tokenizer and --allow-tokenizer, ROLLOUT_ALLOWED_TOKENIZERS)")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> ServerConfig:
        """Settings from environment variables, then `overrides` (flags) on top."""
        e = os.environ if env is None else env
        values: dict[str, Any] = {}  # field name -> value, converted for that field
        for env_name, name, conv in _ENV:
            raw = e.get(env_name)
            if raw is not None and raw != "":
                try:
                    values[name] = conv(raw)
                except ValueError as err:
                    raise ValueError(f"{env_name}={raw!r}: {err}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an IP address) is this machine's loopback."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    if "/" not in text:
        return None
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None


def parse_list(raw: str) -> tuple[str, ...]:
    """`a,b, c` as ("a", "b", "c") (empty items dropped)."""
    return tuple(item.strip() for item in raw.split(",") if item.strip())


def parse_bool(raw: str) -> bool:
    """`true/1/yes/on` or `false/0/no/off` (any case)."""
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {raw!r}")


_ENV = (
    ("ROLLOUT_SERVER_HOST", "host", str),
    ("ROLLOUT_SERVER_PORT", "port", int),
    ("TOKENIZER_CACHE_SIZE", "tokenizer_cache_size", int),
    ("HTTP_CLIENT_TIMEOUT", "http_client_timeout", float),
    ("TOKENIZER_TRUST_REMOTE_CODE", "tokenizer_trust_remote_code", parse_bool),
    ("TOKENIZER_BACKEND", "tokenizer_backend", str),
    ("MAX_CONCURRENT_ROLLOUTS", "max_concurrent_rollouts", int),
    ("ROLLOUT_TOKENIZER", "default_tokenizer", str),
    ("TOOL_DELAY_MIN_S", "tool_delay_min_s", float),
    ("TOOL_DELAY_MAX_S", "tool_delay_max_s", float),
    ("TOOL_SEED", "tool_seed", int),
    ("ROLLOUT_SERVER_API_KEY", "api_key", str),
    ("ROLLOUT_ALLOWED_CALLBACK_HOSTS", "allowed_callback_hosts", parse_list),
    ("ROLLOUT_ALLOWED_TOKENIZERS", "allowed_tokenizers", parse_list),
)

__all__ = ["DEFAULT_TOKENIZER", "ServerConfig", "is_loopback", "parse_bool", "parse_list"]
