"""`LocalLauncher`: everything of a run in this process: the engine, the gateway on a loopback
thread, the session client the agents' episodes use, and the rollout controllers.

This is the laptop/CPU default and the reference for other launchers: a launcher is any
callable `await launcher(actor) -> Services` (see `relayrl.train.ports`).

Imports: engine, gateway, client, workflow, rollout, train (ports and actor), config.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from relayrl.client import SessionClient
from relayrl.config import RelayConfig
from relayrl.engine.local import LocalEngine
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.rollout import RolloutConfig, RolloutController
from relayrl.train.actor import Actor
from relayrl.workflow import resolve_workflow


@dataclass
class LocalServices:
    """The engine, the gateway on loopback, and a session client bound to it."""

    engine: LocalEngine
    gateway: GatewayThread
    client: SessionClient

    def batches(self, workflow: Any, workflow_kwargs: dict[str, Any] | None,
                dataset: Sequence[dict[str, Any]], rollout: RolloutConfig,
                version_fn: Callable[[], int]) -> RolloutController:
        """A rollout controller running `workflow` over `dataset` against this gateway."""
        wf = resolve_workflow(workflow, workflow_kwargs, rollout.group_size, gateway=self.client,
                              agent_config=rollout.agent_config())
        return RolloutController(wf, dataset, rollout, version_fn=version_fn)

    async def aclose(self) -> None:
        """Close the client, stop the gateway, then the engine."""
        await self.client.aclose()
        self.gateway.stop()
        await self.engine.aclose()


class LocalLauncher:
    """Starts a `LocalServices` for the actor's current model and weights."""

    def __init__(self, config: RelayConfig) -> None:
        self.config = config

    async def __call__(self, actor: Actor) -> LocalServices:
        """Engine (with the actor's weights if it has trained), gateway, client."""
        cfg = self.config
        engine = LocalEngine(actor.model_dir(), seed=cfg.seed)
        if actor.version:
            await engine.update_weights(actor.state_dict_for_engine(), version=actor.version)
        gw_cfg = replace(cfg.gateway_config(), model=actor.model_dir(),
                         model_label=cfg.gateway.model_label or cfg.model)
        # the gateway's control routes are off without an admin key: give it one only our own
        # client knows (in memory; nothing else in this process or outside needs it)
        gw_cfg = replace(gw_cfg, admin_key=gw_cfg.admin_key or secrets.token_urlsafe(32))
        gateway = GatewayThread(build_deps(gw_cfg, engine=engine)).start()
        client = SessionClient(gateway.url, admin_key=gw_cfg.admin_key,
                               timeout_s=cfg.rollout.episode_timeout_s)
        return LocalServices(engine, gateway, client)
