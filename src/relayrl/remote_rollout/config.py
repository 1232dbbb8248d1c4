"""Settings of the rollout server: one dataclass, read from the environment, overridable by flags.

Imports only the standard library.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

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

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536 and self.port != 0:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.tokenizer_cache_size < 1 or self.max_concurrent_rollouts < 1:
            raise ValueError("tokenizer_cache_size and max_concurrent_rollouts must be >= 1")
        if self.http_client_timeout <= 0:
            raise ValueError("http_client_timeout must be > 0")
        if not 0 <= self.tool_delay_min_s <= self.tool_delay_max_s:
            raise ValueError("need 0 <= tool_delay_min_s <= tool_delay_max_s")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> ServerConfig:
        """Settings from environment variables, then `overrides` (flags) on top."""
        e = os.environ if env is None else env
        values: dict[str, object] = {}
        for env_name, field, conv in _ENV:
            raw = e.get(env_name)
            if raw is not None and raw != "":
                try:
                    values[field] = conv(raw)
                except ValueError as err:
                    raise ValueError(f"{env_name}={raw!r}: {err}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


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
)

__all__ = ["DEFAULT_TOKENIZER", "ServerConfig", "parse_bool"]
