"""relayrl.gateway: the HTTP server that serves the policy in three wire formats, records every
call into sessions, and answers the RL routes (capacity, sessions, rewards, export).

Names load on first use (PEP 562), so `relayrl.gateway.config` can be read without FastAPI.
Module order, bottom to top: config, session_store, core, wires, bodies, auth, routes_rl, app,
server.

May import: `relayrl.chat`, `relayrl.trajectory`, `relayrl.engine` (the protocol; `LocalEngine`
only through `load_engine`), `relayrl.models`, FastAPI, uvicorn. Never client, workflow, rollout,
train or torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relayrl.gateway.app import create_app
    from relayrl.gateway.config import GatewayConfig
    from relayrl.gateway.core import GatewayDeps
    from relayrl.gateway.server import GatewayThread, build_deps, serve
    from relayrl.gateway.session_store import SessionStore
    from relayrl.gateway.wires import WIRES, Wire

_LAZY = {
    "WIRES": "relayrl.gateway.wires",
    "GatewayConfig": "relayrl.gateway.config",
    "GatewayDeps": "relayrl.gateway.core",
    "GatewayThread": "relayrl.gateway.server",
    "SessionStore": "relayrl.gateway.session_store",
    "Wire": "relayrl.gateway.wires",
    "build_deps": "relayrl.gateway.server",
    "create_app": "relayrl.gateway.app",
    "serve": "relayrl.gateway.server",
}

__all__ = [
    "WIRES",
    "GatewayConfig",
    "GatewayDeps",
    "GatewayThread",
    "SessionStore",
    "Wire",
    "build_deps",
    "create_app",
    "serve",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
