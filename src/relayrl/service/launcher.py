"""`ServiceLauncher`: the policy served on a public port for agents anywhere, and the trainer fed
by the sessions they finalize (`ExternalSessionSource`).

Like `LocalLauncher`, the engine and the gateway run in this process; unlike it, the gateway
listens where the config says, applies the staleness rule itself (agents start sessions on their
own, so the gateway is the only place that can refuse them), and the batches come from
finalized sessions instead of a workflow over a dataset. With `gateway.replicas: N`, N engine +
gateway pairs on loopback and a session-affine router on the configured address; each gateway
applies its share of the staleness budget, and `/rl/v1/status` through the router sums them.

Imports: engine, gateway, client, train (ports, actor), config, service.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from relayrl.client import SessionClient
from relayrl.config import RelayConfig
from relayrl.engine import InferenceEngine
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.routes_rl_v1 import Refusal, state_of
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.gateway.server import ensure_admin_key as gateway_admin_key
from relayrl.launch.local import check_replica_engines, start_engine, start_engines
from relayrl.launch.replicas import (
    AllEngines,
    Replicas,
    engine_threads,
    replica_share,
    start_replicas,
)
from relayrl.rollout import RolloutConfig
from relayrl.rollout.external import ExternalSessionSource, SourceCounters
from relayrl.train.actor import Actor

DRAIN_RETRY_S = 30.0
"""`Retry-After` for sessions refused while the service shuts down."""
WARMUP_RETRY_S = 2.0
"""`Retry-After` for sessions refused while the trainer warm-starts."""


def service_gateway_config(cfg: RelayConfig) -> GatewayConfig:
    """The gateway's settings for a service: the staleness rule counted in sessions.

    With replicas, each gateway admits its share of a batch's sessions (`replica_share`).
    """
    r = cfg.rollout
    return replace(cfg.gateway_config(), max_staleness=r.max_staleness,
                   batch_size=replica_share(r.batch_size * r.group_size, cfg.gateway.replicas))


def ensure_admin_key(cfg: RelayConfig) -> tuple[RelayConfig, Path | None]:
    """The config with an admin key; a generated one is kept (0600) in `{run}/admin_key`.

    The gateway's own rule (`gateway.server.ensure_admin_key`), with the key file in the run's
    folder, next to its checkpoints and log.
    """
    gw, path = gateway_admin_key(cfg.gateway, cfg.run_dir / "admin_key")
    return replace(cfg, gateway=gw), path


@dataclass
class TrainerView:
    """What every gateway of the service shows of the trainer (`/rl/v1/status`) and whom it
    admits. It is installed before a gateway listens, so no request sees a gateway without it."""

    actor: Actor
    counters: SourceCounters = field(default_factory=SourceCounters)
    """What the trainer's source has seen; exists from the start, so `/rl/v1/status` always
    shows it (agents may finish sessions while the trainer still warm-starts)."""
    training: bool = False
    """The trainer asks for batches (its SFT warm-start is over)."""
    draining: bool = False

    @property
    def phase(self) -> str:
        """"warming_up" until the trainer asks for batches (after its SFT warm-start), then
        "training"; "draining" once stopping."""
        if self.draining:
            return "draining"
        return "training" if self.training else "warming_up"

    def install(self, gateway: GatewayThread) -> None:
        """Make `gateway` report the trainer and refuse sessions while it is not training."""
        v1 = state_of(gateway.app)
        v1.status_extra = self.status
        v1.admit = self.admit

    def admit(self, _deps: Any) -> Refusal | None:
        """Refuse new sessions unless the trainer takes batches."""
        # During the warm-start the engine still serves the weights from before SFT, under the
        # same version 0 the warmed weights get: sessions sampled then would be trained as if
        # from the warmed policy, so none start until the trainer is ready for them.
        if self.draining:
            return Refusal(DRAIN_RETRY_S, "the service is shutting down")
        if not self.training:
            return Refusal(WARMUP_RETRY_S, "the service is warming up (SFT) before it trains")
        return None

    def status(self) -> dict[str, Any]:
        """The trainer's side of `/rl/v1/status`: phase, steps, and what the source has seen."""
        return {"trainer": {"phase": self.phase, "step": self.actor.step,
                            "version": self.actor.version, "draining": self.draining,
                            **self.counters.as_dict()}}


