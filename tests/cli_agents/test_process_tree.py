"""A runner killed outright (`kill -9`) takes the processes it started with it: the CLI, and
whatever the CLI started in its process group (the reaper sees the runner's end of a pipe close
and kills the group; the CLI also has PR_SET_PDEATHSIG)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from relayrl.harness.clis import OpenCode
from relayrl.harness.runtime import run_process

ROOT = Path(__file__).resolve().parents[2]
TASK = ROOT / "examples" / "cli_agents" / "tasks" / "hello-file"
CLIS = ROOT / ".clis"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc to find the processes")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended (its parent reaps it)


def _with_env(marker: str) -> list[int]:
    """The live processes whose environment holds `marker`."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker.encode() in (d / "environ").read_bytes() and _alive(int(d.name)):
                    found.append(int(d.name))
            except OSError:
                continue
    return found


def _wait(cond, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _runner(code: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_a_killed_runner_takes_the_command_and_its_children_with_it(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    runner = _runner(f"""
        import asyncio
        from pathlib import Path
        from relayrl.harness.runtime import run_process
        asyncio.run(run_process(
            ["bash", "-c", "sleep 300 & echo $! > {pids}.tmp; echo $$ >> {pids}.tmp; "
                           "mv {pids}.tmp {pids}; wait"],
            cwd=Path("{tmp_path}"), env={{"PATH": "/usr/bin:/bin"}}, timeout_s=300,
            log_path=Path("{tmp_path}/log")))
    """)
    try:
        _wait(pids.exists, 30, "the command to start")
        started = [int(p) for p in pids.read_text().split()]
        assert all(_alive(p) for p in started)
        runner.kill()
        runner.wait(10)
        _wait(lambda: not any(_alive(p) for p in started), 10, f"{started} to die")
    finally:
        if runner.poll() is None:
            runner.kill()


async def test_a_command_that_ends_leaves_nothing_of_its_group_running(tmp_path: Path) -> None:
    result = await run_process(["bash", "-c", "sleep 300 & echo $!"], cwd=tmp_path,
                               env={"PATH": "/usr/bin:/bin"}, timeout_s=30)
    assert result.returncode == 0 and not result.timed_out
    _wait(lambda: not _alive(int(result.output_tail.split()[-1])), 5, "the background sleep")


async def test_a_command_that_cannot_start_is_a_clear_error(tmp_path: Path) -> None:
    from relayrl.errors import EpisodeFailed

    with pytest.raises(EpisodeFailed, match="cannot start /no/such/cli"):
        await run_process(["/no/such/cli"], cwd=tmp_path, env={}, timeout_s=30)


async def test_a_command_killed_by_a_signal_reports_that_signal(tmp_path: Path) -> None:
    result = await run_process(["bash", "-c", "kill -TERM $$"], cwd=tmp_path,
                               env={"PATH": "/usr/bin:/bin"}, timeout_s=30)
    assert result.returncode == -signal.SIGTERM


@pytest.fixture
def silent_server() -> Iterator[tuple[str, threading.Event]]:
    """A loopback HTTP port that accepts connections and never answers (a model still thinking)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    called, stop = threading.Event(), threading.Event()
    conns: list[socket.socket] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            conns.append(conn)
            conn.settimeout(5)
            try:
                if conn.recv(65536).startswith(b"POST"):
                    called.set()
            except OSError:
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}/v1", called
    stop.set()
    t.join(5)
    for c in conns:
        c.close()
    srv.close()


def _opencode_installed() -> bool:
    try:
        OpenCode().locate(str(CLIS))
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _opencode_installed(),
                    reason="opencode is not installed (scripts/install_clis.sh)")
def test_a_killed_runner_takes_the_real_cli_with_it(
        silent_server: tuple[str, threading.Event], tmp_path: Path) -> None:
    base_url, called = silent_server
    key = f"relayrl-test-{uuid.uuid4().hex}"  # every process of the episode has it in its env
    runner = _runner(f"""
        import asyncio
        from relayrl.harness import CLIAgent
        agent = CLIAgent(cli="opencode", clis_dir="{CLIS}", tmp_root="{tmp_path}",
                         timeout_s=300)
        asyncio.run(agent.run({{"task": "{TASK}"}}, "{base_url}", "{key}"))
    """)
    try:
        _wait(called.is_set, 120, "opencode's first call")  # the CLI is up and waiting on us
        cli = _with_env(key)
        assert cli, "no process of the episode found"
        runner.kill()
        runner.wait(10)
        _wait(lambda: not _with_env(key), 10, f"opencode's processes {cli} to die")
    finally:
        if runner.poll() is None:
            runner.kill()
