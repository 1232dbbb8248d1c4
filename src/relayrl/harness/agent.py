"""`CLIAgent`: a coding CLI on a Harbor task as one relayrl episode.

It is an agent in relayrl's sense (`async def run(data, base_url, api_key, ...)`), so
`relayrl train` wraps it in `AgentWorkflow` like any other: the workflow opens the session and
passes its base URL; the CLI makes its calls there (each recorded token-exact); the task's
verifier gives the reward of the last call; the workflow exports the rows. Groups, staleness and
abort counting are the workflow's. The data item names the task: `{"task": "path/to/task"}`.

Whatever goes wrong around the model (the CLI cannot start, exits non-zero, runs past its time
limit; the verifier times out or writes no reward) raises `EpisodeFailed`, so the episode is
aborted and none of its calls are trained on; a verifier that ran and wrote 0 is a reward of 0.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from relayrl.errors import ConfigError, EpisodeFailed, InvalidRequest
from relayrl.harness.clis import LaunchSpec, get_adapter
from relayrl.harness.docker import DockerRuntime
from relayrl.harness.runtime import LocalRuntime
from relayrl.harness.task import HarborTask, load_task

log = logging.getLogger(__name__)


class CLIAgent:
    """Runs `cli` on the task a data item names, in a fresh sandbox; returns the verifier's reward."""

    def __init__(self, cli: str = "opencode", runtime: str = "local", model: str = "relayrl",
                 timeout_s: float | None = None, default_timeout_s: float = 600.0,
                 tasks_root: str | None = None, clis_dir: str | None = None,
                 context_window: int = 32768, max_output_tokens: int = 1024,
                 reward_key: str | None = None, keep_sandboxes: bool = False,
                 tmp_root: str | None = None, docker_network: str = "host",
                 subagents: bool = False, system_prompt: str | None = None,
                 tools: list[str] | None = None) -> None:
        self.adapter = get_adapter(cli)
        if runtime not in ("local", "docker"):
            raise ConfigError(f"runtime {runtime!r} is not one of ['local', 'docker']")
        for name, value in (("timeout_s", timeout_s), ("default_timeout_s", default_timeout_s)):
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        self.cli = cli
        self.runtime_name = runtime
        self.model = model
        self.timeout_s = timeout_s
        self.default_timeout_s = default_timeout_s
        self.tasks_root = tasks_root
        self.clis_dir = clis_dir
        self.context_window = context_window
        self.max_output_tokens = max_output_tokens
        self.reward_key = reward_key
        self.keep_sandboxes = keep_sandboxes
        self.tmp_root = tmp_root
        self.docker_network = docker_network
        self.subagents = subagents
        self.system_prompt = system_prompt
        self.tools = None if tools is None else tuple(tools)

    def runtime(self) -> LocalRuntime | DockerRuntime:
        """A runtime of the configured kind (cheap; built per episode so the agent pickles)."""
        if self.runtime_name == "docker":
            return DockerRuntime(clis_dir=self.clis_dir, tmp_root=self.tmp_root,
                                 keep=self.keep_sandboxes, network=self.docker_network)
        return LocalRuntime(tmp_root=self.tmp_root, keep=self.keep_sandboxes)

    def task_for(self, data: dict[str, Any]) -> HarborTask:
        """The task a data item names (`task`, relative to `tasks_root` or the working dir)."""
        name = data.get("task") if isinstance(data, dict) else None
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"a CLI agent's data item needs 'task' (a task directory), "
                                 f"got {sorted(data) if isinstance(data, dict) else data!r}")
        path = Path(name)
        if not path.is_absolute() and self.tasks_root:
            path = Path(self.tasks_root) / path
        return load_task(path)

    def time_limit(self, task: HarborTask) -> float:
        """The CLI's time limit: `timeout_s`, else the task's `[agent] timeout_sec`, else the default."""
        return self.timeout_s or task.agent_timeout_s or self.default_timeout_s

    async def run(self, data: dict[str, Any], base_url: str, api_key: str,
                  **_: Any) -> float:
        """One episode: sandbox, CLI, verifier; the reward, or EpisodeFailed (an abort)."""
        task = self.task_for(data)
        runtime = self.runtime()
        executable = self.adapter.locate(self.clis_dir)
        sandbox = await runtime.start(task)
        try:
            spec = LaunchSpec(instruction=task.instruction, base_url=base_url, api_key=api_key,
                              model=self.model, home=sandbox.home,
                              workdir=runtime.agent_workdir(sandbox), executable=executable,
                              context_window=self.context_window,
                              max_output_tokens=self.max_output_tokens,
                              subagents=self.subagents, system_prompt=self.system_prompt,
                              tools=self.tools)
            launch = self.adapter.launch(spec)
            limit = self.time_limit(task)
            result = await runtime.run_agent(sandbox, launch.argv, launch.env, limit)
            if result.timed_out:
                raise EpisodeFailed(f"{self.cli} ran past its {limit:g} s on task {task.name!r}")
            if result.returncode != 0:
                raise EpisodeFailed(f"{self.cli} exited with code {result.returncode} on task "
                                    f"{task.name!r}: {result.output_tail[-800:]}")
            reward = await runtime.verify(sandbox, self.reward_key)
            log.info("task %s: %s finished in %.1f s, reward %g", task.name, self.cli,
                     result.elapsed_s, reward)
            return reward
        finally:
            await runtime.stop(sandbox)
