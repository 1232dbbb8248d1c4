"""NeMo Gym resources servers as relayrl episodes, run by NeMo Gym's own agent server.

    train(cfg, items, workflow="relayrl.envs.nemo_gym:NeMoGymAgent",
          workflow_kwargs={"server": "equivalence_rule",
                           "server_config": {"grading_rule": "seq_match"}})

NeMo Gym (PyPI `nemo-gym`) needs Python >= 3.12 and pins its own openai, so it lives in a venv of
its own (`bash scripts/install_nemo_gym.sh` makes `.venv-nemo-gym`); relayrl never imports it.
`NeMoGymAgent` starts, with that venv's python, on 127.0.0.1:

- the resources server (`resources_servers/<server>/app.py` of the installed package, or the
  folder of a server of your own): `/seed_session`, its tool endpoints, `/verify`;
- NeMo Gym's agent server (`responses_api_agents/<agent>/app.py`, `simple_agent` by default):
  `/run` seeds the session, runs the model/tool loop and calls `/verify`;
- and, in relayrl's process, the model server the agent server is given: a loopback relay that
  passes each `/v1/responses` call on to the episode's gateway session.

Each server is started the way NeMo Gym's `ng_run` starts it (`python app.py` in the server's
folder, the global config in `NEMO_GYM_CONFIG_DICT`, its name in `NEMO_GYM_CONFIG_PATH`), with
two differences: the venv's python instead of a per-server uv venv (no install at start), and no
Ray cluster (these servers do not use one; `ray: true` keeps NeMo Gym's `initialize_ray`).

An item is one line of a NeMo Gym dataset (`{"responses_create_params": {...}, ...}`, the body of
`/run`; `make_items` reads a server's shipped one). Per episode the agent posts it to `/run` with
`metadata.relayrl_episode` naming the episode, so the relay knows which session a call belongs
to (NeMo Gym's model calls carry no key of their own); the relay drops that entry before the call
reaches the gateway. The reward is the `reward` of `/verify`'s answer, on the episode's last call.

May import: `relayrl.errors`, `relayrl.asgi`; httpx, starlette and uvicorn only inside
functions, never torch, never nemo_gym.
"""

from __future__ import annotations

import atexit
import contextlib
import difflib
import json
import math
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from relayrl.errors import ConfigError, EpisodeFailed

INSTALL = "bash scripts/install_nemo_gym.sh"
"""What makes the NeMo Gym venv (from a relayrl checkout); docs/environments/nemo-gym.md."""

EPISODE_KEY = "relayrl_episode"
"""The `metadata` entry of a `/run` body naming its episode for the relay."""

RUN_NO_RAY = ("import runpy, nemo_gym.server_utils as s; s.initialize_ray = lambda: None; "
              "runpy.run_path('{entrypoint}', run_name='__main__')")
"""How a server's app.py is run without a Ray cluster (NeMo Gym's own code otherwise)."""


def default_venv() -> Path:
    """`$RELAYRL_NEMO_GYM_VENV`, else `.venv-nemo-gym` here, else next to relayrl's checkout."""
    if os.environ.get("RELAYRL_NEMO_GYM_VENV"):
        return Path(os.environ["RELAYRL_NEMO_GYM_VENV"])
    here = Path.cwd() / ".venv-nemo-gym"
    if here.exists():
        return here
    return Path(__file__).resolve().parents[3] / ".venv-nemo-gym"


def venv_python(venv: str | Path | None = None) -> Path:
    """The NeMo Gym venv's python; ConfigError with the install command when there is none."""
    root = Path(venv) if venv is not None else default_venv()
    python = root / "bin" / "python"
    if not python.exists():
        raise ConfigError(f"no NeMo Gym venv at {root} (its bin/python is missing): make it with "
                          f"`{INSTALL}`, or name it with venv=... / $RELAYRL_NEMO_GYM_VENV")
    return python


def install_root(venv: str | Path | None = None) -> Path:
    """Where the venv's nemo-gym keeps its servers (`resources_servers/`, `responses_api_agents/`)."""
    python = venv_python(venv)
    for site in sorted(python.parent.parent.glob("lib/python3*/site-packages")):
        if (site / "nemo_gym").is_dir():
            return site
    raise ConfigError(f"the venv of {python} has no nemo-gym installed: run `{INSTALL}`")


def server_dir(kind: str, name: str, venv: str | Path | None = None) -> Path:
    """The folder of server `name` of `kind` (a shipped one by name, or a folder path)."""
    path = Path(name)
    if path.is_absolute() or name.startswith("."):
        if not (path / "app.py").is_file():
            raise ConfigError(f"{kind} server folder {name!r} has no app.py")
        return path.resolve()
    root = install_root(venv) / kind
    found = root / name
    if (found / "app.py").is_file():
        return found
    names = sorted(p.name for p in root.iterdir() if (p / "app.py").is_file())
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    hint = f"close ones: {', '.join(close)}" if close else f"{len(names)} ship, e.g. {', '.join(names[:8])}"
    raise ConfigError(f"NeMo Gym has no {kind[:-1].replace('_', ' ')} {name!r} ({hint}); "
                      "or give the path of a folder holding its app.py")


