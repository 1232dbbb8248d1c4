"""The viewer's JSON API, on a live gateway and over a finished run's log (no browser)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from starlette.testclient import TestClient

from relayrl.viewer import run_dir_app
from tests.gateway.conftest import ADMIN, fake_gateway

ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN}"}


def _episode(url: str, reply: str, reward: float | None, task: str) -> str:
    with httpx.Client(base_url=url, headers=ADMIN_HEADERS) as admin:
        s = admin.post("/rl/start_session", json={"task_id": task}).json()
        key = {"authorization": f"Bearer {s['api_key']}"}
        r = admin.post("/v1/chat/completions", headers=key, json={
            "model": "m", "messages": [{"role": "user", "content": f"task {task}"}]})
        r.raise_for_status()
        if reward is not None:
            admin.post("/rl/set_reward", headers=key, json={"reward": reward}).raise_for_status()
    return s["session_id"]


def _run(model_dir: str, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    run = tmp_path / "run"
    run.mkdir()
    gw = fake_gateway(model_dir, tmp_log=str(run / "sessions.db"))
    try:
        gw.script.replies += ["good", "bad", "cut"]
        ids = {"good": _episode(gw.url, "good", 1.0, "a"), "bad": _episode(gw.url, "bad", 0.0, "b"),
               "aborted": _episode(gw.url, "cut", None, "c")}
        with httpx.Client(base_url=gw.url, headers=ADMIN_HEADERS) as admin:
            admin.post("/rl/abort_session", json={"session_id": ids["aborted"]}).raise_for_status()
            live = admin.get("/view/api/sessions").json()
            assert {s["id"] for s in live["sessions"]} == set(ids.values())
            # anyone without the key is refused, and the key is never echoed back
            for path in ("/view/", "/view/api/sessions", f"/view/api/sessions/{ids['good']}",
                         "/view/api/metrics", "/view/static/viewer.js"):
                r = httpx.get(gw.url + path)
                assert r.status_code == 401, path
                assert ADMIN not in r.text
            r = httpx.get(gw.url + "/view/?token=wrong", follow_redirects=False)
            assert r.status_code == 401 and ADMIN not in r.text
            r = httpx.get(gw.url + f"/view/?token={ADMIN}", follow_redirects=False)
            assert r.status_code == 303 and "token" not in r.headers["location"]
            cookie = r.cookies["relayrl_view"]
            assert ADMIN not in cookie
            page = httpx.get(gw.url + "/view/", cookies={"relayrl_view": cookie})
            assert page.status_code == 200 and "viewer.js" in page.text
    finally:
        gw.thread.stop()
    (run / "logs").mkdir()
    (run / "logs" / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "reward_mean": 0.5}) + "\n" + '{"step": 2, "rew')  # a torn last line
    return run, ids


def test_a_finished_run_is_listed_filtered_and_decoded(model_dir: str, tmp_path: Path) -> None:
    run, ids = _run(model_dir, tmp_path)
    with TestClient(run_dir_app(run, model=model_dir)) as c:
        assert c.get("/", follow_redirects=False).headers["location"] == "/view/"
        every = c.get("/view/api/sessions").json()
        assert every["total"] == 3
        assert every["facets"]["abort_reason"] == ["session_aborted"]
        by_id = {s["id"]: s for s in every["sessions"]}
        assert by_id[ids["good"]]["reward"] == 1.0 and by_id[ids["bad"]]["reward"] == 0.0
        assert by_id[ids["aborted"]]["state"] == "aborted"

        def matched(**q: str) -> set[str]:
            return {s["id"] for s in c.get("/view/api/sessions", params=q).json()["sessions"]}

        assert matched(min_reward="0.5") == {ids["good"]}
        assert matched(max_reward="0.5") == {ids["bad"]}
        assert matched(abort_reason="session_aborted") == {ids["aborted"]}
        assert matched(abort_reason="none") == {ids["good"], ids["bad"]}
        assert matched(branch_reason="first") == set(ids.values())
        assert matched(branch_reason="history_edited") == set()
        assert len(matched(min_reward="not-a-number")) == 3  # ignored, not a 500

        ep = c.get(f"/view/api/sessions/{ids['good']}").json()
        (row,) = ep["rows"]
        text = "".join(t[0] for t in row["tokens"])
        trained = "".join(t[0] for t in row["tokens"] if t[1])
        assert "task a" in text and trained.startswith("good")
        assert all(t[2] is not None and t[3] >= 0 for t in row["tokens"] if t[1])
        assert all(t[2] is None and t[3] == -1 for t in row["tokens"] if not t[1])
        (turn,) = row["turns"]
        assert turn["reward"] == 1.0 and row["tokens"][turn["start"]][1] == 1
        # an aborted episode is still shown (it is what one debugs), just never trained on
        assert c.get(f"/view/api/sessions/{ids['aborted']}").json()["rows"]
        assert c.get("/view/api/sessions/nope").status_code == 404
        r = c.get("/view/api/nope")
        assert r.status_code == 404 and r.json()["error"]["type"] == "viewer_error"
        metrics = c.get("/view/api/metrics").json()
        assert metrics["records"] == [{"step": 1, "reward_mean": 0.5}]
        assert c.get("/view/static/../app.py").status_code == 404
