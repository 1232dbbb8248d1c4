"""verifiers environments (`verifiers` 0.4, whose API is `verifiers.v1`) as relayrl episodes, run
by verifiers' own code.

    items = make_items("my-env", taskset={"num_tasks": 64})
    train(cfg, items, workflow="relayrl.envs.verifiers:VerifiersAgent",
          workflow_kwargs={"env_id": "my-env", "taskset": {"num_tasks": 64}})

An installed environment package is loaded by its id the way verifiers loads it
(`vf.resolve_env_config` then `vf.load_environment`: the taskset package exporting its
`Taskset`, and its own `Env` when it ships one). verifiers 0.4 has no `MultiTurnEnv`/`ToolEnv`
classes and no `load_environment(**kwargs)` entry point any more: a tool environment is a task
whose `toolsets` are `vf.Toolset`s of `@vf.tool` functions (served over MCP per rollout), and a
multi-turn environment is an `Env` whose `run` holds an `Interaction` open and answers each
turn. Both run here unchanged.

Each episode is one `env.run_slot` (verifiers' rollout: the harness program, its interception
server, tools, the env's own turn loop, `@vf.reward` functions and judges) whose model client is
an OpenAI-compatible endpoint: the episode's session URL, with the session key as its bearer
token. Every model call of the rollout, every turn and every tool round, is one call on that
session, recorded token-exact by the gateway; a conversation that only grows extends one
segment. The reward is the episode's: the sum of its trainable traces' weighted rewards
(verifiers' rubric scores a trace, one agent's run, never a single call, so there are no
per-call rewards to pass on).

What is switched off, and why: verifiers' training client (`TrainClientConfig`: client-side
tokenization with `renderers` against a vLLM `/inference/v1/generate` endpoint, to get token ids
and logprobs) is not used; the gateway renders and records every call's token ids, logprobs and
weight version itself, so the evaluation client (`EvalClientConfig`) is all an episode needs, and
no sampling extra asking for tokens (`logprobs`, `return_token_ids`) is sent. verifiers' own
retries are refused: a retried attempt's calls would stay in the episode's session and be
trained with the retry's reward (relayrl aborts a failed episode instead).

An item names a task by its position in the taskset (`{"verifiers": {"env_id", "taskset",
"index"}, "prompt"}`); the agent loads the environment once and serves it (interception,
shared tool servers) until `aclose`.

May import: `relayrl.workflow`, `relayrl.errors`; verifiers only inside functions.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import hashlib
import importlib.util
import os
import pkgutil
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from relayrl.errors import ConfigError, EpisodeFailed, InvalidRequest

PIP_INSTALL = "pip install 'verifiers>=0.4,<0.5'"
"""What to run when verifiers is missing (it pins openai<3: give it a venv of its own)."""

INSTALL_SCRIPT = "scripts/install_verifiers.sh"
"""What prepares verifiers' harness program once, at install time (it runs `prepare()`)."""

SPEC_KEY = "verifiers"
"""The item key that names a task: env_id, taskset settings, index."""


def require() -> Any:
    """`verifiers.v1`; ImportError with the pip command when verifiers is not installed."""
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ImportError(f"relayrl.envs.verifiers needs the verifiers package: {PIP_INSTALL} "
                          "(it needs openai<3, so in a venv without relayrl's agent "
                          "frameworks: docs/environments/verifiers.md)") from e
    return vf


def _uv() -> str:
    """The `uv` verifiers will run: on PATH (its own `~/.local/bin` first), else this venv's."""
    search = os.pathsep.join([str(Path.home() / ".local" / "bin"), os.environ.get("PATH", ""),
                              sysconfig.get_path("scripts")])
    uv = shutil.which("uv", path=search)
    if uv is None:
        raise ConfigError(f"verifiers prepares its harness program with uv, which is not "
                          f"installed: run {INSTALL_SCRIPT} (or pip install uv)")
    return uv


