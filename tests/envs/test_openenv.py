"""OpenEnv: an environment server's reset/step loop driven by the policy through the gateway.

OpenEnv ships no environment on PyPI that runs without Docker or a download, so these tests use
examples/openenv/guess_env.py, a small one built with OpenEnv's own classes (`Environment`,
`Action`, `Observation`, `create_app`), served over real HTTP/WebSocket on 127.0.0.1 and played
with OpenEnv's own client. Its reward is delayed: None on every step but the last.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("openenv", reason="openenv is not installed (pip install "
                    "'relayrl[openenv]')")

from relayrl.client.session_client import SessionClient
from relayrl.envs import openenv as oeenv
from relayrl.errors import ConfigError
from relayrl.workflow import AgentWorkflow, episode_scope, resolve_workflow
from tests.episodes import episode_ctx
from tests.gateway.conftest import Gateway

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "openenv"
AGENT = "relayrl.envs.openenv:OpenEnvAgent"
ENV = "guess_env:GuessEnvironment"


@pytest.fixture(scope="module", autouse=True)
def example_on_path() -> Iterator[None]:
    sys.path.insert(0, str(EXAMPLE))
    yield
    sys.path.remove(str(EXAMPLE))


def _secret(seed: int) -> int:
    return random.Random(seed).randrange(10)  # what guess_env draws


def _wrong(seed: int) -> str:
    return str((_secret(seed) + 1) % 10)


async def _episode(wf: AgentWorkflow, data: dict, group: str = "grp") -> list:
    with episode_scope(episode_ctx(group=group)):
        rows = await wf.arun_episode(None, data)
    return list((rows or {}).values())


async def test_a_delayed_reward_credits_every_turn_of_the_episode(
        gw: Gateway, client: SessionClient) -> None:
    seed = 5
    gw.script.replies.extend(["x", _wrong(seed), str(_secret(seed))])
    wf = resolve_workflow(AGENT, {"environment": ENV, "observation_field": "feedback",
                                  "max_turns": 5}, gateway=client)
    agent = wf.agent  # type: ignore[attr-defined]
    try:
        rows = await _episode(wf, {"seed": seed})
    finally:
        await wf.aclose()
        agent.close()
    assert len(gw.script.requests) == 3  # not a digit, wrong, right: then done
    # one conversation, growing turn by turn: the environment's answers are its user turns
    assert len(rows) == 1
    row = rows[0]
    assert len(row.turn_spans) == 3
    # the reward came only with the last step; the discount rule (γ = 1) credits every turn
    assert row.turn_rewards == [1.0, 1.0, 1.0] and row.reward == 1.0
    text = gw.thread.deps.engine.tokenizer.decode(list(gw.script.requests[2].prompt_ids))
    assert "that is not a digit" in text and ("higher" in text or "lower" in text)


async def test_a_lost_episode_scores_0_and_a_running_server_is_used_as_is(
        gw: Gateway, client: SessionClient) -> None:
    from guess_env import GuessAction, GuessEnvironment, GuessObservation

    seed = 8
    gw.script.replies.extend([_wrong(seed)] * 3)
    with oeenv.EnvironmentServer(GuessEnvironment, GuessAction, GuessObservation) as server:
        wf = resolve_workflow(AGENT, {"server_url": server.url}, gateway=client)
        try:
            rows = await _episode(wf, {"seed": seed}, group="lost")
        finally:
            await wf.aclose()
    assert len(gw.script.requests) == 3  # max tries, then the environment ended it
    assert [r.reward for r in rows] == [0.0]
    # the action field came from the server's /schema (`guess`), and the whole observation
    # (less OpenEnv's bookkeeping) was shown as JSON
    first = gw.thread.deps.engine.tokenizer.decode(list(gw.script.requests[0].prompt_ids))
    assert '"tries_left": 3' in first and '"done"' not in first


def test_an_unknown_environment_names_the_close_ones() -> None:
    with pytest.raises(ConfigError, match=r"no 'GuessEnviroment'.*GuessEnvironment"):
        oeenv.OpenEnvAgent(environment="guess_env:GuessEnviroment")
    with pytest.raises(ConfigError, match="cannot import 'no_such_env'"):
        oeenv.OpenEnvAgent(environment="no_such_env:Env")
    with pytest.raises(ConfigError, match="name one of server_url"):
        oeenv.OpenEnvAgent()


def test_a_missing_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "openenv", None)  # import now fails
    monkeypatch.setitem(sys.modules, "openenv.core", None)
    with pytest.raises(ImportError, match=r"pip install 'openenv"):
        oeenv.OpenEnvAgent(server_url="http://127.0.0.1:1")


@pytest.mark.slow
def test_relayrl_train_runs_grpo_on_an_openenv_environment(tmp_path: Path) -> None:
    """The real default model, the real gateway and `relayrl train`: two GRPO steps on the
    OpenEnv environment of examples/openenv/config.yaml, served by relayrl on loopback."""
    dumps = tmp_path / "dumps"
    overrides = [f"fileroot={tmp_path / 'runs'}", "trial_name=ci", "train.total_steps=2",
                 "rollout.group_size=4", "rollout.batch_size=1", f"rollout.dump_root={dumps}",
                 "train.drop_uniform_groups=false"]  # every batch takes a step: 2 exactly
    proc = subprocess.run([sys.executable, "-m", "relayrl.cli", "train",
                           str(EXAMPLE / "config.yaml"), *overrides],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "openenv" / "ci"
    lines = [json.loads(x) for x in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "step_s" in m] == [1, 2]
    rows = [json.loads(x) for f in sorted(dumps.rglob("*.jsonl"))
            for x in f.read_text().splitlines()]
    assert len({r["episode_id"] for r in rows}) == 8  # 2 steps x 4 episodes, each one row
    for row in rows:
        assert row["reward"] in {0.0, 1.0}  # the environment's own delayed reward
        assert "Guess it: reply with one digit" in row["prompt"]
