"""Where a task's episode runs: a local sandbox (temp folders, no Docker) or a Docker container.

Both give the same three steps: `start` (a fresh copy of the task's environment), `run_agent`
(the CLI, bounded in time, its output logged), `verify` (tests/test.sh, then the reward file).
An infrastructure failure (the CLI crashed or timed out, the verifier timed out or wrote no
readable reward) raises `EpisodeFailed`: the episode is aborted, never scored 0.

The local runtime, and what differs from Docker: Harbor's container paths (`/app` or the task's
workdir, `/tests`, `/solution`, `/logs/agent`, `/logs/verifier`, `/logs/artifacts`) become
folders of one temp directory, and every file copied from tests/ and solution/ has those paths
rewritten to the temp folders (the rule of Harbor's own macOS runtime, which remaps the same
roots in the commands it runs). instruction.md is given to the agent unchanged: the agent starts
in the workdir, so relative paths work and the rewritten verifier checks the same files. The
Dockerfile is not built: only its `COPY`/`ADD` steps into the workdir, /tests or /solution are
mirrored, `RUN` steps are not, and the agent and verifier see the host's own tools (bash,
python3, ...), the host's network and the host's files outside the sandbox. It is for tasks
made for it (the examples) and for CI; use the Docker runtime for tasks from the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from relayrl.errors import EpisodeFailed
from relayrl.harness.task import HarborTask

REWARD_TEXT = "reward.txt"
REWARD_JSON = "reward.json"
_TAIL = 2000  # characters of a failed process's output kept in the error


@dataclass
class ProcResult:
    """How a process ended."""

    returncode: int | None
    timed_out: bool
    output_tail: str
    elapsed_s: float


@dataclass
class Sandbox:
    """One episode's copy of a task's environment."""

    task: HarborTask
    root: Path
    """The temp directory holding everything of this episode."""
    home: Path
    """HOME (and every config dir) of the CLI: nothing of the user's leaks in or out."""
    roots: dict[str, Path] = field(default_factory=dict)
    """Container path -> host path, for the paths Harbor's environments define."""
    container: str | None = None
    """The Docker container's name (Docker runtime only)."""

    @property
    def workdir(self) -> Path:
        """Where the agent works, on this machine."""
        return self.roots[self.task.workdir]

    @property
    def verifier_logs(self) -> Path:
        """/logs/verifier, where test.sh writes the reward."""
        return self.roots["/logs/verifier"]

    def host_path(self, container_path: str) -> Path | None:
        """The host path of a container path under one of the mapped roots (else None)."""
        p = PurePosixPath(container_path)
        for root in sorted(self.roots, key=len, reverse=True):
            if p == PurePosixPath(root) or p.is_relative_to(root):
                return self.roots[root] / p.relative_to(root)
        return None

    def rewrite(self, text: str) -> str:
        """`text` with the mapped container paths replaced by their host folders."""
        for root in sorted(self.roots, key=len, reverse=True):
            text = re.sub(rf"(?<![\w./-]){re.escape(root)}(?=$|[/'\"\s;:)`])",
                          str(self.roots[root]).replace("\\", "\\\\"), text, flags=re.M)
        return text


def _mapped_roots(task: HarborTask, base: Path) -> dict[str, Path]:
    fs = base / "fs"
    paths = ["/tests", "/solution", "/logs/agent", "/logs/verifier", "/logs/artifacts",
             task.workdir]
    roots = {p: fs / p.lstrip("/") for p in paths}
    for p in roots.values():
        p.mkdir(parents=True, exist_ok=True)
    return roots


REAPER = Path(__file__).with_name("_reaper.py")
"""The script each process runs under: its group dies with the process that started it."""
_NOT_STARTED = 127
_REAPER_SAYS = b"relayrl reaper: "


