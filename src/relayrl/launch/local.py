"""`LocalLauncher`: a run's services from this process: the engine (in-process, or a vLLM/SGLang
server named by `engine:`), the gateway on a loopback thread, the session client the agents'
episodes use, and the rollout controllers. With `gateway.replicas: N`, N in-process engines, each
behind its own gateway, and a session-affine router whose URL the client and the agents use;
each step's weights go to every engine (`relayrl.launch.replicas`).

This is the laptop/CPU default and the reference for other launchers: a launcher is any
callable `await launcher(actor) -> Services` (see `relayrl.train.ports`).

Imports: engine, gateway, client, workflow, rollout, train (ports and actor), config.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from relayrl.client import RunEngine, SessionClient
from relayrl.config import RelayConfig
from relayrl.engine import InferenceEngine, load_engine
from relayrl.engine.local import LocalEngine
from relayrl.errors import ConfigError
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.launch.replicas import (
    AllEngines,
    Replicas,
    engine_threads,
    refuse_replicas,
    start_replicas,
)
from relayrl.remote_rollout.workflow import build_remote_workflow
from relayrl.rollout import RolloutConfig, RolloutController
from relayrl.train.actor import Actor
from relayrl.workflow import AgentConfig, RolloutWorkflow, resolve_workflow, tokenizer_decoder

REMOTE = "remote"
"""`workflow: remote`: episodes run by an external rollout server (the remote rollout protocol); the workflow
kwargs name its `server_url` and options."""


def build_workflow(workflow: Any, workflow_kwargs: dict[str, Any] | None, group_size: int,
                   client: SessionClient, agent_config: AgentConfig) -> RolloutWorkflow:
    """The config's `workflow` as a (grouped) RolloutWorkflow whose agents use `client`."""
    if workflow == REMOTE:
        workflow, workflow_kwargs = build_remote_workflow(workflow_kwargs or {}, client), None
    return resolve_workflow(workflow, workflow_kwargs, group_size, gateway=client,
                            agent_config=agent_config)


class EngineWeights(Protocol):
    """What `start_engine` reads of an actor: the model's directory, and its weights once
    trained (version > 0)."""

    @property
    def version(self) -> int:
        """How many updates the weights have had; 0: the files in `model_dir` as they are."""
        ...

    def model_dir(self) -> str:
        """The model's directory."""
        ...

    def state_dict_for_engine(self) -> Mapping[str, Any]:
        """The current weights, as an engine's `update_weights` takes them."""
        ...


async def start_engine(cfg: RelayConfig, actor: EngineWeights) -> tuple[InferenceEngine, Any]:
    """The engine `cfg.engine` names, serving the actor's weights; and a managed server to stop.

    A remote engine (vLLM, SGLang) must serve the same model: the actor's directory. With
    `kind: vllm` and no url, a vLLM server is started from its venv for this run.
    """
    e = cfg.engine
    managed = None
    if e.kind == "local":
        engine: InferenceEngine = LocalEngine(actor.model_dir(), seed=cfg.seed,
                                              num_threads=e.num_threads,
                                              prefix_cache_mb=e.prefix_cache_mb,
                                              max_prefill_tokens=e.max_prefill_tokens)
    else:
        url = e.url
        if url is None:  # kind vllm without a url: a managed server for this run
            from relayrl.engine.vllm_server import start_vllm_server

            managed = await asyncio.to_thread(start_vllm_server, actor.model_dir())
            url = managed.url
        engine = load_engine(e.kind, actor.model_dir(), url=url)
    if actor.version:
        await engine.update_weights(actor.state_dict_for_engine(), version=actor.version)
    return engine, managed


def check_replica_engines(cfg: RelayConfig) -> None:
    """Raise a clear ConfigError if `gateway.replicas > 1` cannot have one engine per replica."""
    if cfg.gateway.replicas > 1 and cfg.engine.kind != "local":
        raise ConfigError(
            f"gateway.replicas: {cfg.gateway.replicas} needs one engine per replica, and "
            f"engine: {{kind: {cfg.engine.kind}}} names one server (engine.url is a single URL): "
            "use engine.kind: local for replicas, or one gateway per remote engine")


async def start_engines(cfg: RelayConfig, actor: Actor) -> list[InferenceEngine]:
    """One engine per gateway replica (in-process, `check_replica_engines` holds), started one
    after another so two model loads never compete for memory; all closed if one fails."""
    check_replica_engines(cfg)
    engines: list[InferenceEngine] = []
    try:
        for _ in range(cfg.gateway.replicas):
            engine, _managed = await start_engine(cfg, actor)  # local: never a managed server
            engines.append(engine)
    except BaseException:
        for engine in engines:
            await engine.aclose()
        raise
    return engines


def with_admin_key(cfg: RelayConfig) -> RelayConfig:
    """`cfg` with an admin key: the gateway's control routes are off without one, so a run's
    own gateway gets a random key only the run's client knows (in memory, never written)."""
    if cfg.gateway.admin_key:
        return cfg
    return replace(cfg, gateway=replace(cfg.gateway, admin_key=secrets.token_urlsafe(32)))


