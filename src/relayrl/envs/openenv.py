"""OpenEnv environments as relayrl episodes: an environment server's reset/step loop, driven by
the policy through its gateway session.

    train(cfg, items, workflow="relayrl.envs.openenv:OpenEnvAgent",
          workflow_kwargs={"server_url": "http://127.0.0.1:8001"})        # a running server
    train(cfg, items, workflow="relayrl.envs.openenv:OpenEnvAgent",
          workflow_kwargs={"environment": "guess_env:GuessEnvironment"})  # served by relayrl

`OpenEnvAgent` is an ordinary agent (one gateway session per episode). Per episode it opens an
OpenEnv session with OpenEnv's own client (`GenericEnvClient`, over the server's WebSocket), calls
`reset` (with the item's `seed` and `reset` kwargs), and then, turn by turn, shows the policy the
observation as a user message, sends its reply as the action's text field and `step`s, until the
environment says `done` (or `max_turns`). The conversation grows turn by turn, so the session's
calls form one path and the run's credit rule sees the whole episode.

Rewards: each step's reward goes on the call whose reply was that step's action; a step without
one (None) adds nothing. A delayed reward (None until the last step) therefore sits on the last
call, and the credit rule spreads it back: under the default `discount` rule with `discount: 1.0`
every call of the episode is credited with the sum of the rewards from its turn on.

`environment="module:Class"` names an OpenEnv `Environment` subclass; relayrl serves it with
OpenEnv's own `create_app` on 127.0.0.1 (a free port, in a background thread) for the process's
life, so an environment that is a Python package needs no Docker. Its action and observation
classes come from the type hints of its `step` (or `action=` / `observation=`).

May import: `relayrl.errors`, `relayrl.asgi`; openenv, openai and uvicorn only inside functions,
never torch.
"""

from __future__ import annotations

import difflib
import importlib
import json
import math
import threading
import time
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from relayrl.errors import ConfigError, EpisodeFailed

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

PIP_INSTALL = "pip install 'openenv>=0.10,<0.11' openai"
"""What to run when OpenEnv (or the OpenAI SDK the policy is asked through) is missing."""

_RESERVED = {"metadata"}
"""Action fields OpenEnv adds to every action: never the policy's text."""
_OBSERVATION_BOOKKEEPING = {"done", "reward", "metadata"}


def require() -> Any:
    """OpenEnv's client module; ImportError with the pip command when it is not installed."""
    try:
        import openenv.core
    except ImportError as e:
        raise ImportError(f"relayrl.envs.openenv needs the openenv package: {PIP_INSTALL} "
                          "(or pip install 'relayrl[openenv]')") from e
    return openenv.core


