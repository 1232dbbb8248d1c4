"""`gateway.replicas: N`: N gateway + engine pairs behind one router, in this process.

Each replica is a gateway with its own engine (a `LocalEngine` per replica, or one remote vLLM /
SGLang server per replica given by `engine_urls`) on a free loopback port; the router gives them
one URL, session-affine. The config key itself is wired by whoever reads `gateway.replicas`.

May import: relayrl.gateway, relayrl.router, relayrl.engine (the protocol), relayrl.errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from relayrl.engine.base import InferenceEngine
from relayrl.errors import ConfigError
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.router.config import RouterConfig
from relayrl.router.server import RouterThread


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


def start_replicas(config: GatewayConfig, replicas: int, *,
                   engines: Sequence[InferenceEngine] | None = None,
                   engine_urls: Sequence[str] | None = None,
                   router_host: str = "127.0.0.1", router_port: int = 0) -> Replicas:
    """Start `replicas` gateways (engines given, one per `engine_urls`, or loaded from `config`)
    on loopback ports, and a router in front of them at `router_host:router_port`."""
    if replicas < 1:
        raise ConfigError("gateway.replicas must be >= 1")
    for name, given in (("engines", engines), ("engine_urls", engine_urls)):
        if given is not None and len(given) != replicas:
            raise ConfigError(f"{name}: {len(given)} given for {replicas} replicas")
    gateways: list[GatewayThread] = []
    try:
        for i in range(replicas):
            cfg = replace(config, host="127.0.0.1", port=0)
            if engine_urls is not None:
                cfg = replace(cfg, engine_url=engine_urls[i])
            engine = engines[i] if engines is not None else None
            gateways.append(GatewayThread(build_deps(cfg, engine=engine)).start())
        router = RouterThread(RouterConfig(backends=[g.url for g in gateways]),
                              host=router_host, port=router_port).start()
    except BaseException:
        for g in gateways:
            g.stop()
        raise
    return Replicas(router, gateways)
