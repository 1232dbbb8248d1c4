"""Claude Code and Qwen Code (the real CLIs) as episodes: one scripted turn each, end to end.

The scripted engine answers every call with a plain sentence, so the CLI stops after its turn and
the task's verifier, finding no file, gives 0: a finished episode with a real reward of 0, not an
abort. Checked: the episode's rows hold exactly the prompts the CLI sent (its own system prompt,
tools and the task's instruction), each call sampled once, and the session is closed. Their
prompts are 16-20k tokens, so the gateway is given a 64k context here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from relayrl.client.session_client import SessionClient
from relayrl.harness import CLIAgent, get_adapter
from relayrl.trajectory import SessionState
from relayrl.workflow import AgentWorkflow, EpisodeContext, EpisodeStatus, run_episode
from tests.gateway.conftest import ADMIN, Gateway, fake_gateway

ROOT = Path(__file__).resolve().parents[2]
TASK = ROOT / "examples" / "cli_agents" / "tasks" / "hello-file"
CLIS = ROOT / ".clis"


def _installed(cli: str) -> bool:
    try:
        get_adapter(cli).locate(str(CLIS))
    except Exception:
        return False
    return True


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gw(model_dir: str) -> Iterator[Gateway]:
    g = fake_gateway(model_dir, context_length=65536)
    yield g
    g.thread.stop()


@pytest.mark.parametrize("cli", ["claude", "qwen"])
async def test_one_turn_is_recorded_and_the_verifier_scores_it(gw: Gateway, cli: str) -> None:
    if not _installed(cli):
        pytest.skip(f"{cli} is not installed (scripts/install_clis.sh)")
    gw.script.requests.clear()
    gw.script.replies[:] = ["I looked at it and I am done."] * 4
    agent = CLIAgent(cli=cli, clis_dir=str(CLIS), timeout_s=120, context_window=65536,
                     max_output_tokens=256)
    async with SessionClient(gw.url, ADMIN) as client:
        wf = AgentWorkflow(agent, client)
        ctx = EpisodeContext(task_id="hello", episode_id=f"ep-{cli}", group_id="g")
        out = await run_episode(wf, None, {"task": str(TASK)}, ctx, 240)
        await wf.aclose()
    assert out.status == EpisodeStatus.FINISHED, out.error
    rows = out.rows.rows
    assert [r.reward for r in rows][-1] == 0.0
    called = sum(len(r.interaction_ids) for r in rows)
    assert called == len(gw.script.requests) >= 1
    prompts = [list(q.prompt_ids) for q in gw.script.requests]
    for r in rows:  # every row starts with a prompt the CLI really sent
        assert r.input_ids[:r.turn_spans[0][0]] in prompts
    main = max(prompts, key=len)
    assert len(main) > 10_000  # the CLI's own system prompt and tools, not a stand-in
    assert not [s.id for s in gw.deps.store if s.state == SessionState.OPEN]


async def test_codex_solves_a_harbor_task_through_its_own_shell_tool(gw: Gateway) -> None:
    """Codex CLI's Responses requests (namespace, custom and hosted tools included) through the
    harness: its `exec_command` writes the file, the task's verifier gives 1, one segment."""
    if not _installed("codex"):
        pytest.skip("codex is not installed (scripts/install_clis.sh)")
    gw.script.requests.clear()
    gw.script.replies[:] = [
        '<tool_call>\n{"name": "exec_command", "arguments": '
        '{"cmd": "printf \'hello relayrl\\\\n\' > hello.txt"}}\n</tool_call>',
        "Created hello.txt."]
    agent = CLIAgent(cli="codex", clis_dir=str(CLIS), timeout_s=120, context_window=65536,
                     max_output_tokens=256)
    async with SessionClient(gw.url, ADMIN) as client:
        wf = AgentWorkflow(agent, client)
        ctx = EpisodeContext(task_id="hello", episode_id="ep-codex", group_id="g")
        out = await run_episode(wf, None, {"task": str(TASK)}, ctx, 240)
        await wf.aclose()
    assert out.status == EpisodeStatus.FINISHED, out.error
    [row] = out.rows.rows  # Codex resends its history: both calls extend one token sequence
    assert row.reward == 1.0
    assert len(row.interaction_ids) == len(gw.script.requests) == 2
