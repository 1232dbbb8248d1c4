"""Which worker method `VLLMEngine` reloads weights with, against a loopback stub of vLLM's routes.

A server started by relayrl has relayrl's worker extension (`relayrl_reload_weights`: vLLM's reload,
then the CPU kernels packed from tied weights are rebuilt; tests/engine/test_vllm_engine.py checks
the logprobs after an update on the real server). A user's own server may not: the engine then
falls back to vLLM's `reload_weights` with one warning, and any other failure is raised as it is.
The error text for a missing method is vLLM 0.32's own (seen from a real server).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from relayrl.engine.vllm import VLLMEngine
from relayrl.engine.vllm_server import WORKER_EXTENSION, WORKER_EXTENSION_DIR
from relayrl.errors import EngineError


@dataclass
class Stub:
    """What the fake server knows and received."""

    methods: set[str] = field(default_factory=lambda: {"reload_weights"})
    fail_reload: bool = False
    calls: list[str] = field(default_factory=list)


def build_app(stub: Stub, model_dir: str) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": [{"id": "m", "root": model_dir, "max_model_len": 2048}]}

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> JSONResponse:
        method = (await request.json())["method"]
        stub.calls.append(method)
        if method not in stub.methods:
            message = (f"Call to collective_rpc method failed: Worker failed with error "
                       f"''CPUWorker' object has no attribute '{method}'', please check the stack "
                       "trace above for the root cause")
            return JSONResponse({"error": {"message": message, "type": "InternalServerError",
                                           "code": 500}}, status_code=500)
        if stub.fail_reload:
            return JSONResponse({"error": {"message": "Call to collective_rpc method failed: "
                                           "no safetensors in /nowhere", "code": 500}},
                                status_code=500)
        return JSONResponse({"results": [0]})

    for route in ("/pause", "/resume", "/reset_prefix_cache", "/update_weight_version"):
        app.add_api_route(route, _recorder(stub, route), methods=["POST"])
    return app


def _recorder(stub: Stub, route: str):
    async def endpoint() -> dict:
        stub.calls.append(route)
        return {}

    return endpoint


@pytest.fixture
def served(model_dir: str) -> Iterator[tuple[Stub, str]]:
    stub = Stub()
    server = uvicorn.Server(uvicorn.Config(build_app(stub, model_dir), host="127.0.0.1", port=0,
                                           log_level="warning"))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "stub server did not start"
        time.sleep(0.02)
    yield stub, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


def test_the_extension_is_used_when_the_server_has_it(served, tmp_path: Path) -> None:
    stub, url = served
    stub.methods.add("relayrl_reload_weights")
    engine = VLLMEngine(url)
    assert asyncio.run(engine.update_weights(str(tmp_path))) == 1
    assert stub.calls == ["/pause", "relayrl_reload_weights", "/reset_prefix_cache",
                          "/update_weight_version", "/resume"]


def test_a_server_without_the_extension_gets_vllms_reload_and_one_warning(
        served, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    stub, url = served
    engine = VLLMEngine(url)
    with caplog.at_level(logging.WARNING, logger="relayrl.engine.vllm"):
        assert asyncio.run(engine.update_weights(str(tmp_path))) == 1
        assert asyncio.run(engine.update_weights(str(tmp_path))) == 2
    reloads = [c for c in stub.calls if "reload" in c]
    assert reloads == ["relayrl_reload_weights", "reload_weights", "reload_weights"]
    warnings = [r for r in caplog.records if "worker extension" in r.getMessage()]
    assert len(warnings) == 1 and "--worker-extension-cls" in warnings[0].getMessage()


def test_a_failed_reload_is_raised_and_the_server_resumed(served, tmp_path: Path) -> None:
    stub, url = served
    stub.methods.add("relayrl_reload_weights")
    stub.fail_reload = True
    engine = VLLMEngine(url)
    with pytest.raises(EngineError, match="no safetensors"):
        asyncio.run(engine.update_weights(str(tmp_path)))
    assert stub.calls[-1] == "/resume" and engine.version == 0
    assert stub.calls.count("relayrl_reload_weights") == 1  # not retried as something else


def test_the_extension_module_is_where_the_server_looks_for_it() -> None:
    module, _, cls = WORKER_EXTENSION.rpartition(".")
    source = (WORKER_EXTENSION_DIR / f"{module}.py").read_text()
    assert f"class {cls}" in source and "def relayrl_reload_weights" in source
    assert "relayrl." not in source.replace("relayrl_", "")  # runs in vLLM's venv: no relayrl
