"""The viewer's web app: one HTML page, a small vanilla JS file and a JSON API.

Mounted at `/view` on the gateway (`for_gateway`), or served alone over a finished run
(`for_run_dir`). Routes, relative to the mount: `/` (the page), `/static/{name}`,
`/api/sessions` (filtered summaries), `/api/sessions/{id}` (one episode's tokens),
`/api/metrics` (metrics.jsonl records).

Access: when an admin key is configured, every route needs it, as `Authorization: Bearer`, as
`?token=` once (the page then sets an HttpOnly cookie holding an HMAC of the key, never the key,
and redirects to the same URL without the token, so it does not stay in the address bar or
history), or as that cookie. The key is never logged or echoed.

May import: Starlette (via FastAPI's dependency), `relayrl.viewer.data`, `relayrl.chat` (the
renderer, for decoding in `for_run_dir`), `relayrl.models`, `relayrl.trajectory`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from relayrl.viewer.data import (
    Decode,
    LiveSessionSource,
    SessionSource,
    episode_detail,
    list_sessions,
    read_metrics,
)

COOKIE = "relayrl_view"
STATIC_FILES = {"index.html": "text/html", "viewer.js": "text/javascript",
                "viewer.css": "text/css"}


def _static(name: str) -> bytes:
    return resources.files("relayrl.viewer").joinpath("static", name).read_bytes()


def _cookie_value(admin_key: str) -> str:
    # the cookie proves the key was shown once, without holding the key itself
    return hmac.new(admin_key.encode(), b"relayrl-view-cookie/1", hashlib.sha256).hexdigest()


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() or None if auth[:7].lower() == "bearer " else None


def _same(a: str | None, b: str) -> bool:
    return a is not None and hmac.compare_digest(a.encode(), b.encode())


def _float(request: Request, name: str) -> float | None:
    raw = request.query_params.get(name)
    if raw in (None, ""):
        return None
    try:
        return float(raw)
    except ValueError:
        return None


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "viewer_error"}},
                        status_code=status)


def create_view_app(
    source: SessionSource,
    decode: Decode,
    *,
    admin_key: str | None = None,
    metrics_path: Callable[[], Path | None] | Path | None = None,
) -> Starlette:
    """The viewer over `source`, decoding tokens with `decode`; `admin_key` guards every route."""

    def metrics_file() -> Path | None:
        return metrics_path() if callable(metrics_path) else metrics_path

    def allowed(request: Request) -> bool:
        if admin_key is None:
            return True
        if _same(_bearer(request), admin_key):
            return True
        return _same(request.cookies.get(COOKIE), _cookie_value(admin_key))

    async def page(request: Request) -> Response:
        if not request.url.path.endswith("/"):
            # the page's relative URLs (static/, api/) need the trailing slash
            return RedirectResponse(request.url.replace(path=request.url.path + "/"), 307)
        token = request.query_params.get("token")
        if admin_key is not None and token is not None:
            if not _same(token, admin_key):
                return _error(401, "wrong token")
            resp = RedirectResponse(request.url.remove_query_params("token"), 303)
            resp.set_cookie(COOKIE, _cookie_value(admin_key), httponly=True, samesite="strict",
                            path=request.scope.get("root_path") or "/")
            return resp
        if not allowed(request):
            return _error(401, "this page needs the gateway's admin key: open it with "
                               "?token=<admin key> once, or send Authorization: Bearer")
        return Response(_static("index.html"), media_type="text/html",
                        headers={"cache-control": "no-store"})

    async def static(request: Request) -> Response:
        if not allowed(request):
            return _error(401, "needs the admin key")
        name = request.path_params["name"]
        if name not in STATIC_FILES:
            return _error(404, f"no static file {name!r}")
        return Response(_static(name), media_type=STATIC_FILES[name])

    live_source = source if isinstance(source, LiveSessionSource) and source.live else None
    live = live_source is not None

    async def all_sessions() -> list[Any]:
        # a live gateway's sessions change on its event loop: never iterate them from a thread
        if live_source is not None:
            return await live_source.asessions()
        return await asyncio.to_thread(source.sessions)

    async def api_sessions(request: Request) -> Response:
        if not allowed(request):
            return _error(401, "needs the admin key")
        q = request.query_params
        sessions = await all_sessions()
        body = list_sessions(sessions, min_reward=_float(request, "min_reward"),
                             max_reward=_float(request, "max_reward"), state=q.get("state"),
                             abort=q.get("abort_reason"), branch=q.get("branch_reason"))
        return JSONResponse(body)

    async def api_session(request: Request) -> Response:
        if not allowed(request):
            return _error(401, "needs the admin key")
        sid = request.path_params["session_id"]
        sessions = await all_sessions()
        found = next((s for s in sessions if s.id == sid), None)
        if found is None:
            return _error(404, f"no session {sid!r}")
        if live:  # on the loop, so a call recorded meanwhile cannot change it mid-export
            return JSONResponse(episode_detail(found, decode))
        return JSONResponse(await asyncio.to_thread(episode_detail, found, decode))

    async def api_metrics(request: Request) -> Response:
        if not allowed(request):
            return _error(401, "needs the admin key")
        path = metrics_file()
        records: list[dict[str, Any]] = await asyncio.to_thread(read_metrics, path)
        return JSONResponse({"path": None if path is None else str(path), "records": records})

    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(404, f"no viewer route {request.url.path}")

    return Starlette(exception_handlers={404: not_found, 405: not_found}, routes=[
        Route("/", page),
        Route("/static/{name}", static),
        Route("/api/sessions", api_sessions),
        Route("/api/sessions/{session_id}", api_session),
        Route("/api/metrics", api_metrics),
    ])


def _metrics_near(log_path: str | None) -> Callable[[], Path | None]:
    """metrics.jsonl of the run whose log is `log_path` (`{run}/sessions.db` → `{run}/logs/`)."""
    def find() -> Path | None:
        if not log_path:
            return None
        base = Path(log_path).parent
        for p in (base / "logs" / "metrics.jsonl", base / "metrics.jsonl"):
            if p.is_file():
                return p
        return None

    return find


def for_gateway(deps: Any) -> Starlette:
    """The viewer over a live gateway (`GatewayDeps`): its store, its log, its tokenizer."""
    from relayrl.viewer.data import StoreSource

    cfg = deps.config
    return create_view_app(StoreSource(deps.store, cfg.log_path), deps.renderer.decode,
                           admin_key=cfg.admin_key, metrics_path=_metrics_near(cfg.log_path))


def find_log(run_dir: Path) -> Path:
    """The session log of a run folder (`sessions.db`, else the one `*.db` there), or the file."""
    if run_dir.is_file():
        return run_dir
    for candidate in (run_dir / "sessions.db", run_dir / "logs" / "sessions.db"):
        if candidate.is_file():
            return candidate
    dbs = sorted(run_dir.glob("*.db"))
    if len(dbs) == 1:
        return dbs[0]
    raise FileNotFoundError(f"no sessions.db in {run_dir} (give the gateway's --log file)")


def _run_model(run_dir: Path) -> str | None:
    """The model named in the run's config.yaml, if any."""
    cfg = run_dir / "config.yaml"
    if not cfg.is_file():
        return None
    import yaml

    data = yaml.safe_load(cfg.read_text()) or {}
    for section in (data.get("gateway") or {}, data):
        if isinstance(section, dict) and isinstance(section.get("model"), str):
            return section["model"]
    return None


def for_run_dir(path: str | Path, model: str | None = None,
                admin_key: str | None = None) -> Starlette:
    """The viewer over a finished run: its SQLite log and its logs/metrics.jsonl."""
    from relayrl.chat.renderer import Renderer
    from relayrl.models import DEFAULT_MODEL, model_path
    from relayrl.viewer.data import LogSource

    path = Path(path)
    log = find_log(path)
    run_dir = path if path.is_dir() else path.parent
    renderer = Renderer.from_pretrained(model_path(model or _run_model(run_dir) or DEFAULT_MODEL))
    metrics = next((p for p in (run_dir / "logs" / "metrics.jsonl", run_dir / "metrics.jsonl")
                    if p.is_file()), run_dir / "logs" / "metrics.jsonl")
    return create_view_app(LogSource(log), renderer.decode, admin_key=admin_key,
                           metrics_path=metrics)
