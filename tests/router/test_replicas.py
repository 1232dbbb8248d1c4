"""`start_replicas`: N gateway + engine pairs behind one router, sessions spread over them."""

from __future__ import annotations

import httpx

from relayrl.engine.fake import FakeEngine
from relayrl.gateway.config import GatewayConfig
from relayrl.launch.replicas import start_replicas
from tests.router.conftest import ADMIN


def test_replicas_share_one_url_and_split_the_sessions(model_dir: str) -> None:
    cfg = GatewayConfig(model=model_dir, engine="fake", admin_key=ADMIN, model_label="t")
    engines = [FakeEngine(["from replica"], tokenizer_path=model_dir) for _ in range(2)]
    with start_replicas(cfg, 2, engines=engines) as rep:
        auth = {"authorization": f"Bearer {ADMIN}"}
        keys = [httpx.post(rep.url + "/rl/v1/start_session", json={}, headers=auth).json()
                for _ in range(4)]
        for s in keys:
            r = httpx.post(s["base_url"] + "/chat/completions",
                           json={"model": "t", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and "from replica" in r.text
        held = [sum(1 for s in g.deps.store if len(s.interactions) == 1) for g in rep.gateways]
        assert held == [2, 2]
