"""The service's gateways report the trainer and refuse sessions from their very first request.

CI once caught `/rl/v1/status` without its `trainer` section: the gateway listened (and printed
its URL) before the service attached its hooks, so an agent quick enough to ask in between saw a
gateway that would also have admitted sessions during the SFT warm-start.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from relayrl.config import RelayConfig
from relayrl.engine.fake import FakeEngine
from relayrl.gateway.routes_rl_v1 import state_of
from relayrl.gateway.server import GatewayThread
from relayrl.service import launcher as service_launcher

ADMIN = "admin-key-for-the-trainer-view-test"


class _Actor:
    """The little of an Actor that the service launcher reads."""

    def __init__(self, model_dir: str) -> None:
        self._dir = model_dir
        self.step = 0
        self.version = 0

    def model_dir(self) -> str:
        return self._dir


@pytest.mark.parametrize("replicas", [1, 2])
async def test_hooks_are_installed_before_any_gateway_listens(
        model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replicas: int) -> None:
    seen: list[tuple[bool, bool]] = []
    real_start = GatewayThread.start

    def start(self: GatewayThread, *a: Any, **kw: Any) -> GatewayThread:
        v1 = state_of(self.app)
        seen.append((v1.status_extra is not None, v1.admit is not None))
        return real_start(self, *a, **kw)

    async def fake_engine(_cfg: Any, _actor: Any) -> tuple[FakeEngine, None]:
        return FakeEngine(["hi"], tokenizer_path=model_dir), None

    monkeypatch.setattr(GatewayThread, "start", start)
    monkeypatch.setattr(service_launcher, "start_engine", fake_engine)
    monkeypatch.setattr("relayrl.launch.local.start_engine", fake_engine)
    cfg = RelayConfig(model=model_dir, fileroot=str(tmp_path))
    cfg = replace(cfg, gateway=replace(cfg.gateway, admin_key=ADMIN, port=0, replicas=replicas))
    services = await service_launcher.ServiceLauncher(cfg)(_Actor(model_dir))
    try:
        assert seen == [(True, True)] * replicas
        url = services.replicas.url if services.replicas is not None else services.gateway.url
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            status = (await http.get("/rl/v1/status")).json()
            assert status["trainer"]["phase"] == "warming_up"
            r = await http.post("/rl/v1/start_session", json={},
                                headers={"authorization": f"Bearer {ADMIN}"})
            assert r.status_code == 429 and "warming up" in r.json()["error"]["message"]
    finally:
        await services.aclose()
