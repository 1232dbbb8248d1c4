"""Constants shared by the remote rollout schemas (limits and the roles a message may have).

Imports nothing from relayrl: the schemas are the protocol, usable by any client or server.
"""

from __future__ import annotations

VALID_MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
"""Roles a protocol message may carry."""
MAX_TOKENS_LIMIT = 1 << 20
"""Upper bound on any token count a request may name (a typo guard, not a model limit)."""
MAX_TURNS_LIMIT = 1000
"""Upper bound on `max_turns`."""
MAX_MESSAGES = 10_000
"""Most messages one rollout request may carry."""
