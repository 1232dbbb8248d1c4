"""Schema fuzz (issue 10): schemathesis drives every route of the published OpenAPI document,
with no key, the admin key and a live session's key: no answer is ever a 5xx.

In-process over ASGI with a FakeEngine (the routes' logic is what is fuzzed, not the model), a
bounded and derandomized number of examples per route, so it runs in CI in about a minute.
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from relayrl.engine.fake import FakeEngine
from relayrl.gateway.app import create_app
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import build_deps
from relayrl.models import model_path

ADMIN = "fuzz-admin-key-0123456789"
MAX_EXAMPLES = 6
"""Generated requests per route, each sent with the three keys."""


def _app() -> Any:
    path = str(model_path("smollm2-135m-instruct"))
    engine = FakeEngine(lambda request: "ok", tokenizer_path=path, context_length=4096)
    cfg = GatewayConfig(model=path, engine="fake", admin_key=ADMIN, max_staleness=None,
                        model_label="relayrl-fuzz", max_sessions=100_000)
    return create_app(build_deps(cfg, engine=engine))


APP = _app()
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


def _session_key() -> str:
    """A fresh live session's key (fuzzed calls may end or abort the previous one)."""
    session = APP.state.deps.store.start_session(task_id="fuzz")
    assert session.api_key is not None
    return session.api_key


def _operations() -> list[Any]:
    return [result.ok() for result in schema.get_all_operations()]


OPERATIONS = _operations()


def test_the_fuzzer_sees_every_route() -> None:
    seen = {(op.method.upper(), op.path) for op in OPERATIONS}
    assert ("POST", "/v1/chat/completions") in seen and ("POST", "/v1/messages") in seen
    assert ("POST", "/s/{session_key}/v1/responses") in seen and len(seen) >= 30


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: f"{op.method.upper()} {op.path}")
def test_no_route_answers_5xx_to_any_key(operation: Any) -> None:
    # one generated request, sent three times: no key, the admin key, a live session's key
    @given(case=operation.as_strategy())
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    def run(case: Any) -> None:
        key = _session_key()
        for who, headers in (("nobody", {}), ("admin", {"authorization": f"Bearer {ADMIN}"}),
                             ("session", {"authorization": f"Bearer {key}"})):
            if who == "session" and "session_key" in (case.path_parameters or {}):
                case.path_parameters["session_key"] = key
            response = case.call(headers=headers)
            assert response.status_code < 500, (who, case.method, case.formatted_path,
                                                response.status_code, response.text[:500])

    run()
