"""relayrl's errors: one small tree, mapped to HTTP statuses in one place (the gateway).

    RelayError
    ├── InvalidRequest (ValueError)          400  a client sent something we cannot serve
    │   ├── ContextLengthExceeded            400  prompt (+ max tokens) does not fit the model
    │   └── PayloadTooLarge                  413  request body over the limit
    ├── AuthenticationFailed (PermissionError) 401  missing or wrong key
    ├── NotFound (LookupError)               404  unknown session / interaction / model
    ├── SessionClosed                        409  the session ended, was exported or expired
    ├── CapacityExhausted                    429  staleness rule: no room for a new episode
    ├── ModelError (RuntimeError)                 a model cannot be provisioned or loaded
    │   └── ChecksumMismatch                      packaged weights do not match their sha256
    ├── ConfigError (ValueError)                  bad config key or value
    ├── EngineError (RuntimeError)           503  the engine failed or is shut down
    ├── Unavailable                          503  a shared resource is busy (the durable log is locked)
    └── EpisodeFailed (RuntimeError)              an agent, its reward or its subprocess failed

Every class keeps the default `__init__` so instances pickle (subprocess workflows need that).
"""

from __future__ import annotations


class RelayError(Exception):
    """Root of relayrl's errors."""

    status_code = 500
    error_type = "api_error"


class InvalidRequest(RelayError, ValueError):
    """The request cannot be served as sent."""

    status_code = 400
    error_type = "invalid_request_error"
    param: str | None = None
    """The offending field, when one is (OpenAI's `error.param`); set on the instance."""


class ContextLengthExceeded(InvalidRequest):
    """The prompt, or prompt plus requested tokens, exceeds the model's context."""


class PayloadTooLarge(InvalidRequest):
    """The request body is larger than the gateway accepts."""

    status_code = 413


class AuthenticationFailed(RelayError, PermissionError):
    """No key, or a key that does not reach this resource."""

    status_code = 401
    error_type = "authentication_error"


class NotFound(RelayError, LookupError):
    """An unknown session, interaction or model."""

    status_code = 404
    error_type = "not_found_error"


class SessionClosed(RelayError):
    """The session ended, was exported, or expired; it takes no more calls."""

    status_code = 409
    error_type = "conflict_error"


class CapacityExhausted(RelayError):
    """No capacity for a new episode under the staleness rule."""

    status_code = 429
    error_type = "rate_limit_error"


class ModelError(RelayError, RuntimeError):
    """A model cannot be provisioned or loaded."""


class ChecksumMismatch(ModelError):
    """Packaged weights do not match the sha256 we expect: refuse to load them."""


class ConfigError(RelayError, ValueError):
    """A config key is unknown or its value has the wrong type."""

    status_code = 400
    error_type = "invalid_request_error"


class EngineError(RelayError, RuntimeError):
    """The inference engine failed or has shut down."""

    status_code = 503
    error_type = "api_error"


class Unavailable(RelayError):
    """A resource the call needs is busy for now (the durable log is locked): try again."""

    status_code = 503
    error_type = "api_error"


class EpisodeFailed(RelayError, RuntimeError):
    """An episode's own code failed (agent, reward function, subprocess): it is aborted."""


class RolloutFailed(EpisodeFailed):
    """Episodes keep failing (`rollout.max_consecutive_aborts` in a row): the run stops."""
