"""What a router is told: its backends, or its tenants (each with hashed API keys and backends).

A tenants file (YAML or JSON) lists, for each tenant, its name, the SHA-256 hex of its API key
(the plain key is never stored) and the root URLs of its own gateways:

    tenants:
      - name: acme
        api_key_sha256: 9f86d081884c7d65...   # printf %s "$KEY" | sha256sum
        backends: [http://10.0.0.5:8000]
        backend_key_env: ACME_GATEWAY_KEY     # optional, see Tenant.backend_key

May import: relayrl.errors, pyyaml. Nothing else of ours.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relayrl.errors import ConfigError

_HEX64 = re.compile(r"[0-9a-f]{64}")
_URL = re.compile(r"https?://[^\s/]+(/[^\s]*)?")


def key_digest(key: str) -> str:
    """The SHA-256 hex digest under which a tenant's API key is stored."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Tenant:
    """One customer: its hashed API key and the gateways of its own training job."""

    name: str
    key_sha256: str
    backends: tuple[str, ...]
    backend_key: str | None = field(default=None, repr=False)
    """Admin key of the tenant's gateways, from `backend_key_env`: when set, the router swaps the
    tenant's key for it on admin calls; when absent, the tenant's gateways must have been started
    with `--admin-key` equal to the tenant's own key (the router passes keys through)."""


@dataclass
class RouterConfig:
    """A router's settings."""

    backends: list[str] = field(default_factory=list)
    """Gateway root URLs (single-tenant mode; empty with tenants)."""
    tenants: list[Tenant] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8080
    health_interval_s: float = 2.0
    """Seconds between health checks of every backend."""
    health_timeout_s: float = 2.0
    down_after: int = 2
    """Consecutive failed health checks that mark a backend down (a refused connection while
    forwarding marks it down at once)."""
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    """Longest wait for a byte of a backend's answer (a long generation streams its first byte
    late)."""
    max_body_bytes: int = 16 << 20
    """Larger request bodies get a 413 before any backend sees them."""
    max_bindings: int = 1 << 20
    """Session keys (and session ids) remembered; the oldest are forgotten first."""

    def validate(self) -> None:
        """Raise ConfigError unless the settings describe a router that can run."""
        if bool(self.backends) == bool(self.tenants):
            raise ConfigError("give either --backend URL (one or more) or --tenants FILE")
        urls = list(self.backends) + [u for t in self.tenants for u in t.backends]
        for url in urls:
            if not _URL.fullmatch(url):
                raise ConfigError(f"backend {url!r} is not an http(s) root URL")
        if len({u.rstrip("/") for u in urls}) != len(urls):
            raise ConfigError("a backend URL is listed twice (tenants never share a gateway)")
        if self.health_interval_s <= 0 or self.health_timeout_s <= 0 or self.down_after < 1:
            raise ConfigError("health_interval_s and health_timeout_s must be > 0, down_after >= 1")


def _tenant(raw: Any, index: int) -> Tenant:
    if not isinstance(raw, dict):
        raise ConfigError(f"tenant #{index} must be a mapping")
    unknown = set(raw) - {"name", "api_key_sha256", "backends", "backend_key_env"}
    if "api_key" in raw:
        raise ConfigError(f"tenant #{index}: store the key hashed (api_key_sha256), never in plain")
    if unknown:
        raise ConfigError(f"tenant #{index}: unknown fields {sorted(unknown)}")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"tenant #{index} needs a name")
    digest = str(raw.get("api_key_sha256", "")).lower()
    if not _HEX64.fullmatch(digest):
        raise ConfigError(f"tenant {name!r}: api_key_sha256 must be 64 hex digits")
    backends = raw.get("backends")
    if isinstance(backends, str):
        backends = [backends]
    if not isinstance(backends, list) or not backends or not all(isinstance(b, str) for b in backends):
        raise ConfigError(f"tenant {name!r} needs backends: a list of gateway URLs")
    backend_key = None
    env = raw.get("backend_key_env")
    if env is not None:
        backend_key = os.environ.get(str(env))
        if not backend_key:
            raise ConfigError(f"tenant {name!r}: environment variable {env} is not set")
        if not backend_key.isprintable() or not backend_key.isascii():
            # it goes into a header line as is: a line break would forge headers
            raise ConfigError(f"tenant {name!r}: {env} must be printable ASCII")
    return Tenant(name, digest, tuple(b.rstrip("/") for b in backends), backend_key)


def load_tenants(path: str | Path) -> list[Tenant]:
    """Read a tenants file (YAML or JSON: a list, or a mapping with a `tenants` list)."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read the tenants file {path}: {e.strerror}") from None
    try:
        raw = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: not valid YAML/JSON: {e}") from None
    if isinstance(raw, dict):
        raw = raw.get("tenants")
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{path}: expected a non-empty list of tenants")
    tenants = [_tenant(t, i) for i, t in enumerate(raw)]
    names = [t.name for t in tenants]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: tenant names must be unique")
    if len({t.key_sha256 for t in tenants}) != len(tenants):
        raise ConfigError(f"{path}: two tenants share an API key")
    return tenants
