"""relayrl.harness: coding CLIs (opencode, Codex, Claude Code, Qwen Code) as episodes on Harbor tasks.

May import: `relayrl.errors`, `relayrl.workflow`, `relayrl.client` and the standard library;
never torch. Harbor itself is not imported: task.toml is read with tomllib.
"""

from relayrl.harness.agent import CLIAgent
from relayrl.harness.clis import ADAPTERS, CLIAdapter, Launch, LaunchSpec, get_adapter
from relayrl.harness.docker import DockerRuntime, docker_available
from relayrl.harness.runtime import LocalRuntime, ProcResult, Sandbox, read_reward
from relayrl.harness.task import HarborTask, TaskError, find_tasks, load_task

__all__ = [
    "ADAPTERS",
    "CLIAdapter",
    "CLIAgent",
    "DockerRuntime",
    "HarborTask",
    "Launch",
    "LaunchSpec",
    "LocalRuntime",
    "ProcResult",
    "Sandbox",
    "TaskError",
    "docker_available",
    "find_tasks",
    "get_adapter",
    "load_task",
    "read_reward",
]