def _chat_script() -> Path:
    """Where verifiers' subprocess runtime keeps its chat program (the `null` harness): the
    content-addressed path it writes the PEP 723 script to, so uv finds its environment."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    if not path.exists() or path.read_bytes() != data:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    return path


def _run_uv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_uv(), *args, "--no-config", "-q"], capture_output=True, text=True,
                          timeout=600, check=False)


def prepare() -> Path:
    """Install time: lock and build the environment of verifiers' chat program (fetching its
    dependencies into uv's cache), so that episodes run it offline; the script's path."""
    require()
    path = _chat_script()
    for step in (("lock", "--script", str(path)), ("sync", "--script", str(path))):
        proc = _run_uv(*step)
        if proc.returncode != 0:
            raise RuntimeError(f"uv {step[0]} --script {path} failed: {proc.stderr.strip()}")
    return path


_OFFLINE_READY: set[Path] = set()


def ensure_offline() -> None:
    """Run time: ConfigError naming the install script unless verifiers' chat program is
    prepared (locked, its environment built from uv's cache without the network).

    verifiers runs `uv sync --script` before each process's first rollout with UV_OFFLINE
    forced off; with the lock and the environment in place that step reads nothing from an
    index, and checking here first with `--offline` turns a missing piece into this error
    instead of a download. A user who set UV_OFFLINE to a false value allows the download.
    Puts this venv's uv on PATH when none is there (verifiers would pip-install one)."""
    uv_dir = str(Path(_uv()).parent)
    if shutil.which("uv", path=os.pathsep.join([str(Path.home() / ".local" / "bin"),
                                                os.environ.get("PATH", "")])) is None:
        # verifiers looks for uv on PATH and pip-installs it (a download) when it is missing
        os.environ["PATH"] = os.pathsep.join([uv_dir, os.environ.get("PATH", "")])
    if os.environ.get("UV_OFFLINE", "1").strip().lower() in ("0", "false", "no", "off"):
        return
    path = _chat_script()
    if path in _OFFLINE_READY:
        return
    why = "" if Path(f"{path}.lock").exists() else f"no lock file {path}.lock"
    if not why:
        proc = _run_uv("sync", "--script", str(path), "--offline")
        why = "" if proc.returncode == 0 else proc.stderr.strip()[-1500:]
    if why:
        raise ConfigError(f"verifiers' chat program is not prepared to run offline ({why}); "
                          f"run {INSTALL_SCRIPT} (or `python -m relayrl.envs.verifiers "
                          "--prepare`) once, with the network, to fetch its dependencies "
                          "(or set UV_OFFLINE=0 to let uv download them now)")
    _OFFLINE_READY.add(path)


def _module_name(env_id: str) -> str:
    # verifiers' own rule: hub ids are owner/name@version, installed as the module `name`
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def check_env_id(env_id: str) -> None:
    """ConfigError naming close installed modules when no environment `env_id` is installed."""
    name = _module_name(env_id)
    if (importlib.util.find_spec(f"verifiers.v1.tasksets.{name}") is not None
            or importlib.util.find_spec(name) is not None):
        return
    installed = sorted({m.name for m in pkgutil.iter_modules()})
    close = difflib.get_close_matches(name, installed, n=5, cutoff=0.6)
    hint = (f"did you mean {', '.join(close)}?" if close
            else "install its package first (pip install <package>)")
    raise ConfigError(f"no verifiers environment {env_id!r} is installed (no module {name!r}); "
                      f"{hint}")


def _roles(config_type: Any) -> dict[str, Any]:
    """The env config's agent seats (fields whose default is an `AgentConfig`), by name."""
    vf = require()
    return {name: field.default for name, field in config_type.model_fields.items()
            if isinstance(field.default, vf.AgentConfig)}


def env_config(env_id: str, taskset: Mapping[str, Any] | None = None,
               harness: str = "null", runtime: str = "subprocess",
               env: Mapping[str, Any] | None = None) -> Any:
    """verifiers' `EnvConfig` for an installed environment: its taskset id and settings, each
    agent seat's harness and runtime (where the environment does not pin them), and env-level
    settings (`env`)."""
    vf = require()
    check_env_id(env_id)
    raw: dict[str, Any] = {**dict(env or {}), "taskset": {**dict(taskset or {}), "id": env_id}}
    try:
        config_type = vf.env_config_type(env_id, raw.get("id") or "")
    except (ImportError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"verifiers environment {env_id!r} does not load: {e}") from e
    for name, default in _roles(config_type).items():
        seat = dict(raw.get(name) or {})
        if default.harness is None:  # the env leaves the harness to the run
            seat.setdefault("harness", {"id": harness})
        if default.runtime.type == "prime":  # AgentConfig's own default: a remote sandbox
            seat.setdefault("runtime", {"type": runtime})
        raw[name] = seat
    try:
        config = vf.resolve_env_config(raw)
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        raise ConfigError(f"verifiers environment {env_id!r}: {e}") from e
    _refuse_retries(env_id, config)
    return config


def _refuse_retries(env_id: str, config: Any) -> None:
    """ConfigError when verifiers would retry an episode or an agent run: the failed attempt's
    calls would stay in the episode's session and be trained with the retry's reward."""
    seats = {"env": config.retries, **{name: seat.retries for name, seat in config
                                      if isinstance(seat, require().AgentConfig)}}
    retried = [name for name, r in seats.items() if r.max_retries or r.rules]
    if retried:
        raise ConfigError(f"verifiers environment {env_id!r}: retries are set ({', '.join(retried)})"
                          "; relayrl aborts a failed episode instead (a retried attempt's calls "
                          "would be trained with the retry's reward): leave retries unset")


def load_env(env_id: str, taskset: Mapping[str, Any] | None = None, harness: str = "null",
             runtime: str = "subprocess", env: Mapping[str, Any] | None = None) -> Any:
    """The environment, loaded by verifiers (`vf.load_environment`)."""
    vf = require()
    return vf.load_environment(env_config(env_id, taskset, harness, runtime, env))


def make_items(env_id: str, taskset: Mapping[str, Any] | None = None,
               limit: int | None = None,
               env: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """One item per task of the environment's taskset (the first `limit`); `env` as the
    agent's env-level settings."""
    tasks = _tasks(load_env(env_id, taskset, env=env), limit)
    spec = {"env_id": env_id, "taskset": dict(taskset or {})}
    return [{SPEC_KEY: {**spec, "index": i}, "prompt": _prompt_text(t)}
            for i, t in enumerate(tasks)]


def _tasks(env: Any, limit: int | None) -> list[Any]:
    taskset = env.taskset
    if limit is not None:
        taskset = taskset.take(limit)
    elif not taskset.bounded:
        raise ConfigError(f"{type(env.taskset).__name__} is infinite: give a limit")
    return list(taskset)


def _prompt_text(task: Any) -> str:
    return str(task.data.prompt_text)  # a Messages prompt: its messages' text


ENV_KEYS = frozenset({"env_id", "taskset", "harness", "runtime", "env", "limit"})
"""What one entry of `VerifiersAgent(envs=[...])` may set."""


class VerifiersAgent:
    """Runs one task of an installed verifiers environment per episode; returns its reward.

    One environment (`env_id` and its settings), or several (`envs`: a list of `{env_id,
    taskset, harness, runtime, env, limit}`, unset keys taken from the agent's own arguments),
    each item running in the environment its `env_id` names: a mix of environments trained in
    one run."""

    def __init__(self, env_id: str | None = None, taskset: Mapping[str, Any] | None = None,
                 harness: str = "null", runtime: str = "subprocess",
                 env: Mapping[str, Any] | None = None, model: str = "default",
                 max_tokens: int | None = 256, temperature: float | None = 1.0,
                 limit: int | None = None,
                 envs: Sequence[Mapping[str, Any]] | None = None) -> None:
        if (env_id is None) == (envs is None):
            raise ConfigError("give env_id (one verifiers environment) or envs (a list of "
                              "{env_id, taskset, ...}), not both or neither")
        entries = ([{"env_id": env_id}] if envs is None else [dict(e) for e in envs])
        if not entries:
            raise ConfigError("envs: give at least one {env_id: ...}")
        self.settings: dict[str, dict[str, Any]] = {}
        for entry in entries:
            unknown = set(entry) - ENV_KEYS
            if unknown or not isinstance(entry.get("env_id"), str):
                raise ConfigError(f"an environment entry takes env_id (required) and "
                                  f"{sorted(ENV_KEYS - {'env_id'})}; got {sorted(entry)}")
            spec = {"taskset": dict(taskset or {}), "harness": harness, "runtime": runtime,
                    "env": dict(env or {}), "limit": limit, **entry}
            if not isinstance(spec["harness"], str) or not spec["harness"]:
                raise ConfigError(f"harness: give a verifiers harness id, got "
                                  f"{spec['harness']!r} (for the chat loop write \"null\" in "
                                  "quotes: YAML reads null as none)")
            if spec["env_id"] in self.settings:
                raise ConfigError(f"envs: {spec['env_id']!r} is listed twice")
            self.settings[spec.pop("env_id")] = spec
        self.env_id = next(iter(self.settings))
        self.model = model
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.configs = {eid: env_config(eid, s["taskset"], s["harness"], s["runtime"], s["env"])
                        for eid, s in self.settings.items()}
        self._served: dict[str, tuple[Any, list[Any]]] = {}
        self._stack: contextlib.AsyncExitStack | None = None
        self._lock: asyncio.Lock | None = None
        self._episodes = 0
        self._failed = 0
        self._turns = 0

    def __getstate__(self) -> dict[str, Any]:
        # subprocess mode pickles the agent: each worker loads and serves its own environments
        return {**self.__dict__, "_served": {}, "_stack": None, "_lock": None}

    async def _serving(self, env_id: str | None = None) -> tuple[Any, list[Any]]:
        """The environment `env_id` (the first by default) and its tasks, serving
        (interception, shared tools) until `aclose`."""
        env_id = env_id or self.env_id
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if env_id not in self._served:
                vf = require()
                config = self.configs[env_id]
                if any(seat.runtime.type == "subprocess" for _, seat in config
                       if isinstance(seat, vf.AgentConfig)):
                    ensure_offline()  # the harness program runs here: from uv's cache
                env = vf.load_environment(self.configs[env_id])
                if self._stack is None:
                    self._stack = contextlib.AsyncExitStack()
                await self._stack.enter_async_context(env.serving())
                self._served[env_id] = (env, _tasks(env, self.settings[env_id]["limit"]))
        return self._served[env_id]

    def model_context(self, base_url: str, api_key: str) -> Any:
        """verifiers' model context for one episode: the session URL, its key, the sampling."""
        vf = require()
        from verifiers.v1.configs.client import EvalClientConfig

        # The key travels as a header, not through api_key_var: one process-wide variable
        # cannot hold a different key for each concurrent episode.
        client = EvalClientConfig(base_url=base_url, api_key_var="RELAYRL_SESSION_KEY_UNUSED",
                                  headers={"Authorization": f"Bearer {api_key}"})
        sampling = vf.SamplingConfig(max_tokens=self.max_tokens, temperature=self.temperature)
        return vf.ModelContext(model=self.model, client=client, sampling=sampling)

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        """One verifiers rollout of the task `data` names; the episode's reward."""
        spec = data.get(SPEC_KEY)
        if not isinstance(spec, Mapping) or "index" not in spec:
            raise InvalidRequest(f"a verifiers item needs {SPEC_KEY!r} with an index (from "
                                 f"make_items); got keys {sorted(data)}")
        env_id = spec.get("env_id", self.env_id)
        if env_id not in self.settings:
            raise InvalidRequest(f"the item is a task of {env_id!r}, this agent runs "
                                 f"{', '.join(map(repr, self.settings))}")
        env, tasks = await self._serving(env_id)
        index = int(spec["index"])
        if not 0 <= index < len(tasks):
            raise InvalidRequest(f"task index {index} outside the taskset's {len(tasks)} tasks")
        base_url = extra_kwargs.get("base_url") or os.environ["OPENAI_BASE_URL"]
        ctx = self.model_context(base_url, extra_kwargs.get("api_key")
                                 or os.environ["OPENAI_API_KEY"])
        slot = env.slots(tasks[index], 1)[0]
        episode = await env.run_slot(slot, ctx)
        self._episodes += 1
        if not episode.ok or not episode.traces:
            # a harness, tool or scorer failure is not a wrong answer: abort, never score 0
            self._failed += 1
            errors = "; ".join(f"{e.type}: {e.message}" for e in episode.errors[-3:])
            for trace in episode.traces:
                if trace.last_error is not None:
                    err = trace.last_error
                    errors += f"; {trace.agent.name}: {err.type}: {err.message[-500:]}"
            raise EpisodeFailed(f"verifiers episode of {env_id!r} task {index} failed: "
                                f"{errors.strip('; ') or 'no trace'}")
        self._turns += sum(trace.num_turns for trace in episode.traces)
        return episode_reward(episode, base_url, env_id)

    def counters(self) -> dict[str, float]:
        """Episodes run and failed, and the model turns of the finished ones."""
        return {"episodes": self._episodes, "failed_episodes": self._failed,
                "model_turns": self._turns}

    async def aclose(self) -> None:
        """Stop serving the environment (interception server, shared tool servers)."""
        if self._stack is not None:
            stack, self._stack, self._served = self._stack, None, {}
            await stack.aclose()


def episode_reward(episode: Any, base_url: str, env_id: str) -> float:
    """The reward of a finished verifiers episode: its trainable traces' rewards, summed.

    A seat the environment marks untrainable (a simulated user, a judge agent) whose calls went
    to the episode's session would put another model's turns into the policy's rows: that
    episode fails with the seat to pin to its own client."""
    leaked = [t.agent.name for t in episode.traces if not t.agent.trainable and t.num_turns
              and _client_url(t) == base_url.rstrip("/")]
    if leaked:
        raise EpisodeFailed(f"verifiers environment {env_id!r}: the untrainable seat(s) "
                            f"{', '.join(sorted(set(leaked)))} called the policy's session; give "
                            "each its own model endpoint (env: {<seat>: {client: {base_url: "
                            "..., api_key_var: ...}}}) so only the policy's calls are trained")
    trainable = [t for t in episode.traces if t.agent.trainable]
    return float(sum(t.reward for t in trainable))


def _client_url(trace: Any) -> str | None:
    client = getattr(trace.agent.config, "client", None)
    url = getattr(client, "base_url", None)
    return url.rstrip("/") if isinstance(url, str) else None


if __name__ == "__main__":
    if sys.argv[1:] != ["--prepare"]:
        sys.exit("usage: python -m relayrl.envs.verifiers --prepare")
    print(f"prepared verifiers' chat program offline: {prepare()}")