def load_environment(path: str) -> type:
    """The `Environment` subclass `module:Class` names; ConfigError naming close ones if none."""
    require()
    from openenv.core.env_server.interfaces import Environment

    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr or not sep:
        raise ConfigError(f"environment {path!r} is not of the form 'module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"environment {path!r}: cannot import {module_name!r} ({e})") from e
    found = getattr(module, attr, None)
    if not (isinstance(found, type) and issubclass(found, Environment)):
        names = [n for n, v in vars(module).items()
                 if isinstance(v, type) and issubclass(v, Environment) and v is not Environment]
        close = difflib.get_close_matches(attr, names, n=5, cutoff=0.4) or names[:5]
        hint = f"its environments: {', '.join(close)}" if close else "it defines none"
        what = "no" if found is None else "not an OpenEnv Environment:"
        raise ConfigError(f"environment {path!r}: {module_name!r} has {what} {attr!r}; {hint}")
    return found


def step_types(env_cls: type[Any]) -> tuple[type, type]:
    """(action class, observation class) from the type hints of `env_cls.step`."""
    from openenv.core.env_server.types import Action, Observation

    hints = typing.get_type_hints(env_cls.step)
    action, observation = hints.get("action"), hints.get("return")
    if not (isinstance(action, type) and issubclass(action, Action)
            and isinstance(observation, type) and issubclass(observation, Observation)):
        raise ConfigError(f"{env_cls.__qualname__}.step has no Action / Observation type hints; "
                          "name them with action='module:Class' and observation='module:Class'")
    return action, observation


class EnvironmentServer:
    """An OpenEnv environment served by OpenEnv's `create_app` on 127.0.0.1, in a thread."""

    def __init__(self, env_cls: type, action_cls: type, observation_cls: type,
                 max_concurrent_envs: int = 64) -> None:
        import uvicorn
        from openenv.core.env_server.http_server import create_app

        from relayrl.asgi import uvicorn_options

        app = create_app(env_cls, action_cls, observation_cls, env_name=env_cls.__name__,
                         max_concurrent_envs=max_concurrent_envs)
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                **uvicorn_options())
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The server's root URL."""
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def start(self, timeout_s: float = 30.0) -> EnvironmentServer:
        """Start serving; return once the socket listens."""
        self._thread = threading.Thread(target=self.server.run, name="relayrl-openenv",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the OpenEnv environment server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving and wait for the thread."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> EnvironmentServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _import_class(path: str, what: str) -> type:
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{what} {path!r} cannot be imported ({e})") from e
    if not isinstance(found, type):
        raise ConfigError(f"{what} {path!r} is not a class")
    return found


class OpenEnvAgent:
    """Plays an OpenEnv environment's episode with the policy; rewards from the environment."""

    def __init__(self, server_url: str | None = None, environment: str | None = None, *,
                 action: str | None = None, observation: str | None = None,
                 action_field: str | None = None, observation_field: str | None = None,
                 system_prompt: str | None = None, model: str = "default",
                 max_tokens: int = 64, temperature: float = 1.0, max_turns: int = 16) -> None:
        require()
        try:
            import openai  # noqa: F401  (the policy's SDK: checked before any episode runs)
        except ImportError as e:
            raise ImportError(f"relayrl.envs.openenv needs the openai package: "
                              f"{PIP_INSTALL}") from e
        if (server_url is None) == (environment is None):
            raise ConfigError("name one of server_url (a running OpenEnv server) or "
                              "environment ('module:Class', served by relayrl)")
        if max_tokens < 1 or max_turns < 1:
            raise ConfigError("need max_tokens >= 1 and max_turns >= 1")
        self.server_url = server_url.rstrip("/") if server_url else None
        self.environment = environment
        self._action_path, self._observation_path = action, observation
        if environment is not None:
            env_cls = load_environment(environment)  # a bad name fails before any episode
            if action is None or observation is None:
                hinted = step_types(env_cls)
                self._action_path = action or f"{hinted[0].__module__}:{hinted[0].__qualname__}"
                self._observation_path = (observation
                                          or f"{hinted[1].__module__}:{hinted[1].__qualname__}")
        self.action_field = action_field
        self.observation_field = observation_field
        self.system_prompt = system_prompt
        self.model = model
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.max_turns = max_turns
        self._server: EnvironmentServer | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # subprocess mode pickles the agent: each worker serves its own environment
        return {**self.__dict__, "_server": None, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def url(self) -> str:
        """The environment server's URL (starting relayrl's own server on first use)."""
        if self.server_url is not None:
            return self.server_url
        with self._lock:
            if self._server is None:
                assert self.environment is not None
                env_cls = load_environment(self.environment)
                action_cls = _import_class(str(self._action_path), "action")
                observation_cls = _import_class(str(self._observation_path), "observation")
                self._server = EnvironmentServer(env_cls, action_cls, observation_cls).start()
            return self._server.url

    def close(self) -> None:
        """Stop relayrl's own environment server, if it started one."""
        if self._server is not None:
            self._server.stop()
            self._server = None

    async def _action_field(self, url: str) -> str:
        """The action's text field: `action_field`, else the only string field `/schema` names."""
        if self.action_field is not None:
            return self.action_field
        import httpx

        async with httpx.AsyncClient(timeout=30.0) as c:
            r = await c.get(f"{url}/schema")
        if r.status_code != 200:
            raise ConfigError(f"{url}/schema answered {r.status_code}; name the action's text "
                              "field with action_field=...")
        props = r.json().get("action", {}).get("properties", {})
        text = [k for k, v in props.items() if k not in _RESERVED and v.get("type") == "string"]
        if len(text) != 1:
            raise ConfigError(f"the environment's action has fields {sorted(props)}; name the "
                              "one the policy's reply goes into with action_field=...")
        self.action_field = text[0]
        return text[0]

    def render(self, observation: Any) -> str:
        """The observation as the user message: one field, or the fields as JSON."""
        if isinstance(observation, Mapping):
            if self.observation_field is not None:
                if self.observation_field not in observation:
                    raise EpisodeFailed(f"the observation has no field "
                                        f"{self.observation_field!r}; it has "
                                        f"{sorted(observation)}")
                return str(observation[self.observation_field])
            shown = {k: v for k, v in observation.items() if k not in _OBSERVATION_BOOKKEEPING}
            return json.dumps(shown, ensure_ascii=False)
        return str(observation)

    async def run(self, data: dict[str, Any], *, base_url: str, api_key: str,
                  http_client: Any = None, **_: Any) -> dict[str, float] | None:
        """One episode: reset, then ask, step, until done; rewards per call id."""
        from openai import AsyncOpenAI
        from openenv.core import GenericEnvClient

        url = self.url()
        field = await self._action_field(url)
        llm = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client,
                          max_retries=0)
        reset_kwargs = dict(data.get("reset") or {})
        if data.get("seed") is not None:
            reset_kwargs.setdefault("seed", int(data["seed"]))
        messages: list[ChatCompletionMessageParam] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        rewards: dict[str, float] = {}
        last_call: str | None = None
        try:
            async with GenericEnvClient(base_url=url) as env:
                result = await env.reset(**reset_kwargs)
                prefix = f"{data['prompt']}\n\n" if data.get("prompt") else ""
                for _turn in range(self.max_turns):
                    if result.done:
                        break
                    messages.append({"role": "user",
                                     "content": prefix + self.render(result.observation)})
                    prefix = ""
                    completion = await llm.chat.completions.create(
                        model=self.model, messages=messages, max_tokens=self.max_tokens,
                        temperature=self.temperature)
                    reply = completion.choices[0].message.content or ""
                    messages.append({"role": "assistant", "content": reply})
                    last_call = completion.id
                    result = await env.step({field: reply})
                    if result.reward is not None:
                        reward = float(result.reward)
                        if not math.isfinite(reward):
                            raise EpisodeFailed(f"the environment gave a reward of {reward}")
                        rewards[completion.id] = rewards.get(completion.id, 0.0) + reward
        finally:
            if http_client is None:
                await llm.close()
        if last_call is None:
            return None  # done at reset: no call to train on
        return rewards or {last_call: 0.0}
