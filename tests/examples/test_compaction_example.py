"""examples/compaction/compacting_agent.py against a real gateway (HTTP on loopback, the real `openai` client,
the real tokenizer, scripted replies): the summary the agent's model writes carries loss and the
episode's reward, and the summary re-sent in the continuation is prompt only."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from relayrl.trajectory import BranchReason, export_session
from tests.gateway.conftest import Gateway, fake_gateway

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "compaction"))

from compacting_agent import Task, run_episode  # noqa: E402
from openai import OpenAI  # noqa: E402

TASK = Task("blue locker", "walnut", ("I had pasta for lunch.",))


def _episode(gw: Gateway, summary: str, answer: str) -> tuple[str, float]:
    assert gw.script is not None
    gw.script.replies += ["Noted.", "Nice.", summary, answer]
    s = gw.start_session(task_id="locker")
    client = OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    ep = run_episode(client, TASK)
    httpx.post(gw.url + "/rl/v1/finalize", json={"final_reward": ep.reward}, timeout=60,
               headers={"authorization": f"Bearer {s['api_key']}"}).raise_for_status()
    return s["session_id"], ep.reward


@pytest.mark.parametrize(("summary", "answer", "reward"), [
    ("The blue locker password is walnut.", "Walnut", 1.0),
    ("We talked about lunch.", "maple", 0.0),
])
def test_the_summary_carries_loss_and_the_episode_reward(model_dir: str, summary: str,
                                                         answer: str, reward: float) -> None:
    gw = fake_gateway(model_dir)
    try:
        sid, got = _episode(gw, summary, answer)
        assert got == reward
        session = gw.deps.store.get(sid)
        *_, writer, cont = session.interactions
        assert writer.reply.content == summary
        assert cont.branch_reason == BranchReason.COMPACTION and cont.parent_id == writer.id
        assert cont.metadata["link_rule"] == "signal:header"
        rows = export_session(session)
    finally:
        gw.thread.stop()
    main = next(r for r in rows if writer.id in r.interaction_ids)
    start, end = main.turn_spans[main.interaction_ids.index(writer.id)]
    assert end > start and main.loss_mask[start:end] == [1] * (end - start)
    assert main.input_ids[start:end] == list(writer.output_ids)
    assert main.turn_rewards[main.interaction_ids.index(writer.id)] == reward
    after = next(r for r in rows if r.interaction_ids == [cont.id])
    assert after.metadata["branch_reason"] == "compaction" and after.reward == reward
    # the summary text is in the continuation's prompt, which carries no loss
    assert sum(after.loss_mask) == len(cont.output_ids)
    assert after.loss_mask[: len(cont.prompt_ids)] == [0] * len(cont.prompt_ids)
