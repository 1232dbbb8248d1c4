"""`gateway.replicas: N`: N gateway + engine pairs behind one router, in this process.

Each replica is a gateway with its own engine (a `LocalEngine` per replica, or one remote vLLM /
SGLang server per replica given by `engine_urls`) on a free loopback port; the router gives them
one URL, session-affine. `relayrl gateway --replicas N` (or `gateway.replicas: N`) runs
`serve_replicas`; `relayrl train` (the local launcher) and `relayrl serve` start replicas with
`start_replicas` and push each step's weights to every engine through `AllEngines`. Launchers
that serve from one gateway (`launcher: ray`) refuse `replicas > 1` (`refuse_replicas`).

May import: relayrl.gateway, relayrl.router, relayrl.engine (the protocol), relayrl.errors.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from relayrl.engine.base import InferenceEngine
from relayrl.errors import ConfigError, EngineError
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps, ensure_admin_key, is_loopback
from relayrl.router.config import RouterConfig
from relayrl.router.server import RouterThread
from relayrl.types import GenerateOutput, GenerateRequest, TokenChunk


@dataclass
class Replicas:
    """Running replicas and their router."""

    router: RouterThread
    gateways: list[GatewayThread]

    @property
    def url(self) -> str:
        """The one public URL (the router's)."""
        return self.router.url

    def stop(self) -> None:
        """Stop the router, then every gateway."""
        self.router.stop()
        for g in self.gateways:
            g.stop()

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def engine_threads(engine: InferenceEngine | AllEngines) -> int:
    """Torch threads of the in-process engines (`num_threads`; a server elsewhere has none)."""
    engines = engine.engines if isinstance(engine, AllEngines) else [engine]
    return sum(int(getattr(e, "num_threads", 0) or 0) for e in engines)


class AllEngines:
    """The replicas' engines as one weight sink: an update goes to all of them at once.

    `update_weights` succeeds only when every engine took the new weights. If any fails, the
    others are still awaited (none is left mid-update), and an `EngineError` names the replicas
    that failed and the version each engine serves now: the run stops there rather than train on
    with replicas serving different weights under what it believes is one version. (Tokens stay
    correctly stamped either way: each gateway stamps its own engine's version.)
    """

    def __init__(self, engines: Sequence[InferenceEngine]) -> None:
        if not engines:
            raise ValueError("AllEngines needs at least one engine")
        self.engines = list(engines)
        self._turn = -1

    @property
    def version(self) -> int:
        """The oldest version any replica serves."""
        return min(e.version for e in self.engines)

    async def update_weights(self, weights: Mapping[str, Any] | str, version: int | None = None
                             ) -> int:
        """Load `weights` into every engine concurrently; the version they all serve now."""
        results = await asyncio.gather(
            *(e.update_weights(weights, version=version) for e in self.engines),
            return_exceptions=True)
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            for _, r in failed:
                if not isinstance(r, Exception):  # cancellation, KeyboardInterrupt: not ours
                    raise r
            serving = ", ".join(f"r{i}: v{e.version}" for i, e in enumerate(self.engines))
            which = "; ".join(f"r{i}: {type(r).__name__}: {r}" for i, r in failed)
            raise EngineError(f"weight update to version {version} failed on {len(failed)} of "
                              f"{len(self.engines)} replicas ({which}); versions now served: "
                              f"{serving}") from failed[0][1]
        return self.version

    @property
    def context_length(self) -> int:
        """The shortest context of the replicas."""
        return min(e.context_length for e in self.engines)

    def _next(self) -> InferenceEngine:
        self._turn = (self._turn + 1) % len(self.engines)
        return self.engines[self._turn]

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """A workflow's direct request, on the replicas in turn."""
        return await self._next().generate(request)

    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """A workflow's direct streamed request, on the replicas in turn."""
        return self._next().stream(request)

    async def aclose(self) -> None:
        """Close every engine (all are tried; the first error is raised after)."""
        results = await asyncio.gather(*(e.aclose() for e in self.engines),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r


def start_replicas(config: GatewayConfig, replicas: int, *,
                   engines: Sequence[InferenceEngine] | None = None,
                   engine_urls: Sequence[str] | None = None,
                   router_host: str = "127.0.0.1", router_port: int = 0,
                   before_start: Callable[[GatewayThread], None] | None = None) -> Replicas:
    """Start `replicas` gateways (engines given, one per `engine_urls`, or loaded from `config`)
    on loopback ports, and a router in front of them at `router_host:router_port`.

    `before_start(gateway)` runs on each gateway before it listens (to install hooks that must
    hold for its first request).
    """
    if replicas < 1:
        raise ConfigError("gateway.replicas must be >= 1")
    for name, given in (("engines", engines), ("engine_urls", engine_urls)):
        if given is not None and len(given) != replicas:
            raise ConfigError(f"{name}: {len(given)} given for {replicas} replicas")
    gateways: list[GatewayThread] = []
    try:
        for i in range(replicas):
            cfg = replace(config, host="127.0.0.1", port=0, replicas=1,
                          log_path=replica_log_path(config.log_path, i, replicas))
            if engine_urls is not None:
                cfg = replace(cfg, engine_url=engine_urls[i])
            engine = engines[i] if engines is not None else None
            gateway = GatewayThread(build_deps(cfg, engine=engine))
            if before_start is not None:
                before_start(gateway)
            gateways.append(gateway.start())
        router = RouterThread(RouterConfig(backends=[g.url for g in gateways]),
                              host=router_host, port=router_port).start()
    except BaseException:
        for g in gateways:
            g.stop()
        raise
    return Replicas(router, gateways)


def replica_log_path(log_path: str | None, index: int, replicas: int) -> str | None:
    """Replica `index`'s own durable log (one SQLite file per gateway): `sessions.r0.db`, ..."""
    if log_path is None or replicas == 1:
        return log_path
    p = Path(log_path)
    return str(p.with_name(f"{p.stem}.r{index}{p.suffix}"))


def replica_share(batch_size: int, replicas: int) -> int:
    """Each replica's part of a staleness budget counted in sessions (rounded up): the router
    tries the next replica when one refuses, so N replicas admit about one budget, not N."""
    return -(-batch_size // replicas)


def refuse_replicas(config: GatewayConfig, where: str) -> None:
    """Raise a clear ConfigError where `gateway.replicas > 1` is not supported (`where`)."""
    if config.replicas > 1:
        raise ConfigError(f"gateway.replicas > 1 is not supported by {where}: it serves the "
                          "policy from one gateway; `relayrl gateway` runs replicas")


def serve_replicas(config: GatewayConfig, admin_key_file: Path | None = None, *,
                   stop: threading.Event | None = None) -> None:
    """`relayrl gateway` with `config.replicas > 1`: the gateways on loopback ports, the router at
    `config.host:config.port` (the one public URL, printed), until interrupted or `stop` is set."""
    if not is_loopback(config.host) and not config.admin_key:
        raise ConfigError(f"refusing to listen on {config.host}, which is not loopback, with no "
                          "admin key: pass --admin-key")
    config, key_file = ensure_admin_key(config, admin_key_file)  # one key for every replica
    if config.max_staleness is not None:
        config = replace(config, batch_size=replica_share(config.batch_size, config.replicas))
    stop = stop or threading.Event()
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            handlers[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        with start_replicas(config, config.replicas, router_host=config.host,
                            router_port=config.port) as rep:
            print(f"relayrl gateway listening at {rep.url} (a router in front of "
                  f"{config.replicas} replicas: {', '.join(g.url for g in rep.gateways)})",
                  flush=True)
            if key_file is not None:
                print(f"admin key (generated; send it as `Authorization: Bearer KEY`) is in "
                      f"{key_file}", flush=True)
            while not stop.wait(1.0):
                pass
    finally:
        for sig, old in handlers.items():
            signal.signal(sig, old)
