"""Gateway settings: one dataclass, one line per field."""

from __future__ import annotations

from dataclasses import dataclass, field

from relayrl.errors import ConfigError


@dataclass(frozen=True)
class GatewayConfig:
    """How to run a gateway.

    In a run's config (`relayrl train`, `relayrl serve`) the model, the engine and the staleness
    rule are set once, at `model`, `engine` and `rollout`; the gateway section refuses them.
    """

    model: str = "smollm2-135m-instruct"  # packaged name, local HF dir or hub id
    engine: str = "local"                 # "local" (in-process model), "vllm" (a server) or "fake" (scripted, for tests)
    engine_url: str | None = None         # the vLLM server's root URL when engine is "vllm"
    host: str = "127.0.0.1"               # address to bind; off loopback needs admin_key
    port: int = 8000                      # port to bind
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
    max_staleness: int | None = None      # staleness rule at the gateway (versions a sample may lag); None: no rule
    batch_size: int = 8                   # episodes per training batch (used only with max_staleness)
    model_label: str | None = None        # name shown in /v1/models and replies (default: model)
    header_timeout_s: float = 10.0        # a request's line and headers must arrive within this
    body_timeout_s: float = 30.0          # longest silence while a request body is arriving
    keep_alive_timeout_s: float = 5.0     # idle keep-alive connections are closed after this
    replicas: int = 1                     # N gateway + engine pairs behind one router at host:port (gateway, train, serve)
    roles: bool = False                   # record a role per call (header, scoped URL, model, session metadata; docs/multi-agent.md)
    role_models: dict[str, str] = field(default_factory=dict)  # with roles: model name the agent sends -> its role

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError("gateway.replicas must be >= 1")
        if self.role_models and not self.roles:
            raise ConfigError("gateway.role_models needs gateway.roles: true")