async def run_process(argv: list[str], *, cwd: Path, env: dict[str, str], timeout_s: float,
                      log_path: Path | None = None) -> ProcResult:
    """Run `argv` in its own process group, which dies with this process (even on `kill -9`,
    through `_reaper.py`); kill the whole group when it ends, times out or is cancelled."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    # the output goes to a file, never a pipe: a background job holding a pipe open would keep
    # the wait (asyncio's waits for the pipes too) going after the command itself ended
    log = log_path.open("wb") if log_path else tempfile.TemporaryFile()  # noqa: SIM115 (closed below)
    # this process holds the pipe's only write end: when it dies the kernel closes it and the
    # reaper, seeing EOF, kills the group (a runner killed outright leaves no CLI behind)
    watch_r, watch_w = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", str(REAPER), str(watch_r), "--", *argv, cwd=cwd,
            env=env, stdin=asyncio.subprocess.DEVNULL, stdout=log,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True, pass_fds=(watch_r,))
    except OSError as e:
        os.close(watch_w)
        log.close()
        raise EpisodeFailed(f"cannot start {argv[0]}: {e}") from e
    finally:
        os.close(watch_r)
    timed_out = False
    out = b""
    try:
        try:
            async with asyncio.timeout(timeout_s):
                await proc.wait()
        except TimeoutError:
            timed_out = True
    finally:
        running = proc.returncode is None
        _kill_group(proc.pid)  # also what the command left running in its group
        os.close(watch_w)
        if running:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait(), 10)
        if log_path is None:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - _TAIL * 4))
            out = log.read()
        log.close()
    if log_path is not None:
        out = log_path.read_bytes()[-_TAIL * 4:]
    if proc.returncode == _NOT_STARTED and _REAPER_SAYS in out:
        raise EpisodeFailed(out[out.rindex(_REAPER_SAYS) + len(_REAPER_SAYS):]
                            .decode(errors="replace").strip())
    return ProcResult(proc.returncode, timed_out, out.decode(errors="replace")[-_TAIL:],
                      loop.time() - start)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


HOST_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "SSL_CERT_FILE",
            "SSL_CERT_DIR", "NODE_EXTRA_CA_CERTS")
"""What the CLI and the verifier inherit from this process's environment: tools and locale, no
keys, no proxies (the gateway is on loopback), no config paths of the user's."""


def host_env() -> dict[str, str]:
    """The variables of `HOST_ENV` that are set here."""
    return {k: os.environ[k] for k in HOST_ENV if k in os.environ}


