"""`RayLauncher` (`launcher: ray`): a run's services placed on a Ray cluster.

- The engine and the gateway live in one Ray actor process (`GatewayEngineHost`): the engine
  the config names (LocalEngine, or a client of a vLLM/SGLang server) and the gateway on a
  loopback thread of that process. The trainer pushes new weights through `RayWeightSink`, which
  puts the state dict in Ray's object store and hands the actor its reference.
- Each agent episode's `run` is a Ray task (`RayAgentWorkflow`): the session is opened and
  exported by the driver, as with every launcher, and the task gets only the gateway's URL and
  the session's key (`base_url`, `api_key`, and `OPENAI_BASE_URL` / `OPENAI_API_KEY` set in its
  environment), so the agent's own SDK calls reach the gateway from the worker process.
- A `RolloutWorkflow` runs in the driver; the `RunEngine` its episodes are handed sends direct
  generation requests to the actor's engine (`RayEngine`) and opens `DirectClient` sessions on
  the actor's gateway.
- The trainer (the `Actor`, its optimizer and the loop) stays in the driver process: on one node
  that *is* its placement; it owns the only copy of the trainable weights and needs no actor.

Ray is optional (`pip install relayrl[ray]`): it is imported when a launcher starts, never at
import time. With `RAY_ADDRESS` set the launcher joins that cluster (`ray start --head`);
otherwise it starts a private one on this machine and shuts it down with the services.

Imports: ray (lazily), engine, gateway, client, workflow, rollout, train (actor), config, and
`relayrl.launch.local`.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from relayrl.client import RunEngine, SessionClient
from relayrl.client.session_client import SessionHandle
from relayrl.config import RelayConfig
from relayrl.errors import ConfigError, EpisodeFailed
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.launch.local import (
    REMOTE,
    build_workflow,
    rollout_controller,
    serving_gateway_config,
    start_engine,
    with_admin_key,
)
from relayrl.rollout import RolloutConfig, RolloutController
from relayrl.train.actor import Actor
from relayrl.types import GenerateOutput, GenerateRequest, TokenChunk
from relayrl.workflow import AgentConfig, RolloutWorkflow, resolve_workflow
from relayrl.workflow.agent import AgentMode, AgentWorkflow, has_run
from relayrl.workflow.resolve import import_dotted


def _require_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ConfigError("launcher: ray needs Ray: pip install 'relayrl[ray]'") from e
    return ray


# -- the gateway + engine actor ------------------------------------------------------------------

@dataclass(frozen=True)
class _ModelAt:
    """What `start_engine` reads of an actor, for a process that holds only the model's files."""

    path: str
    version: int = 0

    def model_dir(self) -> str:
        """The model's directory."""
        return self.path

    def state_dict_for_engine(self) -> dict[str, Any]:
        """Never read: at version 0 the engine serves the directory's weights."""
        raise RuntimeError("this process holds only the model's files, no trained weights")


class GatewayEngineHost:
    """The body of the Ray actor that serves the policy: an engine and a gateway on loopback."""

    def __init__(self, config: RelayConfig, model_dir: str) -> None:
        self.config = config
        self.model_dir = model_dir
        self.engine: Any = None
        self.gateway: GatewayThread | None = None
        self.managed: Any = None

    async def start(self) -> dict[str, Any]:
        """Start the engine and the gateway; their URL and this process's id."""
        self.engine, self.managed = await start_engine(self.config, _ModelAt(self.model_dir))
        gw_cfg = serving_gateway_config(self.config, self.model_dir)
        self.gateway = GatewayThread(build_deps(gw_cfg, engine=self.engine)).start()
        return {"url": self.gateway.url, "pid": os.getpid(),
                "context_length": int(self.engine.context_length),
                "stop_token_ids": list(self.gateway.deps.renderer.stop_token_ids)}

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """A workflow's direct request (`RunEngine.generate`), sampled by this actor's engine."""
        return await self.engine.generate(request)

    async def update_weights(self, weights: Mapping[str, Any], version: int) -> int:
        """Load `weights` into the engine (Ray has resolved the object reference already)."""
        return await self.engine.update_weights(weights, version=version)

    async def version(self) -> int:
        """The engine's current weight version."""
        return int(self.engine.version)

    async def aclose(self) -> None:
        """Stop the gateway, then the engine (and a managed server); idempotent."""
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None
        if self.engine is not None:
            await self.engine.aclose()
            self.engine = None
        if self.managed is not None:
            self.managed.stop()
            self.managed = None


