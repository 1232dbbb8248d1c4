"""Start and stop a managed vLLM-CPU server process (in its own venv) for `VLLMEngine`.

Imports only the standard library and httpx: the server runs in the venv that
scripts/install_vllm.sh makes, never in relayrl's own environment. vLLM's `vllm` console script
looks up the distribution "vllm", while the CPU build is published as "vllm-cpu", so the server is
started as `python -m vllm.entrypoints.openai.api_server`. `VLLM_SERVER_DEV_MODE=1` is set because
vLLM registers /pause, /resume, /abort_requests, /collective_rpc and /reset_prefix_cache only in
dev mode, and `--logprobs-mode processed_logprobs` makes its logprobs the temperature-scaled ones
relayrl records (see `relayrl.engine.vllm`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from relayrl.errors import EngineError

DEFAULT_VENV_NAME = ".venv-vllm"
WORKER_EXTENSION = "relayrl_vllm_worker.RelayrlWorkerExtension"
"""relayrl's worker extension (`--worker-extension-cls`): a reload that also repacks CPU kernels
derived from tied weights (see `relayrl/engine/vllm_ext/relayrl_vllm_worker.py`)."""
WORKER_EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_ext"
"""The folder put on the server's PYTHONPATH so that vLLM's workers can import the extension."""
STARTUP_TIMEOUT_S = 900.0
"""vLLM-CPU compiles and warms the model up before answering /health: minutes on 2 busy cores."""


def default_venv() -> Path:
    """$RELAYRL_VLLM_VENV, else .venv-vllm in the repository root (what install_vllm.sh makes)."""
    env = os.environ.get("RELAYRL_VLLM_VENV")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / DEFAULT_VENV_NAME


def venv_python(venv: str | os.PathLike[str] | None = None) -> Path:
    """The venv's interpreter; raises `EngineError` saying how to make the venv when it is missing."""
    folder = Path(venv) if venv is not None else default_venv()
    python = folder / "bin" / "python"
    if not python.is_file() or not (folder / ".relayrl-vllm-ok").is_file():
        raise EngineError(
            f"no vLLM venv at {folder}: run scripts/install_vllm.sh "
            "(or set RELAYRL_VLLM_VENV to one it made)"
        )
    return python


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class VLLMServer:
    """A running vLLM server process started by `start_vllm_server`."""

    process: subprocess.Popen[bytes]
    url: str
    log_path: Path
    startup_s: float
    args: list[str] = field(default_factory=list)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the server (SIGTERM to its process group, SIGKILL after `timeout_s`)."""
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_vllm_server(
    model: str,
    port: int | None = None,
    venv: str | os.PathLike[str] | None = None,
    *,
    host: str = "127.0.0.1",
    dtype: str = "bfloat16",
    max_model_len: int = 2048,
    kv_cache_gb: int = 1,
    logprobs_mode: str = "processed_logprobs",
    enforce_eager: bool = False,
    extra_args: list[str] | None = None,
    log_path: str | os.PathLike[str] | None = None,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
) -> VLLMServer:
    """Start `vllm.entrypoints.openai.api_server` on `model` (a local HF dir) and wait for /health.

    `logprobs_mode` "processed_logprobs" gives relayrl's temperature-scaled logprobs (see
    `relayrl.engine.vllm`); "raw_logprobs" gives temperature-1 ones. Raises `EngineError` with the
    log's tail when the process exits or is not healthy within `startup_timeout_s`.
    `enforce_eager` skips vLLM's torch.compile warm-up (vLLM sets compilation mode NONE), which
    dominates startup on a small CPU machine, at some cost in decode speed. The process gets its
    own process group, so `stop` ends its workers too.
    """
    python = venv_python(venv)
    if not Path(model).is_dir():
        raise EngineError(f"model {model!r} is not a local directory (nothing is downloaded)")
    port = port or free_port(host)
    args = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--host", host,
        "--port", str(port),
        "--dtype", dtype,
        "--max-model-len", str(max_model_len),
        "--logprobs-mode", logprobs_mode,
        "--worker-extension-cls", WORKER_EXTENSION,
        *(["--enforce-eager"] if enforce_eager else []),
        *(extra_args or []),
    ]  # fmt: skip
    env = dict(os.environ)
    env.update(
        {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gb)),  # vLLM parses an int (GiB)
            "HF_HUB_OFFLINE": "1",  # never reach for a hub: the model is a local directory
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    # relayrl's own packages must not shadow the venv's: only the extension's folder goes on it
    env["PYTHONPATH"] = str(WORKER_EXTENSION_DIR)
    log_file = Path(log_path) if log_path else Path(f"/tmp/relayrl-vllm-{port}.log")
    start = time.monotonic()
    with open(log_file, "wb") as out:
        process = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://{host}:{port}"
    server = VLLMServer(process, url, log_file, 0.0, args)
    try:
        wait_healthy(url, startup_timeout_s, process)
    except BaseException:
        tail = server.log_tail()
        server.stop()
        raise EngineError(
            f"vLLM did not become healthy at {url} within {startup_timeout_s:.0f}s; "
            f"log {log_file}:\n{tail}"
        ) from None
    server.startup_s = time.monotonic() - start
    return server


def wait_healthy(
    url: str, timeout_s: float, process: subprocess.Popen[bytes] | None = None
) -> None:
    """Poll `url`/health until it answers 200; raise `EngineError` on timeout or process exit."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise EngineError(f"the vLLM process exited with status {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2.0)
    raise EngineError(f"vLLM at {url} was not healthy within {timeout_s:.0f}s")
