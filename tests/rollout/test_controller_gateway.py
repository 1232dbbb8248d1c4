"""The controller driving real agents through a gateway (FakeEngine), and the math example."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from relayrl.client.session_client import SessionClient
from relayrl.engine.fake import FakeEngine
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.rollout import RolloutConfig, RolloutController
from relayrl.trajectory import SessionState
from relayrl.types import GenerateRequest
from relayrl.workflow import resolve_workflow, tokenizer_decoder
from tests.gateway.conftest import ADMIN, Gateway
from tests.gateway.test_openai_chat import call

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "math_agent"
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture
def gw(model_dir: str) -> Iterator[Gateway]:
    """A gateway whose fake model answers "2 + 2" with "4", then "five", then "4", ..."""
    engine = FakeEngine(tokenizer_path=model_dir)
    count = itertools.count()

    def reply(request: GenerateRequest) -> str:
        if "2 + 2" in engine.decode(list(request.prompt_ids)):
            return ["4", "five"][next(count) % 2]
        return "6"

    engine = FakeEngine(reply, tokenizer_path=model_dir)
    config = GatewayConfig(model=model_dir, engine="fake", admin_key=ADMIN,
                           model_label="relayrl-test", batch_size=100_000)
    thread = GatewayThread(build_deps(config, engine=engine)).start()
    yield Gateway(thread.url, thread)
    thread.stop()


def _open(gw: Gateway) -> list[str]:
    return [s.id for s in gw.deps.store if s.state == SessionState.OPEN]


async def test_agents_through_the_gateway_fill_a_batch_and_crashes_are_only_counted(
        gw: Gateway, model_dir: str, tmp_path) -> None:
    data = [{"messages": QUESTION, "answer": "4"},
            {"messages": [{"role": "user", "content": "What is 3 + 3?"}], "answer": "6",
             "crash": True}]
    cfg = RolloutConfig(group_size=2, batch_size=1, max_concurrent_rollouts=4, epochs=1,
                        shuffle=False, progress=False, dump_root=str(tmp_path))
    async with SessionClient(gw.url, ADMIN) as client:
        wf = resolve_workflow("tests.workflow.agents.FlakyAgent", gateway=client,
                              agent_config=cfg.agent_config())
        rc = RolloutController(wf, data, cfg, decode=tokenizer_decoder(model_dir))
        batches = [b async for b in rc]
        stats = rc.stats()
        await rc.aclose()
    assert len(batches) == 1  # the crashing item's group had nothing to train on
    (batch,) = batches
    assert batch.group_sizes == (2,)
    assert sorted(batch.rows.rewards) == [0.0, 1.0]
    assert stats.aborted == 2 and stats.groups_dropped == 1
    assert all("flaky tool failed" in e for e in stats.recent_errors)
    assert not _open(gw)
    dump = tmp_path / "default" / "trial0" / "rollout" / "0" / f"{batch.task_ids[0]}.jsonl"
    lines = [json.loads(x) for x in dump.read_text().splitlines()]
    assert sorted(x["completion"].split("<|im_end|>")[0] for x in lines) == ["4", "five"]
    assert all("What is 2 + 2?" in x["prompt"] for x in lines)


def _math_script(engine: FakeEngine):
    """Tool calls then an answer, decided by how many tool results the prompt holds."""
    def reply(request: GenerateRequest) -> str:
        seen = engine.decode(list(request.prompt_ids)).count("<tool_response>")
        return [call("add", a=3, b=4), call("multiply", a=7, b=5), "The answer is 35."][seen]
    return reply


async def test_the_math_example_runs_grouped_episodes_and_writes_dumps(model_dir, tmp_path):
    sys.path.insert(0, str(EXAMPLE))
    try:
        import run_episodes

        decoder = FakeEngine(tokenizer_path=model_dir)
        engine = FakeEngine(_math_script(decoder), tokenizer_path=model_dir)
        data = tmp_path / "one.jsonl"
        data.write_text((EXAMPLE / "math.jsonl").read_text().splitlines()[0] + "\n")
        args = run_episodes.parse_args(["--groups", "1", "--group-size", "3", "--data",
                                        str(data), "--dump-root", str(tmp_path / "dumps")])
        assert isinstance(args, argparse.Namespace)
        config = GatewayConfig(model=model_dir, engine="fake", admin_key=ADMIN,
                               model_label="math-policy", batch_size=100)
        with GatewayThread(build_deps(config, engine=engine)) as gateway:
            batch = await run_episodes.run_episodes(args, gateway.url, ADMIN, "math-policy",
                                                    tokenizer_decoder(model_dir))
            assert not [s for s in gateway.deps.store if s.state == SessionState.OPEN]
    finally:
        sys.path.remove(str(EXAMPLE))
    assert list(batch.rows.rewards) == [1.0, 1.0, 1.0]
    assert batch.num_rows == 3  # each episode's three calls extend each other: one concat row
    run_episodes.report(batch, str(tmp_path / "dumps"))
    dumps = list((tmp_path / "dumps" / "math_agent" / "example").rglob("*.jsonl"))
    assert len(dumps) == 1 and len(dumps[0].read_text().splitlines()) == 3
