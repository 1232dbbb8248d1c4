"""The viewer shows compaction and sub-agent segments linked to the segment they continue: in its
JSON API and in a real browser (headless Chromium, `scripts/install_browser.sh`)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from relayrl.trajectory.links import SUMMARY_PREFIXES, SUMMARY_REQUEST_MARKERS
from tests.gateway.conftest import ADMIN, Gateway, fake_gateway

ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN}"}
TASK = "List the test files of this repository and report them."
SUMMARY = "The user wants the test files listed.\nA sub-agent found tests/test_a.py only."


def _linked_episode(url: str) -> str:
    """A main agent that starts a sub-agent (Agent tool), then compacts (Codex's prompt)."""
    with httpx.Client(base_url=url, headers=ADMIN_HEADERS, timeout=60) as admin:
        s = admin.post("/rl/start_session", json={"task_id": "list"}).json()
        key = {"authorization": f"Bearer {s['api_key']}"}

        def chat(messages: list[dict]) -> dict:
            r = admin.post("/v1/chat/completions", headers=key,
                           json={"model": "m", "messages": messages})
            r.raise_for_status()
            return r.json()["choices"][0]["message"]

        h = [{"role": "user", "content": "Which test files are there?"}]
        r1 = chat(h)
        chat([{"role": "system", "content": "You are a sub-agent."},
              {"role": "user", "content": TASK}])
        h += [r1, {"role": "tool", "tool_call_id": r1["tool_calls"][0]["id"],
                   "content": "tests/test_a.py"},
              ]
        r2 = chat(h)
        h += [r2, {"role": "user", "content": dict(SUMMARY_REQUEST_MARKERS)["codex"]}]
        summary = chat(h)["content"]
        chat([h[0], {"role": "user", "content": dict(SUMMARY_PREFIXES)["codex"] + " " + summary}])
        admin.post("/rl/v1/finalize", headers=key, json={"final_reward": 1.0}).raise_for_status()
    return s["session_id"]


def _gateway(model_dir: str) -> Gateway:
    gw = fake_gateway(model_dir)
    call = json.dumps({"name": "Agent", "arguments": {"description": "list", "prompt": TASK}})
    gw.script.replies += [f"<tool_call>{call}</tool_call>", "tests/test_a.py",
                          "There is tests/test_a.py.", SUMMARY, "Only tests/test_a.py."]
    return gw


def test_the_episode_api_lists_segments_with_their_links(model_dir: str) -> None:
    gw = _gateway(model_dir)
    try:
        sid = _linked_episode(gw.url)
        data = httpx.get(f"{gw.url}/view/api/sessions/{sid}", headers=ADMIN_HEADERS,
                         timeout=60).json()
    finally:
        gw.thread.stop()
    segs = {g["reason"]: g for g in data["segments"]}
    assert set(segs) == {"first", "subagent", "compaction"}
    main = segs["first"]["id"]
    assert segs["subagent"]["parent_segment_id"] == main
    assert segs["subagent"]["link_rule"] == "tool:Agent"
    assert segs["compaction"]["parent_segment_id"] == main
    assert segs["compaction"]["link_rule"] == "summary_prefix:codex"
    rows = {r["branch_reason"]: r for r in data["rows"]}
    assert rows["compaction"]["parent_segment_id"] == main
    assert rows["subagent"]["parent_segment_id"] == main and rows["first"]["parent_segment_id"] is None


def test_the_browser_shows_the_links(model_dir: str) -> None:
    if not shutil.which("chromium") or not shutil.which("chromedriver"):
        pytest.fail("no chromium/chromedriver: run scripts/install_browser.sh")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    gw = _gateway(model_dir)
    driver = None
    try:
        sid = _linked_episode(gw.url)
        opts = webdriver.ChromeOptions()
        opts.binary_location = shutil.which("chromium") or ""
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
            opts.add_argument(arg)
        driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or ""),
                                  options=opts)
        driver.get(f"{gw.url}/view/?token={ADMIN}")
        wait = WebDriverWait(driver, 30)
        wait.until(ec.element_to_be_clickable(
            (By.CSS_SELECTOR, f'#sessions tbody tr[data-session="{sid}"]'))).click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#episode ul.segments li"))
        items = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#episode ul.segments li")]
        assert len(items) == 3
        assert any("subagent" in t and "continues" in t and "tool:Agent" in t for t in items)
        assert any("compaction" in t and "summary_prefix:codex" in t for t in items)
        # each linked row's header links to its parent segment's row, which is on the page
        heads = driver.find_elements(By.CSS_SELECTOR, "#episode .row .head a.seglink")
        assert len(heads) == 2
        for a in heads:
            target = a.get_attribute("href").split("#", 1)[1]
            assert driver.find_elements(By.ID, target)
    finally:
        if driver is not None:
            driver.quit()
        gw.thread.stop()