class RayEngine:
    """The engine in the Ray actor as workflows call it: each request goes to the actor."""

    def __init__(self, host: Any, sink: RayWeightSink, context_length: int) -> None:
        self.host = host
        self.sink = sink
        self.context_length = context_length

    @property
    def version(self) -> int:
        """The version the actor's engine was last given (the trainer's latest)."""
        return self.sink.version

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Sample a whole completion in the actor."""
        output: GenerateOutput = await self.host.generate.remote(request)
        return output

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """The whole completion as one chunk (Ray hands back results, not streams)."""
        out = await self.generate(request)
        yield TokenChunk(out.output_ids, out.logprobs, out.versions, out.top_logprobs,
                         out.finish_reason, out.stop_string, out.timings)


class RayWeightSink:
    """The trainer's `WeightSink` for an engine in a Ray actor: weights go by the object store."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self.version = 0

    async def update_weights(self, weights: Mapping[str, Any], version: int) -> int:
        """Put the state dict in the object store and have the actor load it."""
        ray = _require_ray()
        # `ray.put` copies now: the trainer may change its tensors as soon as this returns
        ref = await asyncio.to_thread(ray.put, dict(weights))
        self.version = await self.host.update_weights.remote(ref, version)
        return self.version


# -- agents' episodes as Ray tasks ----------------------------------------------------------------

def agent_task() -> Callable[[bytes, Any, str, str], Any]:
    """The function a Ray worker runs for one episode: `agent.run(data, base_url, api_key)`.

    Made here, not defined at module level, so that Ray ships it by value: a worker then imports
    only the agent's own modules, not relayrl's (torch, transformers: many seconds each start).
    """
    def run_agent(agent_bytes: bytes, data: Any, base_url: str, api_key: str) -> Any:
        # one task at a time per worker process, so the environment is this episode's alone
        os.environ.update({"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key})
        agent = pickle.loads(agent_bytes)
        out = agent.run(data, base_url=base_url, api_key=api_key)
        if inspect.isawaitable(out):
            async def _await() -> Any:
                return await out

            out = asyncio.run(_await())
        return out

    return run_agent


class RayAgentWorkflow(AgentWorkflow):
    """`AgentWorkflow` whose agent `run`s in a Ray worker process, one task per episode.

    The session's lifecycle (capacity wait, start, rewards, end, export, release on failure)
    is the agent workflow's own and happens in the driver; only the agent's code moves. The
    agent may be sync or async and must pickle (it is pickled once, up front).
    """

    def __init__(self, agent: Any, client: SessionClient, config: AgentConfig | None = None,
                 *, num_cpus: float = 1.0) -> None:
        # subprocess mode's checks (pickled up front, sync `run` allowed); its pool stays unused
        super().__init__(agent, client, replace(config or AgentConfig(),
                                                mode=AgentMode.SUBPROCESS))
        self._pool = None
        self._task: Any = None
        self.num_cpus = num_cpus

    async def _run_agent(self, session: SessionHandle, data: dict[str, Any]) -> Any:
        ray = _require_ray()
        if self._task is None:
            self._task = ray.remote(num_cpus=self.num_cpus, max_retries=0)(agent_task())
        ref = self._task.remote(self._agent_bytes, data, session.base_url, session.api_key)
        try:
            return await ref
        except asyncio.CancelledError:
            ray.cancel(ref, force=True)  # a timed-out episode frees its worker
            raise
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(e.cause, BaseException) else e
            raise EpisodeFailed(f"agent {type(self.agent).__qualname__} failed in a Ray worker: "
                                f"{type(cause).__name__}: {cause}") from e
        except ray.exceptions.RayError as e:
            raise EpisodeFailed(f"the Ray task running agent {type(self.agent).__qualname__} "
                                f"failed: {type(e).__name__}: {e}") from e


def build_ray_workflow(workflow: Any, workflow_kwargs: dict[str, Any] | None, group_size: int,
                       client: SessionClient, agent_config: AgentConfig) -> RolloutWorkflow:
    """The config's `workflow`, with an agent's `run` placed in Ray workers.

    A `RolloutWorkflow` (not an agent) runs in the driver as with the local launcher: it is
    the rollout code itself, and its episodes reach the gateway through `client`.
    """
    if workflow == REMOTE:  # a remote rollout server runs the agents: nothing to place
        return build_workflow(workflow, workflow_kwargs, group_size, client, agent_config)
    obj, kwargs = workflow, dict(workflow_kwargs or {})
    if isinstance(obj, str):
        obj = import_dotted(obj)
    if isinstance(obj, type) and not issubclass(obj, RolloutWorkflow) and has_run(obj):
        try:
            obj = obj(**kwargs)
        except TypeError as e:
            raise ConfigError(f"cannot build {obj.__qualname__} with kwargs {sorted(kwargs)}: "
                              f"{e}") from e
        kwargs = {}
    if has_run(obj) and not isinstance(obj, RolloutWorkflow):
        if kwargs:
            raise ConfigError(f"kwargs {sorted(kwargs)} were given with an instance of "
                              f"{type(obj).__qualname__}; pass the class to have them used")
        obj = RayAgentWorkflow(obj, client, agent_config)
    return resolve_workflow(obj, kwargs or None, group_size, gateway=client,
                            agent_config=agent_config)


# -- services and launcher ------------------------------------------------------------------------

@dataclass
class RayServices:
    """The gateway+engine actor, a session client bound to its gateway, and the Ray session."""

    engine: RayWeightSink
    host: Any
    client: SessionClient
    config: RelayConfig
    model_dir: str
    gateway_url: str
    host_pid: int
    owns_ray: bool = False
    """Whether the launcher connected to Ray (and so these services disconnect, stopping a
    private Ray)."""
    closed_version: int | None = field(default=None)
    """The engine's weight version when the services were closed."""
    context_length: int = 0
    """The actor's engine's context length (for workflows' direct requests)."""
    stop_token_ids: tuple[int, ...] = ()
    """The model's end-of-turn ids (added to workflows' direct requests, as the gateway does)."""

    def batches(self, workflow: Any, workflow_kwargs: dict[str, Any] | None,
                dataset: Sequence[dict[str, Any]], rollout: RolloutConfig,
                version_fn: Callable[[], int]) -> RolloutController:
        """A rollout controller whose agents run as Ray tasks against the actor's gateway."""
        wf = build_ray_workflow(workflow, workflow_kwargs, rollout.group_size, self.client,
                                rollout.agent_config())
        engine = RunEngine(RayEngine(self.host, self.engine, self.context_length), self.client,
                           stop_token_ids=self.stop_token_ids, model_dir=self.model_dir)
        return rollout_controller(wf, dataset, rollout, version_fn, self.config, self.model_dir,
                                  engine=engine)

    async def aclose(self) -> None:
        """Close the client, stop the actor's gateway and engine, end the actor and Ray."""
        ray = _require_ray()
        await self.client.aclose()
        try:
            self.closed_version = await self.host.version.remote()
            await self.host.aclose.remote()
        finally:
            ray.kill(self.host)
            if self.owns_ray:
                ray.shutdown()


def init_ray(num_cpus: int | None = None, object_store_memory: int | None = None) -> bool:
    """Join `RAY_ADDRESS`, or start a private Ray here; whether this call connected (and so
    the caller disconnects with `ray.shutdown`, which stops a private Ray).

    Workers import agents by module path, so they get the driver's import path (which holds the
    config's folder, see `add_import_path`) as their `PYTHONPATH`.
    """
    ray = _require_ray()
    if ray.is_initialized():
        return False
    paths = [os.path.abspath(p or os.curdir) for p in sys.path]  # "": the driver's cwd
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(p for p in paths if os.path.isdir(p)))}
    address = os.environ.get("RAY_ADDRESS")
    if address:
        # `ray.shutdown` later only disconnects: a cluster started elsewhere outlives the run
        ray.init(address=address, runtime_env={"env_vars": env})
        return True
    # A private Ray would report usage statistics to Ray's servers: relayrl reaches nothing but
    # loopback at run time (and where that report cannot get out, start-up waits on it). A user's
    # own setting of the variable wins.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's memory monitor kills a worker when the whole machine is nearly full, counting every
    # other process's memory too: on a shared machine it killed this run's engine host while
    # the kernel still had room. A private Ray leaves running out of memory to the kernel.
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1,
             object_store_memory=object_store_memory, include_dashboard=False,
             runtime_env={"env_vars": env})
    return True


