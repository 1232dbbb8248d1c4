"""`relayrl view`: a web page to watch training — sessions as they arrive, one episode's tokens
with loss mask, logprobs and weight versions, and the run's curves.

Served by the gateway at `/view` (`for_gateway`), or alone over a finished run's folder
(`serve_run_dir`, `main`). Torch-free; sits at the gateway's layer.

May import: `relayrl.chat`, `relayrl.trajectory`, `relayrl.models`, `relayrl.errors`,
`relayrl.asgi` (how uvicorn runs); never `relayrl.gateway` (the gateway imports this package),
client, workflow, rollout or train.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from relayrl.viewer.app import create_view_app, find_log, for_gateway, for_run_dir
from relayrl.viewer.data import LogSource, StoreSource, episode_detail, list_sessions

__all__ = ["LogSource", "StoreSource", "create_view_app", "episode_detail", "find_log",
           "for_gateway", "for_run_dir", "list_sessions", "main", "serve_run_dir"]

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def run_dir_app(path: str | Path, model: str | None = None,
                admin_key: str | None = None) -> Starlette:
    """An app with the viewer at `/view` (and `/` redirecting there) over a finished run."""
    from starlette.responses import RedirectResponse
    from starlette.routing import Mount, Route

    view = for_run_dir(path, model=model, admin_key=admin_key)

    async def home(request: Request) -> Response:
        return RedirectResponse("/view/", 307)

    return Starlette(routes=[Route("/", home), Mount("/view", app=view)])


def serve_run_dir(path: str | Path, host: str = "127.0.0.1", port: int = 8080,
                  model: str | None = None, admin_key: str | None = None) -> None:
    """Serve the viewer over a finished run (its `sessions.db` and `logs/metrics.jsonl`)."""
    import uvicorn

    from relayrl.asgi import uvicorn_options

    if host not in _LOOPBACK and not admin_key:
        raise SystemExit("relayrl view: an admin key (RELAYRL_ADMIN_KEY) is needed off loopback")
    app = run_dir_app(path, model=model, admin_key=admin_key)
    print(f"relayrl view: http://{host}:{port}/view/", flush=True)
    # no access log: a ?token= in a URL must not land in a log file
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False,
                **uvicorn_options())


def main(args: Sequence[str] | None = None) -> int:
    """`relayrl view RUN_DIR [--host H] [--port P] [--model M]`."""
    p = argparse.ArgumentParser(prog="relayrl view",
                                description="Watch a run: sessions, episodes' tokens, curves.")
    p.add_argument("run_dir", help="a run folder (with sessions.db) or a gateway --log file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--model", default=None,
                   help="tokenizer to decode with (default: the run's config.yaml, else the "
                        "default model)")
    ns = p.parse_args(args)
    serve_run_dir(ns.run_dir, ns.host, ns.port, model=ns.model,
                  admin_key=os.environ.get("RELAYRL_ADMIN_KEY") or None)
    return 0
