"""Runnable docs: every shell and Python block of README.md and docs/**/*.md runs in CI.

One test per block, named `FILE:LINE` (the fence's line), e.g.
`tests/docs/test_doc_blocks.py::test_doc_block[docs/service.md:13]`. A block preceded by the line
`<!-- norun: REASON -->` is reported as skipped with that reason (the reason is required: a
marker without one fails). Blocks tagged bash/sh/shell/zsh run with `bash` under
`set -euo pipefail`; python/py blocks run with this interpreter (top-level `await` allowed).
Other languages (json, yaml, text, console, untagged) are never run.

What a block gets:

- its own fresh temporary directory as the working directory, holding links to the repository's
  top-level folders (`examples`, `scripts`, `src`, `benchmarks`, `tests`, `docs`), so paths written
  from the repository root (`examples/any_agent/serve.yaml`) work and files it writes stay there;
- `PATH` starting with this interpreter's folder (`python`, `relayrl` are the ones under test);
- a running gateway, `relayrl gateway --engine fake` on 127.0.0.1 at a free port (scripted
  engine: every reply is "ok", real default-model tokenizer), one per test session, shared by
  all blocks, and these environment variables:

  | variable | value |
  | --- | --- |
  | `GATEWAY_URL` | the gateway's root URL, `http://127.0.0.1:PORT` |
  | `ADMIN` | its admin key |
  | `OPENAI_BASE_URL`, `OPENAI_API_KEY` | the same root URL and key, as agents of a service get them |
  | `ROLLOUT_SERVER_PORT` | a free loopback port (`relayrl rollout-server` listens on it) |
  | `FREE_PORT` | another free loopback port, for anything else a block starts |
  | `RELAYRL_REPO` | the repository's root |

  `RELAYRL_URL` and `RELAYRL_API_KEY` are unset: `AgentSession` would prefer them to a block's
  own `OPENAI_BASE_URL`;
- a time limit: `DOC_BLOCK_TIMEOUT_S` (120 s) per block. On exit, anything the block left running
  (`cmd &`) is stopped: each block runs in its own process group, which is killed.

Blocks that need the real model for long, a GPU, a cluster, minutes of training, or are fragments
must carry a norun marker; everything else must run, so the docs stay true. Where torch is not
installed (CI's Python 3.12 and 3.13 phases), a block that fails on importing it is skipped, with
that reason, instead of failing.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.docs.blocks import Block, runnable_blocks

ROOT = Path(__file__).resolve().parents[2]
RUN_PYTHON = Path(__file__).resolve().parent / "run_python.py"
DOC_BLOCK_TIMEOUT_S = 120.0
LINKED = ("examples", "scripts", "src", "benchmarks", "tests", "docs")
ADMIN_KEY = "docs-runner-admin-key-0123456789abcdef"
BLOCKS = runnable_blocks(ROOT)
NO_TORCH = importlib.util.find_spec("torch") is None
TORCH_MISSING = "ModuleNotFoundError: No module named 'torch'"


def free_port() -> int:
    """A port nothing listens on at the moment (loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class DocsGateway:
    """The fake-engine gateway the blocks talk to."""

    url: str
    admin_key: str


@pytest.fixture(scope="session")
def docs_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DocsGateway]:
    """`relayrl gateway --engine fake` on a free loopback port, for the whole session."""
    port = free_port()
    log = tmp_path_factory.mktemp("docs-gateway") / "gateway.log"
    cmd = [sys.executable, "-m", "relayrl.cli", "gateway", "--engine", "fake", "--host",
           "127.0.0.1", "--port", str(port), "--admin-key", ADMIN_KEY]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"the docs gateway exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no gateway after 60 s:\n{log.read_text()}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield DocsGateway(url, ADMIN_KEY)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)


def block_env(gw: DocsGateway) -> dict[str, str]:
    """The environment a block runs with (see the module docstring)."""
    # nothing of the caller's services or keys leaks in: only what the table above lists
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RELAYRL_", "OPENAI_", "ANTHROPIC_", "ROLLOUT_"))}
    env.update({
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        "GATEWAY_URL": gw.url, "ADMIN": gw.admin_key,
        "OPENAI_BASE_URL": gw.url, "OPENAI_API_KEY": gw.admin_key,
        "ROLLOUT_SERVER_PORT": str(free_port()), "FREE_PORT": str(free_port()),
        "RELAYRL_REPO": str(ROOT), "PYTHONUNBUFFERED": "1",
    })
    if "RELAYRL_HOME" in os.environ:  # the shared model cache, not one per block
        env["RELAYRL_HOME"] = os.environ["RELAYRL_HOME"]
    return env


def workdir(tmp: Path) -> Path:
    """A fresh folder that looks like the repository's root to the block."""
    for name in LINKED:
        if (ROOT / name).exists():
            (tmp / name).symlink_to(ROOT / name, target_is_directory=True)
    return tmp


def run_block(block: Block, env: dict[str, str], cwd: Path,
              timeout_s: float = DOC_BLOCK_TIMEOUT_S) -> tuple[int | None, str]:
    """Run `block` in `cwd`; (exit status or None on timeout, its output)."""
    if block.kind == "bash":
        script = cwd / "block.sh"
        script.write_text("set -euo pipefail\n" + block.code)
        cmd = ["bash", str(script)]
    else:
        script = cwd / "block.py"
        script.write_text(block.code)
        cmd = [sys.executable, str(RUN_PYTHON), str(script)]
    out_path = cwd / "block.out"
    with out_path.open("w") as out:
        # a file, not a pipe: a server the block leaves in the background would hold a pipe open
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _stop_group(proc)
    return code, out_path.read_text(errors="replace")


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop the block and whatever it started (its own process group, made for it)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                proc.poll()
                return
            proc.poll()
            time.sleep(0.05)


def _params() -> list[object]:
    params: list[object] = []
    for b in BLOCKS:
        marks = []
        if b.norun:
            marks.append(pytest.mark.skip(reason=f"norun ({b.test_id(ROOT)}): {b.norun}"))
        params.append(pytest.param(b, id=b.test_id(ROOT), marks=marks))
    return params


@pytest.mark.parametrize("block", _params())
def test_doc_block(block: Block, docs_gateway: DocsGateway, tmp_path: Path) -> None:
    """The block runs to exit status 0 within its time limit."""
    where = block.test_id(ROOT)
    if block.norun is not None:  # a marker without a reason (one with a reason is skipped)
        pytest.fail(f"{where}: `<!-- norun: REASON -->` needs a reason after `norun:`")
    code, output = run_block(block, block_env(docs_gateway), workdir(tmp_path))
    assert code is not None, (f"{where} ran past {DOC_BLOCK_TIMEOUT_S:.0f} s; mark it "
                              f"`<!-- norun: REASON -->` if it cannot be quick\n{output[-4000:]}")
    if code != 0 and NO_TORCH and TORCH_MISSING in output:
        # CI's torch-free Pythons: a block that trains or builds tensors cannot run there
        pytest.skip(f"{where} needs torch, which this environment does not have")
    assert code == 0, f"{where} exited with {code}:\n{block.code}\n--- output ---\n{output[-4000:]}"