class RayLauncher:
    """Starts `RayServices`: joins `RAY_ADDRESS` if set, else a private loopback Ray."""

    def __init__(self, config: RelayConfig, *, num_cpus: int | None = None,
                 object_store_memory: int | None = None) -> None:
        self.config = with_admin_key(config)
        self.num_cpus = num_cpus
        self.object_store_memory = object_store_memory
        self.last_services: RayServices | None = None
        """The services of the latest launch (for inspection after a run)."""

    async def __call__(self, actor: Actor) -> RayServices:
        """Ray, the gateway+engine actor (with the actor's weights if it has trained), client."""
        ray = _require_ray()
        cfg = self.config
        owns = await asyncio.to_thread(init_ray, self.num_cpus, self.object_store_memory)
        host = None
        try:
            host = ray.remote(num_cpus=0)(GatewayEngineHost).remote(cfg, actor.model_dir())
            started = await host.start.remote()
            sink = RayWeightSink(host)
            if actor.version:
                await sink.update_weights(actor.state_dict_for_engine(), actor.version)
        except BaseException:
            if host is not None:
                ray.kill(host)
            if owns:
                ray.shutdown()
            raise
        client = SessionClient(started["url"], admin_key=cfg.gateway_config().admin_key,
                               timeout_s=cfg.rollout.episode_timeout_s)
        self.last_services = RayServices(sink, host, client, cfg, actor.model_dir(),
                                         started["url"], started["pid"], owns,
                                         context_length=started["context_length"],
                                         stop_token_ids=tuple(started["stop_token_ids"]))
        return self.last_services