def shipped_config(folder: Path, kind: str) -> dict[str, Any]:
    """The server's own settings from its `configs/*.yaml` (the first entry of `kind`), or {}."""
    for f in sorted((folder / "configs").glob("*.yaml")):
        doc = yaml.safe_load(f.read_text()) or {}
        for top in doc.values():
            if isinstance(top, dict) and isinstance(top.get(kind), dict):
                for settings in top[kind].values():
                    if isinstance(settings, dict):
                        return dict(settings)
    return {}


def make_items(server: str, dataset: str = "example", venv: str | Path | None = None,
               limit: int | None = None) -> list[dict[str, Any]]:
    """The rows of a server's shipped dataset `data/<dataset>.jsonl` (each a `/run` body)."""
    folder = server_dir("resources_servers", server, venv)
    path = folder / "data" / f"{dataset}.jsonl"
    if not path.is_file():
        have = sorted(p.stem for p in (folder / "data").glob("*.jsonl"))
        raise ConfigError(f"{server!r} ships no dataset {dataset!r} (it has: "
                          f"{', '.join(have) or 'none'}; the others download: see its README)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for i, row in enumerate(rows):
        if not isinstance(row.get("responses_create_params"), dict):
            raise ConfigError(f"{path}:{i + 1} has no responses_create_params")
    return rows[:limit] if limit is not None else rows


def free_port() -> int:
    """A port the OS calls free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def global_config(resources: tuple[str, str, dict[str, Any]],
                  agent: tuple[str, str, dict[str, Any]], model: tuple[str, int]) -> dict[str, Any]:
    """NeMo Gym's global config for one resources server, one agent server and the relay.

    `resources` and `agent` are (instance name, server folder name, settings). Each entry is
    `{instance: {kind: {folder: settings}}}`, the shape `ng_run` builds from its YAML files; the
    agent's `resources_server` / `model_server` refs name the other two instances.
    """
    res_name, res_type, res = resources
    agent_name, agent_type, ag = agent
    model_name, model_port = model
    agent_settings = {**ag, "resources_server": {"type": "resources_servers", "name": res_name},
                      "model_server": {"type": "responses_api_models", "name": model_name}}
    agent_settings.pop("datasets", None)  # where a dataset downloads from: not a server setting
    return {
        "head_server": {"host": "127.0.0.1", "port": free_port()},  # read, never served here
        "dry_run": False,
        res_name: {"resources_servers": {res_type: dict(res)}},
        agent_name: {"responses_api_agents": {agent_type: agent_settings}},
        model_name: {"responses_api_models": {"relayrl": {
            "host": "127.0.0.1", "port": model_port, "entrypoint": "relayrl"}}},
    }


def run_body(data: dict[str, Any], episode: str, *, model: str, max_output_tokens: int | None,
             temperature: float | None) -> dict[str, Any]:
    """The `/run` body of one episode: the item, its episode named in the metadata."""
    if not isinstance(data.get("responses_create_params"), dict):
        raise EpisodeFailed("a NeMo Gym item needs responses_create_params (a /run body: "
                            "make_items reads a server's dataset)")
    body = dict(data)
    params = dict(body["responses_create_params"])
    params["metadata"] = {**(params.get("metadata") or {}), EPISODE_KEY: episode}
    params.setdefault("model", model)
    if max_output_tokens is not None:
        params["max_output_tokens"] = max_output_tokens
    if temperature is not None:
        params.setdefault("temperature", temperature)
    body["responses_create_params"] = params
    return body


@dataclass
class Relay:
    """The agent server's model server: `/v1/responses` on to the episode's gateway session."""

    sessions: dict[str, tuple[str, str]] = field(default_factory=dict)
    timeout_s: float = 600.0
    server: Any = None
    _thread: threading.Thread | None = None

    def app(self) -> Any:
        """The relay's ASGI app."""
        import httpx
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        clients: list[httpx.AsyncClient] = []

        @contextlib.asynccontextmanager
        async def lifespan(_app: Any) -> AsyncIterator[None]:
            clients.append(httpx.AsyncClient(timeout=self.timeout_s))
            try:
                yield
            finally:
                await clients.pop().aclose()

        def error(status: int, message: str) -> JSONResponse:
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                           "param": None, "code": None}}, status_code=status)

        async def responses(request: Request) -> Response:
            try:
                body = await request.json()
            except ValueError:
                return error(400, "the body is not JSON")
            if not isinstance(body, dict):
                return error(400, "the body is not a JSON object")
            meta = dict(body.get("metadata") or {})
            episode = meta.pop(EPISODE_KEY, None)
            target = self.sessions.get(str(episode)) if episode is not None else None
            if target is None:
                return error(404, f"no episode {EPISODE_KEY}={episode!r} is running here "
                                  "(calls come from a NeMo Gym agent server started by relayrl)")
            body["metadata"] = meta or None
            base_url, api_key = target
            r = await clients[0].post(f"{base_url.rstrip('/')}/responses", json=body,
                                  headers={"authorization": f"Bearer {api_key}"})
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type", "application/json"))

        return Starlette(routes=[Route("/v1/responses", responses, methods=["POST"]),
                                 Route("/responses", responses, methods=["POST"])],
                         lifespan=lifespan)

    def start(self, port: int, timeout_s: float = 30.0) -> Relay:
        """Serve on 127.0.0.1:port in a thread; return once it listens."""
        import uvicorn

        from relayrl.asgi import uvicorn_options

        config = uvicorn.Config(self.app(), host="127.0.0.1", port=port, log_level="warning",
                                **uvicorn_options())
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None
        self._thread = threading.Thread(target=self.server.run, name="relayrl-nemo-gym-relay",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the NeMo Gym model relay did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Stop serving."""
        if self.server is not None:
            self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(10.0)


@dataclass
class ServerProcess:
    """One NeMo Gym server (`python app.py` in its folder) from the venv, on 127.0.0.1."""

    name: str
    folder: Path
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, n: int = 30) -> str:
        """The last lines of its output."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_listening(self, timeout_s: float) -> None:
        """Return once its port accepts; RuntimeError with its output if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"NeMo Gym server {self.name!r} ({self.folder}) exited "
                                   f"{self.proc.returncode} at start:\n{self.tail()}")
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.port), timeout=1.0):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"NeMo Gym server {self.name!r} did not listen on "
                                   f"127.0.0.1:{self.port} in {timeout_s:.0f} s:\n{self.tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """End it (SIGTERM, then SIGKILL)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_server(python: Path, config: dict[str, Any], name: str, folder: Path,
                 logdir: Path, ray: bool = False) -> ServerProcess:
    """Start server `name` of `config` the way `ng_run` does, from `python`'s venv."""
    kind = next(iter(config[name]))
    entrypoint = str(next(iter(config[name][kind].values()))["entrypoint"])
    port = int(next(iter(config[name][kind].values()))["port"])
    env = {**os.environ, "NEMO_GYM_CONFIG_DICT": json.dumps(config),
           "NEMO_GYM_CONFIG_PATH": name, "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)  # relayrl's own paths mean nothing to another Python
    argv = ([str(python), entrypoint] if ray
            else [str(python), "-c", RUN_NO_RAY.format(entrypoint=entrypoint)])
    log = logdir / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return ServerProcess(name, folder, port, proc, log)


class NeMoGymAgent:
    """Runs a NeMo Gym resources server's episodes through its agent server; reward: /verify."""

    def __init__(self, server: str, *, agent: str = "simple_agent",
                 server_config: dict[str, Any] | None = None,
                 agent_config: dict[str, Any] | None = None, venv: str | None = None,
                 model: str = "default", max_output_tokens: int | None = 64,
                 temperature: float | None = 1.0, max_steps: int | None = 16,
                 ray: bool = False,
                 start_timeout_s: float = 180.0, episode_timeout_s: float = 900.0) -> None:
        self.python = venv_python(venv)  # a missing venv fails before any episode
        self.server_folder = server_dir("resources_servers", server, venv)
        self.agent_folder = server_dir("responses_api_agents", agent, venv)
        if max_output_tokens is not None and max_output_tokens < 1:
            raise ConfigError("need max_output_tokens >= 1 (or null: the item's own)")
        if max_steps is not None and max_steps < 1:
            raise ConfigError("need max_steps >= 1 (or null: the agent server's own bound)")
        self.server = server
        self.agent = agent
        self.server_config = dict(server_config or {})
        self.agent_config = dict(agent_config or {})
        self.model = model
        self.max_output_tokens = max_output_tokens
        self.temperature = temperature
        self.max_steps = max_steps
        self.ray = ray
        self.start_timeout_s = start_timeout_s
        self.episode_timeout_s = episode_timeout_s
        self._relay: Relay | None = None
        self._procs: list[ServerProcess] = []
        self._agent_url: str | None = None
        self._logdir: tempfile.TemporaryDirectory[str] | None = None
        self._start_error: str | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # subprocess mode pickles the agent: each worker starts its own servers
        return {**self.__dict__, "_relay": None, "_procs": [], "_agent_url": None,
                "_logdir": None, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def config(self, resources_port: int, agent_port: int, relay_port: int) -> dict[str, Any]:
        """The NeMo Gym global config these servers run with."""
        res_name = self.server_folder.name
        res = {**shipped_config(self.server_folder, "resources_servers"), **self.server_config,
               "entrypoint": "app.py", "host": "127.0.0.1", "port": resources_port}
        ag = {**shipped_config(self.agent_folder, "responses_api_agents"), **self.agent_config,
              "entrypoint": "app.py", "host": "127.0.0.1", "port": agent_port}
        if self.max_steps is not None:
            # simple_agent's own default is no bound: a policy that calls tools forever would
            # hold its episode until the timeout
            ag.setdefault("max_steps", self.max_steps)
        return global_config((res_name, res_name, res),
                             (f"{self.agent_folder.name}_agent", self.agent_folder.name, ag),
                             ("policy_model", relay_port))

    def start(self) -> str:
        """Start the relay and both servers (once); the agent server's URL."""
        with self._lock:
            if self._agent_url is not None:
                return self._agent_url
            if self._start_error is not None:  # one failed start: every later episode says so
                raise RuntimeError(self._start_error)
            ports = [free_port() for _ in range(3)]
            cfg = self.config(*ports)
            self._logdir = tempfile.TemporaryDirectory(prefix="relayrl-nemo-gym-")
            logdir = Path(self._logdir.name)
            try:
                self._relay = Relay(timeout_s=self.episode_timeout_s).start(ports[2])
                names = [k for k in cfg if k not in ("head_server", "dry_run", "policy_model")]
                folders = [self.server_folder, self.agent_folder]
                for name, folder in zip(names, folders, strict=True):
                    self._procs.append(start_server(self.python, cfg, name, folder, logdir,
                                                    self.ray))
                atexit.register(self.close)
                for p in self._procs:
                    p.wait_listening(self.start_timeout_s)
            except BaseException as e:
                self._stop_all()
                if isinstance(e, Exception):
                    self._start_error = f"the NeMo Gym servers did not start: {e}"
                    raise RuntimeError(self._start_error) from e
                raise
            self._agent_url = f"http://127.0.0.1:{ports[1]}"
            return self._agent_url

    def _stop_all(self) -> None:
        for p in self._procs:
            p.stop()
        self._procs = []
        if self._relay is not None:
            self._relay.stop()
            self._relay = None
        if self._logdir is not None:
            self._logdir.cleanup()
            self._logdir = None
        self._agent_url = None

    def close(self) -> None:
        """Stop the servers and the relay."""
        with self._lock:
            self._stop_all()

    async def aclose(self) -> None:
        """Stop the servers and the relay (the workflow calls it at the end of a run)."""
        self.close()

    async def run(self, data: dict[str, Any], *, base_url: str, api_key: str,
                  http_client: Any = None, **_: Any) -> float:
        """One episode: `/run` on NeMo Gym's agent server; the reward of its `/verify`."""
        import asyncio

        import httpx

        url = await asyncio.to_thread(self.start)
        assert self._relay is not None
        episode = secrets.token_hex(8)
        body = run_body(data, episode, model=self.model, max_output_tokens=self.max_output_tokens,
                        temperature=self.temperature)
        self._relay.sessions[episode] = (base_url, api_key)
        try:
            async with httpx.AsyncClient(timeout=self.episode_timeout_s) as c:
                r = await c.post(f"{url}/run", json=body)
        finally:
            self._relay.sessions.pop(episode, None)
        if r.status_code != 200:
            tails = "\n".join(f"[{p.name}] {p.tail(12)}" for p in self._procs)
            raise EpisodeFailed(f"NeMo Gym {self.agent} /run answered {r.status_code}: "
                                f"{r.text[:500]}\n{tails}")
        return verified_reward(r.json())


def verified_reward(answer: Any) -> float:
    """The `reward` of a `/verify` (or `/run`) answer; EpisodeFailed when it has none."""
    reward = answer.get("reward") if isinstance(answer, dict) else None
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise EpisodeFailed(f"the resources server's /verify answer has no numeric reward "
                            f"(got {reward!r})")
    if not math.isfinite(float(reward)):
        raise EpisodeFailed(f"the resources server gave a reward of {reward}")
    return float(reward)


def main(argv: list[str] | None = None) -> int:
    """`python -m relayrl.envs.nemo_gym SERVER [--dataset NAME]`: a shipped dataset as JSONL."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m relayrl.envs.nemo_gym",
                                description="Print a NeMo Gym resources server's shipped "
                                            "dataset as relayrl items (JSONL).")
    p.add_argument("server")
    p.add_argument("--dataset", default="example")
    p.add_argument("--venv", default=None)
    p.add_argument("--limit", type=int, default=None)
    args = p.parse_args(argv)
    try:
        rows = make_items(args.server, args.dataset, args.venv, args.limit)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for row in rows:
        print(json.dumps(row, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
