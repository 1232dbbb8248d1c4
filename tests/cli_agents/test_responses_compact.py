"""`POST /v1/responses/compact` (OpenAI's server-side compaction) is refused with a 404 in OpenAI's
error format, never a 500: relayrl does not invent the opaque compaction item's format
(docs/compaction.md says why); Codex pointed at relayrl compacts locally."""

from __future__ import annotations

import httpx

from tests.gateway.conftest import Gateway


def test_responses_compact_is_a_clear_404(gw: Gateway) -> None:
    s = gw.start_session()
    body = {"model": "policy", "input": [{"role": "user", "content": "hi"}],
            "instructions": "Be brief."}
    r = httpx.post(s["base_url"] + "/responses/compact", json=body, timeout=30,
                   headers={"authorization": f"Bearer {s['api_key']}"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "not_found_error" and "responses/compact" in err["message"]
    assert s["api_key"] not in r.text  # the session key in the path is not echoed
