"""The manual-trajectory example agent runs unchanged inside AgentSession/AgentRunner.

`MyAgent` below is a user's agent exactly as the session API's example writes it (aiohttp on
OPENAI_BASE_URL with no key, `/v1/chat/completions`, `/rl/v1/set_reward` with `completion_id`,
`/rl/v1/finalize`). Only `dataset` and the epoch count are ours.
"""

from __future__ import annotations

import os

import pytest
from aiohttp import ClientSession

from relayrl.client import AgentRunner, AgentSession
from relayrl.trajectory import SessionState
from tests.gateway.conftest import ADMIN, Gateway


# ---- the example agent, as written ("Example: Manual Trajectory Management") -----------------
class MyAgent:
    async def run(self, prompt):
        url = os.environ['OPENAI_BASE_URL']
        async with ClientSession(base_url=url) as session:
            ################ USER CODE START ################
            # Standard OpenAI chat completion request
            response = await session.post("/v1/chat/completions", json={
                "model": "gpt-3.5-turbo",
                "messages": [{"role": "user", "content": prompt}]
            })
            completion_data = await response.json()
            ################# USER CODE END #################

            # NEW HERE
            # Optional: Set intermediate reward for this completion
            await session.post("/rl/v1/set_reward", json={
                "completion_id": completion_data["id"],
                "reward": 0.5
            })

            ################ USER CODE START ################
            # ... additional agent steps ...
            ################# USER CODE END #################

            # NEW HERE
            # Finalize trajectory and set terminal reward
            await session.post("/rl/v1/finalize", json={
                "final_reward": 1.0
            })
# ---- end of the example's code ----------------------------------------------------------------

dataset = ["What is 2 + 2?", "Name a prime number.", "Spell 'cat'."]


@pytest.fixture
def example_env(open_svc: Gateway, monkeypatch: pytest.MonkeyPatch) -> Gateway:
    for name in ("RELAYRL_URL", "RELAYRL_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OPENAI_BASE_URL", open_svc.url)  # as the example's __main__ does
    monkeypatch.setenv("RELAYRL_API_KEY", ADMIN)  # the service's key, from its key file
    return open_svc


def check_trajectories(gw: Gateway, expected: int) -> None:
    sessions = list(gw.deps.store)
    assert len(sessions) == expected
    for s in sessions:
        assert s.state == SessionState.ENDED and s.final_reward == 1.0
        [call] = s.interactions
        assert call.reward == 0.5
        assert call.conversation.messages[0].content in dataset


async def test_the_manual_example_runs_unchanged_inside_agent_session(example_env: Gateway) -> None:
    # the example's run_training, two epochs instead of five
    async def run_training():
        for epoch in range(2):  # noqa: B007 (the example's loop, as written)
            for prompt in dataset:
                # All requests within this context are grouped into a single trajectory
                async with AgentSession():
                    await MyAgent().run(prompt)

    await run_training()
    check_trajectories(example_env, 2 * len(dataset))


async def test_the_batch_example_runs_unchanged_with_agent_runner(example_env: Gateway) -> None:
    async def run_training():
        for epoch in range(2):  # noqa: B007 (the example's loop, as written)
            # AgentRunner handles trajectory management automatically
            await AgentRunner().run(MyAgent().run, dataset)

    await run_training()
    check_trajectories(example_env, 2 * len(dataset))


async def test_outside_a_session_the_example_agent_records_nothing(example_env: Gateway) -> None:
    # without AgentSession the agent has no session key: the gateway (which has an admin key)
    # refuses even its completion with a 401, whose body has no "id", so the example's code
    # fails on it; nothing is recorded, which is why the example wraps it
    with pytest.raises(KeyError):
        await MyAgent().run(dataset[0])
    assert list(example_env.deps.store) == []


def test_the_example_in_docs_service_md_runs_as_an_external_process(open_svc: Gateway) -> None:
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "service.md").read_text()
    section = doc[doc.index("## An agent that manages its own trajectory"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    env = {**os.environ, "OPENAI_BASE_URL": open_svc.url, "PYTHONPATH": str(root / "src")}
    for name in ("RELAYRL_URL", "RELAYRL_API_KEY", "OPENAI_API_KEY"):
        env.pop(name, None)
    env["RELAYRL_API_KEY"] = ADMIN
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    sessions = list(open_svc.deps.store)
    assert len(sessions) == 3 + 4  # three epochs of one question, then one group of four
    assert all(s.state == SessionState.ENDED and s.final_reward in (0.0, 1.0) for s in sessions)
    assert all(len(s.interactions) == 1 and s.interactions[0].reward == 0.1 for s in sessions)
    assert len({s.task_id for s in sessions}) == 2  # the question itself, then the runner's group
