"""The Docker runtime: each episode in a fresh container of the task's image, as Harbor runs it.

The image is `[environment] docker_image`, else `docker build` of environment/ (tagged by the
task's name and the build context's hash, so Docker's cache builds it once). The container runs
with `--network host`, so the CLI reaches the gateway on 127.0.0.1; the episode's /logs folder,
its HOME and the installed CLIs (.clis) are bind-mounted (HOME and .clis at the same absolute
paths as on the host, so the adapters' config paths hold), and the host's `node` is mounted at
/usr/local/bin/node: the image needs glibc (Debian/Ubuntu bases, as most Harbor tasks use) but
not Node. The CLI runs through `docker exec` in the task's workdir, its environment (with the
session key) passed in an --env-file, never on a command line. tests/ is copied to /tests and
test.sh runs inside the container, as Harbor's verifier does; the reward is read from the
mounted /logs/verifier. The container is removed when the episode ends, whatever happened.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

from relayrl.errors import ConfigError, EpisodeFailed
from relayrl.harness.runtime import ProcResult, Sandbox, read_reward, resolve_env, run_process
from relayrl.harness.task import HarborTask


def docker_available() -> bool:
    """Whether a Docker client is installed and its daemon answers."""
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def image_tag(task: HarborTask) -> str:
    """The tag a task's built image gets: its name and a hash of environment/."""
    h = hashlib.sha256()
    for path in sorted(task.environment_dir.rglob("*")):
        if path.is_file():
            h.update(str(path.relative_to(task.environment_dir)).encode())
            h.update(path.read_bytes())
    name = re.sub(r"[^a-z0-9_.-]", "-", task.name.lower())[:60] or "task"
    return f"relayrl-task-{name}:{h.hexdigest()[:12]}"


