"""opencode (the real CLI, from scripts/install_clis.sh) as an episode on a Harbor task.

A scripted fake engine plays the model: it answers opencode's first call with a Hermes-style
`<tool_call>` for opencode's `write` tool, which the gateway turns into a tool call; opencode
writes the file and calls again with the tool's result; the engine says it is done. The task's
own test.sh gives the reward. Checked: reward 1, the recorded row is token-exact (the second
call's prompt is the first call's prompt and sampled tokens, then the tool turn), one real
training step on the default model, and every infrastructure failure is an abort.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from relayrl.client.session_client import SessionClient
from relayrl.harness import CLIAgent
from relayrl.harness.clis import OpenCode
from relayrl.trajectory import SessionState
from relayrl.workflow import AgentWorkflow, EpisodeContext, EpisodeStatus, run_episode
from tests.gateway.conftest import ADMIN, Gateway, fake_gateway

ROOT = Path(__file__).resolve().parents[2]
TASK = ROOT / "examples" / "cli_agents" / "tasks" / "hello-file"
CLIS = ROOT / ".clis"


def _installed() -> bool:
    try:
        OpenCode().locate(str(CLIS))
    except Exception:
        return False
    return True


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not _installed(),
                                 reason="opencode is not installed (scripts/install_clis.sh)")]

WRITE = ('<tool_call>{"name": "write", "arguments": {"filePath": "hello.txt", '
         '"content": "hello relayrl\\n"}}</tool_call>')


@pytest.fixture(scope="module")
def gw(model_dir: str) -> Iterator[Gateway]:
    g = fake_gateway(model_dir, context_length=16384)
    yield g
    g.thread.stop()


def _agent(**kw) -> CLIAgent:
    return CLIAgent(cli="opencode", clis_dir=str(CLIS), context_window=16384,
                    max_output_tokens=512, **kw)


async def _episode(gw: Gateway, agent: CLIAgent, task: Path, i: int, timeout_s: float = 240):
    async with SessionClient(gw.url, ADMIN) as client:
        wf = AgentWorkflow(agent, client)
        ctx = EpisodeContext(task_id="hello", episode_id=f"ep-{i}", group_id="grp-hello",
                             sample_index=i)
        try:
            return await run_episode(wf, None, {"task": str(task)}, ctx, timeout_s)
        finally:
            await wf.aclose()


def _open_sessions(gw: Gateway) -> list[str]:
    return [s.id for s in gw.deps.store if s.state == SessionState.OPEN]


async def test_opencode_writes_the_file_over_two_calls_gets_reward_1_and_trains(
        gw: Gateway, model_dir: str) -> None:
    gw.script.requests.clear()
    gw.script.replies[:] = [WRITE, "Done: hello.txt holds the line."]
    good = await _episode(gw, _agent(), TASK, 0)
    assert good.status == EpisodeStatus.FINISHED, good.error
    first, second = gw.script.requests
    (row,) = good.rows.rows
    assert row.reward == 1.0 and len(row.interaction_ids) == 2

    # token-exact: the row is call 1's prompt + its sampled tokens + the tool turn + call 2's
    # sampled tokens, and call 2's prompt is exactly the row up to call 2's first sampled token
    (s0, e0), (s1, e1) = row.turn_spans
    assert row.input_ids[:s0] == list(first.prompt_ids)
    assert row.input_ids[:s1] == list(second.prompt_ids)
    assert list(second.prompt_ids[:e0]) == row.input_ids[:e0]
    assert e1 == len(row.input_ids)
    assert all(row.loss_mask[s0:e0]) and all(row.loss_mask[s1:e1])
    assert not any(row.loss_mask[e0:s1])  # the tool's output is not trained on
    assert len(row.logprobs) == len(row.input_ids)
    assert _open_sessions(gw) == []

    # a second try that does nothing: the verifier gives it 0 (a real 0, not an abort)
    gw.script.requests.clear()
    gw.script.replies[:] = ["I will not do that."]
    bad = await _episode(gw, _agent(), TASK, 1)
    assert bad.status == EpisodeStatus.FINISHED, bad.error
    assert [r.reward for r in bad.rows.rows] == [0.0]

    # one real training step on the group: the rewarded row's sampled tokens gain logprob
    import torch

    from relayrl.train.actor import Actor
    from relayrl.train.advantages import compute_advantages
    from relayrl.train.config import TrainConfig
    from relayrl.train.packing import TrainBatch

    rows = [row, *bad.rows.rows]
    batch = TrainBatch.from_rows(rows, episode_ids=["ep-0", "ep-1"],
                                 group_ids=["grp-hello", "grp-hello"])
    cfg = TrainConfig(micro_batch_tokens=16384, adv_norm="mean", lr=1e-5, freeze_layers=24)
    actor = Actor(model_dir, cfg)
    before = actor.compute_logprobs(batch)
    adv = compute_advantages(batch, cfg)
    metrics = actor.update(adv.batch, adv.adv_B_T)
    assert metrics["n_tokens"] == batch.num_trained_tokens > 0
    after = actor.compute_logprobs(batch)
    mask = batch.loss_mask_B_T.float()
    delta = ((after - before) * mask).sum(-1) / mask.sum(-1)
    assert torch.isfinite(delta).all() and delta[0] > delta[1], delta


async def test_a_verifier_that_cannot_run_aborts_the_episode(gw: Gateway, tmp_path: Path) -> None:
    task = tmp_path / "broken"
    shutil.copytree(TASK, task)
    (task / "tests" / "test.sh").write_text("#!/bin/bash\nexit 2  # writes no reward\n")
    gw.script.replies[:] = ["Nothing to do."]
    out = await _episode(gw, _agent(), task, 2)
    assert out.status == EpisodeStatus.ABORTED and out.rows is None
    assert "wrote no reward" in out.error
    assert _open_sessions(gw) == []


async def test_a_cli_past_its_time_limit_aborts_the_episode(gw: Gateway, tmp_path: Path) -> None:
    out = await _episode(gw, _agent(timeout_s=1.5, tmp_root=str(tmp_path)), TASK, 3)
    assert out.status == EpisodeStatus.ABORTED and out.rows is None
    assert "ran past its 1.5 s" in out.error
    assert _open_sessions(gw) == []
    assert list(tmp_path.iterdir()) == []  # the sandbox is gone