def serving_gateway_config(cfg: RelayConfig, model_dir: str, *,
                           replicas: bool = False) -> GatewayConfig:
    """The gateway settings for a training run serving the policy in `model_dir`; launchers that
    start `gateway.replicas` of them pass `replicas=True`, the others refuse more than one."""
    if not replicas:
        refuse_replicas(cfg.gateway, "`launcher: ray`")
    # One staleness rule, in one place: the rollout controller counts groups in flight, so
    # a second rule at the gateway (counting sessions) could only refuse the controller's
    # own episodes mid-group.
    return replace(cfg.gateway_config(), model=model_dir, max_staleness=None,
                   model_label=cfg.gateway.model_label or cfg.model)


def rollout_controller(wf: RolloutWorkflow, dataset: Sequence[dict[str, Any]],
                       rollout: RolloutConfig, version_fn: Callable[[], int], cfg: RelayConfig,
                       model_dir: str, engine: RunEngine | None = None) -> RolloutController:
    """A rollout controller running `wf` over `dataset`, with this run's dump settings;
    `engine` is what every `arun_episode` is handed."""
    decode = None
    if rollout.dump_root:  # dumps belong to this run, and are read by people: decode text
        rollout = replace(rollout, experiment=cfg.experiment_name, trial=cfg.trial_name)
        decode = tokenizer_decoder(model_dir)
    return RolloutController(wf, dataset, rollout, version_fn=version_fn, decode=decode,
                             engine=engine)


@dataclass
class LocalServices:
    """The engine, the gateway on loopback, and a session client bound to it (with replicas:
    every engine as one weight sink, and the client bound to the router in front of them)."""

    engine: InferenceEngine | AllEngines
    gateway: GatewayThread
    """The gateway (with replicas: the first one; `replicas` has them all)."""
    client: SessionClient
    config: RelayConfig
    model_dir: str
    managed_server: Any = None
    """A vLLM server started for this run (stopped with the services), or None."""
    replicas: Replicas | None = None
    """With `gateway.replicas > 1`: every gateway and the router the client talks to."""

    @property
    def engine_threads(self) -> int:
        """Torch threads of the engines in this process: the trainer leaves them these cores."""
        return engine_threads(self.engine)

    def batches(self, workflow: Any, workflow_kwargs: dict[str, Any] | None,
                dataset: Sequence[dict[str, Any]], rollout: RolloutConfig,
                version_fn: Callable[[], int]) -> RolloutController:
        """A rollout controller running `workflow` over `dataset` against this gateway."""
        wf = build_workflow(workflow, workflow_kwargs, rollout.group_size, self.client,
                            rollout.agent_config())
        return rollout_controller(wf, dataset, rollout, version_fn, self.config, self.model_dir,
                                  engine=self.run_engine())

    def run_engine(self) -> RunEngine:
        """The engine workflows are handed: this run's engine (with replicas, each request goes
        to the next replica) and its gateway, for direct generation and `DirectClient`."""
        return RunEngine(self.engine, self.client,
                         stop_token_ids=self.gateway.deps.renderer.stop_token_ids,
                         model_dir=self.model_dir)

    async def aclose(self) -> None:
        """Close the client, stop the gateway, then the engine."""
        await self.client.aclose()
        if self.replicas is not None:
            self.replicas.stop()
        else:
            self.gateway.stop()
        await self.engine.aclose()
        if self.managed_server is not None:
            self.managed_server.stop()


class LocalLauncher:
    """Starts a `LocalServices` for the actor's current model and weights."""

    def __init__(self, config: RelayConfig) -> None:
        check_replica_engines(config)  # before any model is loaded
        self.config = with_admin_key(config)

    async def __call__(self, actor: Actor) -> LocalServices:
        """Engine (with the actor's weights if it has trained), gateway, client; with
        `gateway.replicas > 1`, that many engines and gateways behind a router."""
        cfg = self.config
        if cfg.gateway.replicas > 1:
            return await self._replicas(actor)
        engine, managed = await start_engine(cfg, actor)
        gw_cfg = serving_gateway_config(cfg, actor.model_dir())
        gateway = GatewayThread(build_deps(gw_cfg, engine=engine)).start()
        client = SessionClient(gateway.url, admin_key=gw_cfg.admin_key,
                               timeout_s=cfg.rollout.episode_timeout_s)
        return LocalServices(engine, gateway, client, cfg, actor.model_dir(), managed)

    async def _replicas(self, actor: Actor) -> LocalServices:
        cfg = self.config
        engines = await start_engines(cfg, actor)
        sink = AllEngines(engines)
        try:
            gw_cfg = serving_gateway_config(cfg, actor.model_dir(), replicas=True)
            rep = start_replicas(gw_cfg, len(engines), engines=engines)
        except BaseException:
            await sink.aclose()
            raise
        client = SessionClient(rep.url, admin_key=gw_cfg.admin_key,
                               timeout_s=cfg.rollout.episode_timeout_s)
        return LocalServices(sink, rep.gateways[0], client, cfg, actor.model_dir(), None, rep)