@dataclass
class ServiceServices:
    """The engine, the public gateway, an admin client, and the source of external batches
    (with replicas: every engine as one weight sink, the router as the public address)."""

    engine: InferenceEngine | AllEngines
    gateway: GatewayThread
    """The gateway (with replicas: the first one; `replicas` has them all)."""
    client: SessionClient
    config: RelayConfig
    view: TrainerView
    managed_server: Any = None
    source: ExternalSessionSource | None = None
    replicas: Replicas | None = None
    """With `gateway.replicas > 1`: every gateway and the public router."""

    @property
    def actor(self) -> Actor:
        """The trainer's actor."""
        return self.view.actor

    @property
    def engine_threads(self) -> int:
        """Torch threads of the engines in this process: the trainer leaves them these cores."""
        return engine_threads(self.engine)

    @property
    def gateways(self) -> list[GatewayThread]:
        """Every gateway serving the policy."""
        return self.replicas.gateways if self.replicas is not None else [self.gateway]

    @property
    def draining(self) -> bool:
        """Stopping: no new sessions, no more batches."""
        return self.view.draining

    def status(self) -> dict[str, Any]:
        """The trainer's side of `/rl/v1/status`."""
        return self.view.status()

    def batches(self, workflow: Any, workflow_kwargs: dict[str, Any] | None,
                dataset: Sequence[dict[str, Any]], rollout: RolloutConfig,
                version_fn: Callable[[], int]) -> ExternalSessionSource:
        """Batches from finalized sessions (the workflow and dataset are the agents' own)."""
        agent = rollout.agent_config()
        svc = self.config.service
        self.source = ExternalSessionSource(
            self.client, group_size=rollout.group_size, batch_size=rollout.batch_size,
            max_staleness=rollout.max_staleness, version_fn=version_fn,
            export_style=str(agent.export_style), credit=str(agent.credit),
            discount=agent.discount, group_wait_s=svc.group_wait_s, poll_s=svc.poll_s)
        self.source.counters = self.view.counters
        self.view.training = True
        if self.draining:  # a stop that came before the trainer asked (during a warm-start)
            self.source.stop()
        return self.source

    def stop(self) -> None:
        """Refuse new sessions and hand the trainer no more batches (SIGINT/SIGTERM)."""
        self.view.draining = True
        if self.source is not None:
            self.source.stop()

    async def aclose(self) -> None:
        """Abort sessions still open (never trained), then stop the gateway and the engine."""
        self.view.draining = True
        for session_id in await self.client.open_sessions():
            with contextlib.suppress(Exception):  # ended meanwhile: nothing to abort
                await self.client.abort_session(session_id)
        await self.client.aclose()
        if self.replicas is not None:
            self.replicas.stop()  # the router, then every gateway
        else:
            self.gateway.stop()
        for gateway in self.gateways:
            if gateway.deps.log is not None:
                gateway.deps.log.close()
        await self.engine.aclose()
        if self.managed_server is not None:
            self.managed_server.stop()


def agent_env_lines(url: str, key_file: Path | None) -> list[str]:
    """The shell lines that point an agent at the service, for the user to paste.

    They set `OPENAI_BASE_URL` and `OPENAI_API_KEY` (what unchanged agents and the OpenAI SDK
    read) and relayrl's own `RELAYRL_URL` and `RELAYRL_API_KEY` to the same values: those are
    what `AgentSession` and `AgentRunner` read first, so a value left in the shell from another
    service cannot send the sessions elsewhere. The key is never in them: with a generated key
    they read its file (`$(cat FILE)`); with a configured one they say where it is. The URL is
    the root, which OpenAI-style clients (`/chat/completions`) and plain HTTP agents
    (`/v1/chat/completions`) both reach.
    """
    quoted = shlex.quote(url)
    if key_file is not None:
        path = shlex.quote(str(Path(key_file).resolve()))
        return [f'export OPENAI_BASE_URL={quoted} OPENAI_API_KEY="$(cat {path})"',
                'export RELAYRL_URL="$OPENAI_BASE_URL" RELAYRL_API_KEY="$OPENAI_API_KEY"']
    return [f"export OPENAI_BASE_URL={quoted} RELAYRL_URL={quoted}",
            "# and OPENAI_API_KEY and RELAYRL_API_KEY: the service's key (gateway.admin_key of "
            "its config)"]


class ServiceLauncher:
    """Starts a `ServiceServices` and prints where agents reach it."""

    def __init__(self, config: RelayConfig, key_file: Path | None = None) -> None:
        check_replica_engines(config)
        self.config = config
        self.key_file = key_file
        self.services: ServiceServices | None = None
        self._stop_requested = False

    async def __call__(self, actor: Actor) -> ServiceServices:
        """Engine with the actor's weights, gateway on the configured address, admin client."""
        cfg = self.config
        gw_cfg = replace(service_gateway_config(cfg), model=actor.model_dir(),
                         model_label=cfg.gateway.model_label or cfg.model)
        view = TrainerView(actor, draining=self._stop_requested)
        if cfg.gateway.replicas > 1:
            engines = await start_engines(cfg, actor)
            sink = AllEngines(engines)
            try:
                rep = start_replicas(gw_cfg, len(engines), engines=engines,
                                     router_host=gw_cfg.host, router_port=gw_cfg.port,
                                     before_start=view.install)
            except BaseException:
                await sink.aclose()
                raise
            print(f"relayrl service listening at {rep.url} (a router in front of "
                  f"{len(engines)} replicas: {', '.join(g.url for g in rep.gateways)})",
                  flush=True)
            client = SessionClient(rep.url, admin_key=gw_cfg.admin_key)
            self.services = ServiceServices(sink, rep.gateways[0], client, cfg, view,
                                            replicas=rep)
        else:
            engine, managed = await start_engine(cfg, actor)
            gateway = GatewayThread(build_deps(gw_cfg, engine=engine), host=gw_cfg.host,
                                    port=gw_cfg.port)
            view.install(gateway)
            gateway.start()
            client = SessionClient(gateway.url, admin_key=gw_cfg.admin_key)
            self.services = ServiceServices(engine, gateway, client, cfg, view, managed)
            print(f"relayrl service listening at {gateway.url}", flush=True)
        self._print_agent_env(self.services)
        if self._stop_requested:
            self.services.stop()
        return self.services

    def _print_agent_env(self, services: ServiceServices) -> None:
        url = services.replicas.url if services.replicas is not None else services.gateway.url
        print("relayrl service: point agents at it with (AgentSession and AgentRunner read "
              "these):", flush=True)
        for line in agent_env_lines(url, self.key_file):
            print(line, flush=True)

    def stop(self) -> None:
        """Begin a clean shutdown (safe to call before the services exist)."""
        self._stop_requested = True
        if self.services is not None:
            self.services.stop()