class DockerRuntime:
    """Episodes in Docker containers of the task's environment (see the module doc)."""

    name = "docker"

    def __init__(self, clis_dir: str | None = None, tmp_root: str | None = None,
                 keep: bool = False, network: str = "host", docker: str = "docker") -> None:
        self.clis_dir = clis_dir
        self.tmp_root = tmp_root
        self.keep = keep
        self.network = network
        self.docker = docker

    async def _docker(self, *args: str, timeout_s: float = 600.0) -> ProcResult:
        return await run_process([self.docker, *args], cwd=Path.cwd(), env=dict(os.environ),
                                 timeout_s=timeout_s)

    async def image(self, task: HarborTask) -> str:
        """The task's image: its docker_image, or environment/ built (cached by Docker)."""
        if task.docker_image:
            return task.docker_image
        if task.dockerfile is None:
            raise ConfigError(f"task {task.name!r} has neither [environment] docker_image nor "
                              "environment/Dockerfile; the Docker runtime needs one")
        tag = image_tag(task)
        r = await self._docker("build", "-q", "-t", tag, str(task.environment_dir))
        if r.returncode != 0:
            raise EpisodeFailed(f"docker build of task {task.name!r} failed: {r.output_tail}")
        return tag

    def run_args(self, sandbox: Sandbox, image: str, clis: Path | None,
                 node: str | None) -> list[str]:
        """The `docker run` arguments of a sandbox's container."""
        args = ["run", "-d", "--name", str(sandbox.container), "--network", self.network,
                "-v", f"{sandbox.root / 'fs' / 'logs'}:/logs",
                "-v", f"{sandbox.home}:{sandbox.home}",
                "-w", sandbox.task.workdir]
        if clis is not None:
            args += ["-v", f"{clis}:{clis}:ro"]
        if node is not None:
            args += ["-v", f"{node}:/usr/local/bin/node:ro"]
        for k, v in resolve_env(sandbox.task.environment_env).items():
            args += ["-e", f"{k}={v}"]
        return [*args, "--entrypoint", "sleep", image, "infinity"]

    async def start(self, task: HarborTask) -> Sandbox:
        """A running container of the task's image, with the episode's mounts."""
        image = await self.image(task)
        root = Path(tempfile.mkdtemp(prefix=f"relayrl-{task.path.name[:24]}-", dir=self.tmp_root))
        home = root / "home"
        logs = root / "fs" / "logs"
        for d in (home, logs / "agent", logs / "verifier", logs / "artifacts"):
            d.mkdir(parents=True, exist_ok=True)
        sandbox = Sandbox(task, root, home, {"/logs/verifier": logs / "verifier",
                                             "/logs/agent": logs / "agent"},
                          container=f"relayrl-{uuid.uuid4().hex[:12]}")
        clis = None
        for base in filter(None, [self.clis_dir, os.environ.get("RELAYRL_CLIS_DIR"),
                                  str(Path.cwd() / ".clis")]):
            if (Path(base) / "node_modules").is_dir():
                clis = Path(base).resolve()
                break
        node = shutil.which("node")
        r = await self._docker(*self.run_args(sandbox, image, clis,
                                              os.path.realpath(node) if node else None))
        if r.returncode != 0:
            shutil.rmtree(root, ignore_errors=True)
            raise EpisodeFailed(f"docker run for task {task.name!r} failed: {r.output_tail}")
        return sandbox

    def agent_workdir(self, sandbox: Sandbox) -> Path:
        """Where the CLI starts, inside the container."""
        return Path(sandbox.task.workdir)

    async def exec(self, sandbox: Sandbox, argv: list[str], env: dict[str, str],
                   timeout_s: float, log_path: Path) -> ProcResult:
        """`docker exec` in the workdir, `env` passed through a private env file."""
        env_file = sandbox.root / f"env-{uuid.uuid4().hex[:8]}"
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.writelines(f"{k}={v}\n" for k, v in env.items() if "\n" not in v)
        try:
            return await run_process(
                [self.docker, "exec", "-i", "--env-file", str(env_file), "-w",
                 sandbox.task.workdir, str(sandbox.container), *argv],
                cwd=sandbox.root, env=dict(os.environ), timeout_s=timeout_s, log_path=log_path)
        finally:
            env_file.unlink(missing_ok=True)

    async def run_agent(self, sandbox: Sandbox, argv: list[str], env: dict[str, str],
                        timeout_s: float) -> ProcResult:
        """The CLI inside the container (the CLI's scripts run under the mounted node)."""
        return await self.exec(sandbox, argv, env, timeout_s,
                               sandbox.roots["/logs/agent"] / "cli.log")

    async def verify(self, sandbox: Sandbox, reward_key: str | None = None) -> float:
        """Copy tests/ to /tests, run test.sh in the container, read the mounted reward file."""
        task = sandbox.task
        for name in ("reward.txt", "reward.json"):
            (sandbox.verifier_logs / name).unlink(missing_ok=True)
        r = await self._docker("cp", f"{task.tests_dir}/.", f"{sandbox.container}:/tests")
        if r.returncode != 0:
            raise EpisodeFailed(f"cannot copy tests/ into the container: {r.output_tail}")
        env = {**resolve_env(task.environment_env), **resolve_env(task.verifier_env)}
        result = await self.exec(
            sandbox, ["bash", "-c", "(bash /tests/test.sh) > /logs/verifier/test-stdout.txt 2>&1"],
            env, task.verifier_timeout_s, sandbox.root / "verifier-exec.log")
        if result.timed_out:
            raise EpisodeFailed(f"the verifier of task {task.name!r} ran past its "
                                f"{task.verifier_timeout_s:g} s")
        return read_reward(sandbox.verifier_logs, reward_key)

    async def stop(self, sandbox: Sandbox) -> None:
        """Remove the container and the episode's temp directory."""
        if not self.keep:
            await self._docker("rm", "-f", str(sandbox.container), timeout_s=60)
            await asyncio.to_thread(shutil.rmtree, sandbox.root, True)