def resolve_env(values: dict[str, str]) -> dict[str, str]:
    """Harbor's `${VAR}` / `${VAR:-default}` templates, resolved from this process's env."""
    def one(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(3)
        return os.environ.get(name, default if default is not None else "")
    return {k: re.sub(r"\$\{(\w+)(:-([^}]*))?\}", one, v) for k, v in values.items()}


def read_reward(verifier_dir: Path, reward_key: str | None = None) -> float:
    """The scalar reward test.sh wrote (reward.json first, then reward.txt, as Harbor reads them)."""
    json_path, text_path = verifier_dir / REWARD_JSON, verifier_dir / REWARD_TEXT
    if json_path.is_file():
        try:
            rewards = json.loads(json_path.read_text())
        except ValueError as e:
            raise EpisodeFailed(f"the verifier's {REWARD_JSON} is not JSON: {e}") from e
        if not isinstance(rewards, dict):
            rewards = {"reward": rewards}
        if reward_key is not None:
            key = reward_key
        elif "reward" in rewards or len(rewards) != 1:
            key = "reward"
        else:
            key = next(iter(rewards))
        if key not in rewards:
            raise EpisodeFailed(f"the verifier's {REWARD_JSON} has no {key!r} "
                                f"(keys: {sorted(rewards)}); set reward_key")
        value = rewards[key]
    elif text_path.is_file():
        raw = text_path.read_text().strip()
        if not raw:
            raise EpisodeFailed(f"the verifier's {REWARD_TEXT} is empty")
        try:
            value = float(raw)
        except ValueError:
            raise EpisodeFailed(f"the verifier's {REWARD_TEXT} is not a number: "
                                f"{raw[:80]!r}") from None
    else:
        raise EpisodeFailed(f"the verifier wrote no reward ({REWARD_TEXT} or {REWARD_JSON} "
                            "in /logs/verifier)")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise EpisodeFailed(f"the verifier's reward is {value!r}, not a finite number")
    return float(value)


def _copy_tree(src: Path, dest: Path, sandbox: Sandbox, rewrite: bool) -> None:
    """Copy `src` into `dest`; text files get their container paths rewritten."""
    for path in sorted(src.rglob("*")) if src.is_dir() else [src]:
        rel = path.relative_to(src) if src.is_dir() else Path(path.name)
        target = dest / rel if src.is_dir() else dest
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        data = path.read_bytes()
        if rewrite:
            with contextlib.suppress(UnicodeDecodeError):  # binary files are copied as is
                data = sandbox.rewrite(data.decode()).encode()
        target.write_bytes(data)
        shutil.copymode(path, target)


class LocalRuntime:
    """Episodes as processes on this machine, in a temp directory (see the module doc)."""

    name = "local"

    def __init__(self, tmp_root: str | None = None, keep: bool = False) -> None:
        self.tmp_root = tmp_root
        self.keep = keep

    async def start(self, task: HarborTask) -> Sandbox:
        """A fresh temp directory with the task's workspace files copied in."""
        return await asyncio.to_thread(self._start, task)

    def _start(self, task: HarborTask) -> Sandbox:
        root = Path(tempfile.mkdtemp(prefix=f"relayrl-{task.path.name[:24]}-", dir=self.tmp_root))
        home = root / "home"
        home.mkdir()
        sandbox = Sandbox(task, root, home, _mapped_roots(task, root))
        for step in task.copies:
            for source in step.sources:
                matches = sorted(glob.glob(str(task.environment_dir / source)))
                for match in matches:
                    src = Path(match)
                    dest_str = step.dest
                    if step.dest.endswith("/") or len(matches) > 1 or len(step.sources) > 1:
                        dest_str = str(PurePosixPath(step.dest) /
                                       (src.name if src.is_file() else ""))
                    dest = sandbox.host_path(dest_str)
                    if dest is not None:
                        _copy_tree(src, dest, sandbox, rewrite=False)
        return sandbox

    def agent_workdir(self, sandbox: Sandbox) -> Path:
        """Where the CLI starts, as the CLI sees it (here: the host folder of the workdir)."""
        return sandbox.workdir

    async def run_agent(self, sandbox: Sandbox, argv: list[str], env: dict[str, str],
                        timeout_s: float) -> ProcResult:
        """The CLI in the workdir, with the task's environment variables and `env`."""
        full = {**host_env(), **resolve_env(sandbox.task.environment_env), **env}
        return await run_process(argv, cwd=sandbox.workdir, env=full, timeout_s=timeout_s,
                                 log_path=sandbox.roots["/logs/agent"] / "cli.log")

    async def run_script(self, sandbox: Sandbox, script: Path, env: dict[str, str],
                         timeout_s: float, log_name: str) -> ProcResult:
        """A task script (test.sh, solve.sh) under bash, in the workdir, HOME in the sandbox."""
        full = {**host_env(), "HOME": str(sandbox.home), **env}
        log = sandbox.roots["/logs/verifier" if log_name.startswith("test") else "/logs/agent"]
        return await run_process(["bash", str(script)], cwd=sandbox.workdir, env=full,
                                 timeout_s=timeout_s, log_path=log / log_name)

    async def verify(self, sandbox: Sandbox, reward_key: str | None = None) -> float:
        """Copy tests/ to /tests, run test.sh, read the reward; EpisodeFailed if it cannot."""
        task = sandbox.task
        tests = sandbox.roots["/tests"]
        await asyncio.to_thread(_copy_tree, task.tests_dir, tests, sandbox, True)
        for name in (REWARD_TEXT, REWARD_JSON):
            (sandbox.verifier_logs / name).unlink(missing_ok=True)
        env = {**resolve_env(task.environment_env), **resolve_env(task.verifier_env)}
        result = await self.run_script(sandbox, tests / "test.sh", env,
                                       task.verifier_timeout_s, "test-stdout.txt")
        if result.timed_out:
            raise EpisodeFailed(f"the verifier of task {task.name!r} ran past its "
                                f"{task.verifier_timeout_s:g} s")
        try:
            return read_reward(sandbox.verifier_logs, reward_key)
        except EpisodeFailed as e:
            raise EpisodeFailed(f"task {task.name!r}: {e}; test.sh exited {result.returncode}: "
                                f"{result.output_tail[-500:]}") from None

    async def solve(self, sandbox: Sandbox, timeout_s: float = 600.0) -> ProcResult:
        """Run solution/solve.sh in the sandbox (the oracle), as Harbor's OracleAgent does."""
        dest = sandbox.roots["/solution"]
        await asyncio.to_thread(_copy_tree, sandbox.task.solution_dir, dest, sandbox, True)
        return await self.run_script(sandbox, dest / "solve.sh", {}, timeout_s, "oracle.txt")

    async def stop(self, sandbox: Sandbox) -> None:
        """Remove the episode's temp directory (kept with keep=True, for debugging)."""
        if not self.keep:
            await asyncio.to_thread(shutil.rmtree, sandbox.root, True)
