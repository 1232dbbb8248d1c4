"""Pydantic request schemas of the three wire formats relayrl serves, one module per format.

Only pydantic and typing here: no logic (converters live in `relayrl.chat.wire_*`). Every model
accepts unknown fields (`extra="allow"`), so a newer client is never refused for a field we do not
know; the converter decides which known fields we cannot honour. The tradeoff: a typo in a field
name is accepted silently, which is why the gateway logs unknown top-level fields once.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class WireModel(BaseModel):
    """Base of every wire schema: unknown fields are kept in `model_extra`, never refused."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    def extra_fields(self) -> tuple[str, ...]:
        """Names of the fields this schema does not declare, sorted (for a log line)."""
        return tuple(sorted(self.model_extra or {}))


__all__ = ["WireModel"]
