"""Using a trained policy: `TrainedPolicy` in Python and `relayrl serve-model` over HTTP."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from relayrl.launch.inference import TrainedPolicy, find_checkpoint
from relayrl.train.actor import Actor
from relayrl.train.config import TrainConfig
from tests.train.conftest import tiny_llama_dir  # noqa: F401 - a fixture used below

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_root(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str) -> Path:  # noqa: F811
    """A fileroot holding experiment `exp`, trial `t`, with a checkpoint at step 0."""
    root = tmp_path_factory.mktemp("runs")
    Actor(tiny_llama_dir, TrainConfig(bf16=False)).save_checkpoint(root / "exp" / "t" / "checkpoints")
    return root


async def test_a_trained_policy_loads_by_experiment_and_trial_and_generates(run_root: Path) -> None:
    path = find_checkpoint(str(run_root), "exp", "t")
    assert path.name.startswith("step_")
    async with TrainedPolicy.load("exp", "t", fileroot=str(run_root)) as policy:
        text = await policy.generate("What is 3 + 4?", max_tokens=6)
        again = await policy.generate([{"role": "user", "content": "What is 3 + 4?"}],
                                      max_tokens=6)
    assert isinstance(text, str) and text == again  # greedy: the same answer twice


def test_serve_model_answers_on_all_three_apis_and_records_nothing(run_root: Path,
                                                                    tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve-model.log"
    proc = subprocess.Popen([sys.executable, "-m", "relayrl.cli", "serve-model", "--experiment",
                             "exp", "--trial", "t", "--fileroot", str(run_root), "--port",
                             str(port)], stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # a loaded CI machine loads models slowly
        while "listening at" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        chat = oa.chat.completions.create(model="exp/t", max_tokens=5,
                                          messages=[{"role": "user", "content": "hi"}])
        assert chat.model == "exp/t" and chat.choices[0].message.role == "assistant"
        resp = oa.responses.create(model="exp/t", input="hi", max_output_tokens=5)
        assert resp.status in ("completed", "incomplete")
        an = anthropic.Anthropic(base_url=url, api_key="none")
        msg = an.messages.create(model="exp/t", max_tokens=5,
                                 messages=[{"role": "user", "content": "hi"}])
        assert msg.role == "assistant"
        health = httpx.get(f"{url}/health").json()
        assert health.get("submitted", 0) == 0  # no session: nothing recorded
    finally:
        proc.terminate()
        proc.wait(30)
