"""relayrl.router: one public URL in front of several gateways (data-parallel replicas, or one
training job per tenant), session-affine, relaying completions byte for byte.

Names load on first use (PEP 562). May import: relayrl.errors, relayrl.chat (error bodies),
starlette, aiohttp, uvicorn, pyyaml. Never the gateway's internals (gateways are reached over
HTTP), nor client or anything above, nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relayrl.router.app import Router, create_app
    from relayrl.router.config import RouterConfig, Tenant, key_digest, load_tenants
    from relayrl.router.server import RouterThread, serve

_LAZY = {
    "Router": "relayrl.router.app",
    "RouterConfig": "relayrl.router.config",
    "RouterThread": "relayrl.router.server",
    "Tenant": "relayrl.router.config",
    "create_app": "relayrl.router.app",
    "key_digest": "relayrl.router.config",
    "load_tenants": "relayrl.router.config",
    "serve": "relayrl.router.server",
}

__all__ = [
    "Router",
    "RouterConfig",
    "RouterThread",
    "Tenant",
    "create_app",
    "key_digest",
    "load_tenants",
    "serve",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
