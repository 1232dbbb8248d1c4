"""Kill the gateway process and restart it on the same log: nothing recorded is lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
from openai import OpenAI

ADMIN = "durable-admin"


def start(model_dir: str, log: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli", "gateway", "--engine", "fake", "--model", model_dir,
         "--port", "0", "--admin-key", ADMIN, "--log", str(log)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the gateway prints its address (or dies)
    assert "relayrl gateway listening at http://127.0.0.1:" in line, proc.stderr.read()
    return proc, line.strip().rsplit(" ", 1)[-1]


def test_a_killed_gateway_restarted_on_its_log_loses_no_call(model_dir: str, tmp_path: Path) -> None:
    log = tmp_path / "calls.sqlite"
    admin = {"authorization": f"Bearer {ADMIN}"}
    proc, url = start(model_dir, log)
    try:
        s = httpx.post(url + "/rl/start_session", json={"task_id": "d"}, headers=admin).json()
        client = OpenAI(base_url=url + "/v1", api_key=s["api_key"], max_retries=0)
        msgs = [{"role": "user", "content": "one"}]
        r = client.chat.completions.create(model="m", messages=msgs)
        msgs += [r.choices[0].message.model_dump(), {"role": "user", "content": "two"}]
        client.chat.completions.create(model="m", messages=msgs)
        httpx.post(url + "/rl/set_reward", json={"reward": 2.0},
                   headers={"authorization": f"Bearer {s['api_key']}"}).raise_for_status()
        before = httpx.post(url + "/export_trajectories", headers=admin,
                            json={"session_id": s["session_id"], "style": "concat"}).json()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    proc2, url2 = start(model_dir, log)
    try:
        after = httpx.post(url2 + "/export_trajectories", headers=admin,
                           json={"session_id": s["session_id"], "style": "concat"}).json()
        assert after["rows"] == before["rows"]
        assert after["rows"][0]["reward"] == 2.0
        # the recovered session still takes calls with its old key, extending the same segment
        client2 = OpenAI(base_url=url2 + "/v1", api_key=s["api_key"], max_retries=0)
        msgs2 = [*msgs, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "3"}]
        client2.chat.completions.create(model="m", messages=msgs2)
        rows = httpx.post(url2 + "/export_trajectories", headers=admin,
                          json={"session_id": s["session_id"], "style": "concat"}).json()["rows"]
        assert len(rows) == 1 and len(rows[0]["input_ids"]) > len(before["rows"][0]["input_ids"])
    finally:
        proc2.terminate()
        proc2.wait(10)


def test_a_non_loopback_host_without_admin_key_is_refused(model_dir: str) -> None:
    r = subprocess.run([sys.executable, "-m", "relayrl.cli", "gateway", "--engine", "fake",
                        "--model", model_dir, "--host", "0.0.0.0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "admin key" in r.stderr


def test_kill_9_mid_run_three_times_loses_and_duplicates_no_finished_call(
        model_dir: str, tmp_path: Path) -> None:
    """Calls keep arriving when the gateway is killed; every answered call survives, once."""
    import threading

    log = tmp_path / "calls.sqlite"
    admin = {"authorization": f"Bearer {ADMIN}"}
    answered: dict[str, set[str]] = {}  # session id -> interaction ids the client got back
    for _ in range(3):  # three kills on the same log
        proc, url = start(model_dir, log)
        stop = threading.Event()

        def caller(url: str = url, stop: threading.Event = stop) -> None:
            with httpx.Client(base_url=url, timeout=30) as c:
                try:
                    for i in range(200):  # bounded; the kill normally comes first
                        s = c.post("/rl/start_session", json={}, headers=admin).json()
                        answered[s["session_id"]] = set()
                        key = {"authorization": f"Bearer {s['api_key']}"}
                        for turn in range(3):
                            if stop.is_set():
                                return
                            r = c.post("/v1/chat/completions", headers=key, json={
                                "model": "m", "messages": [{"role": "user",
                                                            "content": f"{i} {turn}"}]})
                            iid = r.json()["id"].removeprefix("chatcmpl-")
                            answered[s["session_id"]].add(iid)
                except httpx.HTTPError:
                    return  # killed mid-call: that call was never answered

        worker = threading.Thread(target=caller)
        worker.start()
        deadline, target = 400, sum(map(len, answered.values())) + 12
        while sum(map(len, answered.values())) < target and deadline:  # let calls flow
            deadline -= 1
            threading.Event().wait(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        stop.set()
        worker.join(30)
    proc, url = start(model_dir, log)
    try:
        for sid, ids in answered.items():
            rows = httpx.post(url + "/export_trajectories", headers=admin,
                              json={"session_id": sid, "style": "individual"}).json()["rows"]
            exported = [i for r in rows for i in r["interaction_ids"]]
            assert len(exported) == len(set(exported)), f"{sid}: a call is duplicated"
            assert ids <= set(exported), f"{sid}: answered calls lost: {ids - set(exported)}"
        assert sum(map(len, answered.values())) >= 36  # three runs of at least 12 calls
    finally:
        proc.terminate()
        proc.wait(10)
