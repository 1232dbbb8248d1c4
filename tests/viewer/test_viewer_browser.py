"""The viewer in a real browser: headless Debian Chromium driven by Selenium against a real
gateway (FakeEngine, real tokenizer) holding a session recorded by the real `openai` client.

Needs `scripts/install_browser.sh` (chromium, chromium-driver, selenium). The screenshot is saved
under pytest's tmp dir and its path printed; with RELAYRL_VIEWER_SCREENSHOT=docs/viewer.png it is
also copied there (how the README's picture is made).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.conftest import ADMIN, fake_gateway

ROOT = Path(__file__).resolve().parents[2]
TOOL_REPLY = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
ANSWER = "The answer is 5."
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                    "b": {"type": "number"}}}}}]


def _driver():
    chromium = shutil.which("chromium")
    chromedriver = shutil.which("chromedriver")
    if not chromium or not chromedriver:
        pytest.fail("no chromium/chromedriver: run scripts/install_browser.sh")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1500,1300"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(chromedriver), options=opts)


def _record_episode(url: str, reward: float) -> str:
    """One tool-using episode through the real openai client; returns the session id."""
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN}"}) as admin:
        s = admin.post("/rl/start_session", json={"task_id": "add-2-3"}).json()
    client = openai.OpenAI(base_url=url + "/v1", api_key=s["api_key"], max_retries=0)
    messages = [{"role": "user", "content": "What is 2 + 3? Use the tool."}]
    first = client.chat.completions.create(model="relayrl-test", messages=messages, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    second = client.chat.completions.create(model="relayrl-test", messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == ANSWER
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN}"}) as admin:
        admin.post("/rl/set_reward", json={"reward": reward},
                   headers={"authorization": f"Bearer {s['api_key']}"}).raise_for_status()
    return s["session_id"]


def test_viewer_lists_a_real_session_and_shows_its_tokens(model_dir: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    with (run / "logs" / "metrics.jsonl").open("w") as f:
        for step in range(1, 9):  # a run's curves, as the trainer writes them
            f.write(json.dumps({"step": step, "reward_mean": 0.2 + 0.05 * step, "loss": 1 / step,
                                "approx_kl": 0.01 * step, "tool_call_rate": 0.5 + 0.04 * step})
                    + "\n")
    gw = fake_gateway(model_dir, tmp_log=str(run / "sessions.db"))
    driver = None
    try:
        gw.script.replies += [TOOL_REPLY, ANSWER]
        sid = _record_episode(gw.url, reward=1.0)

        # without the admin key the page and its API refuse
        assert httpx.get(gw.url + "/view/").status_code == 401
        assert httpx.get(gw.url + "/view/api/sessions").status_code == 401

        from selenium.webdriver.common.by import By
        from selenium.webdriver.support import expected_conditions as ec
        from selenium.webdriver.support.ui import WebDriverWait

        driver = _driver()
        driver.get(f"{gw.url}/view/?token={ADMIN}")
        wait = WebDriverWait(driver, 20)
        assert "token=" not in driver.current_url  # swapped for a cookie and dropped
        row = wait.until(ec.element_to_be_clickable(
            (By.CSS_SELECTOR, f'#sessions tbody tr[data-session="{sid}"]')))
        assert "1.00" in row.text  # its reward
        row.click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#episode .tok.trained"))
        trained = "".join(e.text for e in driver.find_elements(By.CSS_SELECTOR,
                                                                "#episode .tok.trained"))
        context = "".join(e.text for e in driver.find_elements(By.CSS_SELECTOR,
                                                                "#episode .tok.ctx"))
        assert "answer is 5" in trained  # the model's tokens carry the loss mask
        assert "What is 2 + 3" in context  # the prompt is context, not trained
        assert "add" in driver.find_element(By.CSS_SELECTOR, "#episode .toolcall").text
        assert len(driver.find_elements(By.CSS_SELECTOR, "#episode .boundary")) == 2
        assert driver.find_elements(By.CSS_SELECTOR, "#episode .vmark")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '#charts canvas[data-chart="KL"]'))
        time.sleep(0.3)  # let the canvases paint before the picture
        shot = tmp_path / "viewer.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        print(f"\nviewer screenshot: {shot}")
        target = os.environ.get("RELAYRL_VIEWER_SCREENSHOT")
        if target:
            shutil.copyfile(shot, ROOT / target)
            print(f"viewer screenshot copied to {ROOT / target}")
    finally:
        if driver is not None:
            driver.quit()
        gw.thread.stop()
