"""Gateway settings: one dataclass, one line per field."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayConfig:
    """How to run a gateway."""

    model: str = "smollm2-135m-instruct"  # packaged name, local HF dir or hub id
    engine: str = "local"                 # "local" (in-process model) or "fake" (scripted, for tests)
    host: str = "127.0.0.1"
    port: int = 8000
    admin_key: str | None = None          # required to bind off loopback
    log_path: str | None = None           # SQLite log; a restart on the same file recovers sessions
    session_ttl_s: float = 3600.0         # idle seconds before an open session is aborted
    ended_ttl_s: float = 6 * 3600.0       # idle seconds before an ended, never-exported session is aborted
    compact_after_closed: int = 1000      # closed sessions that trigger a durable-log compaction
    compact_every_s: float = 600.0        # ... or seconds since the last one, if any closed
    max_sessions: int = 10_000            # live sessions kept in memory (exported ones go first)
    max_body_bytes: int = 8 << 20         # larger request bodies get a 413
    default_max_tokens: int = 1024        # when a request names no limit (clamped to the context)
    max_n: int = 16                       # most samples one request may ask for
    max_staleness: int | None = 1         # versions a sample may lag (grant_capacity's rule); None: no rule
    batch_size: int = 8                   # episodes per training batch (grant_capacity's rule)
    model_label: str | None = None        # name shown in /v1/models and replies (default: model)
