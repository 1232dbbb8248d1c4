"""A rollout server whose template differs shows up where training is watched: the controller's
stats, each step's metrics (metrics.jsonl), the step's log line and the run's summary."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.client.session_client import SessionClient
from relayrl.config import RelayConfig
from relayrl.engine.fake import FakeEngine
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.remote_rollout.workflow import RemoteRolloutConfig, RemoteRolloutWorkflow
from relayrl.rollout import RolloutConfig, RolloutController
from relayrl.train.config import TrainConfig
from relayrl.train.trainer import PPOTrainer
from relayrl.types import GenerateRequest
from tests.train.conftest import tiny_llama_dir  # noqa: F401  (a fixture)

from .conftest import (
    ADMIN,
    FakeGateway,
    different_template_dir,
    start_rollout_server,
    tool_call_text,
)

QUESTION = {"messages": [{"role": "user", "content": "What is 15 * 23?"}], "answer": "345"}


def exact_reward(final_messages: list[dict[str, Any]], data: dict[str, Any]) -> float:
    """1.0 when the final assistant message is exactly the answer."""
    return float((final_messages[-1].get("content") or "").strip() == data["answer"])


@pytest.fixture
def mismatching_server(model_dir: str, tmp_path: Path) -> Iterator[str]:
    """The reference server rendering with a template that wraps tool results differently."""
    server, _ = start_rollout_server(default_tokenizer=str(different_template_dir(model_dir,
                                                                                  tmp_path)))
    yield server.url
    server.stop()


async def test_the_controller_reports_mismatches_and_dropped_rollouts(
        gw: FakeGateway, mismatching_server: str) -> None:
    # item 1 calls a tool (its second call's mask disagrees: dropped); item 2 answers at once
    gw.script.replies += [tool_call_text("multiply", a=15, b=23), "345", "345"]
    rollout = RolloutConfig(group_size=1, batch_size=1, max_concurrent_rollouts=1,
                            shuffle=False, epochs=1, progress=False, episode_timeout_s=60)
    async with SessionClient(gw.url, admin_key=ADMIN) as client:
        wf = RemoteRolloutWorkflow(mismatching_server, client, exact_reward,
                                   RemoteRolloutConfig(on_mask_mismatch="drop"))
        async with RolloutController(wf, [QUESTION, QUESTION], rollout) as controller:
            batch = await controller.next_batch()
    assert batch.num_rows == 1 and batch.task_ids == ("1",)  # the dropped item left no rows
    counters = batch.stats.workflow
    assert counters["mask_checks"] == 3 and counters["mask_mismatches"] == 1
    assert counters["dropped_mask_mismatch"] == 1 and counters["kept_mask_mismatch"] == 0
    assert counters["episodes"] == 2 and counters["errors"] == 0


def test_error_rollouts_are_counted_for_the_log(gw: FakeGateway) -> None:
    import asyncio

    server, _ = start_rollout_server(default_tokenizer="/no/such/tokenizer")

    async def go() -> dict[str, float]:
        rollout = RolloutConfig(group_size=1, batch_size=1, shuffle=False, epochs=1,
                                progress=False, episode_timeout_s=60)
        async with SessionClient(gw.url, admin_key=ADMIN) as client:
            wf = RemoteRolloutWorkflow(server.url, client, exact_reward)
            async with RolloutController(wf, [QUESTION], rollout) as controller:
                with pytest.raises(StopAsyncIteration):
                    await controller.next_batch()
                stats = controller.stats()
        assert stats.aborted == 1 and stats.aborted_by_reason == {"EpisodeFailed": 1}
        return stats.workflow

    try:
        counters = asyncio.run(go())
    finally:
        server.stop()
    assert counters["errors"] == 1 and counters["completed"] == 0


@dataclass
class _Sink:
    versions: list[int] = field(default_factory=list)

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self.versions.append(version)


@dataclass
class _RemoteServices:
    """A fake-engine gateway and a rollout server, as a launcher would hand them over."""

    gateway_url: str
    server_url: str
    engine: _Sink = field(default_factory=_Sink)
    clients: list[SessionClient] = field(default_factory=list)

    def batches(self, workflow: Any, workflow_kwargs: dict[str, Any] | None,
                dataset: Sequence[dict[str, Any]], rollout: RolloutConfig,
                version_fn: Callable[[], int]) -> RolloutController:
        client = SessionClient(self.gateway_url, admin_key=ADMIN)
        self.clients.append(client)
        wf = RemoteRolloutWorkflow(self.server_url, client, exact_reward,
                                   RemoteRolloutConfig(on_mask_mismatch="keep"))
        return RolloutController(wf, dataset, rollout, version_fn=version_fn)

    async def aclose(self) -> None:
        for c in self.clients:
            await c.aclose()


@pytest.mark.slow
def test_a_training_step_reports_the_mask_mismatches(
        model_dir: str, tiny_llama_dir: str, mismatching_server: str,  # noqa: F811
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    answers = itertools.cycle(["345", "0"])  # one right and one wrong answer per group

    def script(request: GenerateRequest) -> str:
        # first call: the tool; second call (a tool result in the prompt): an answer
        seen_result = "<tool_response>" in engine.decode(list(request.prompt_ids))
        return next(answers) if seen_result else tool_call_text("multiply", a=15, b=23)

    engine = FakeEngine(script, tokenizer_path=model_dir)
    gcfg = GatewayConfig(model=model_dir, engine="fake", admin_key=ADMIN, max_staleness=None,
                         model_label="relayrl-test")
    with GatewayThread(build_deps(gcfg, engine=engine)) as gateway:
        services = _RemoteServices(gateway.url, mismatching_server)

        async def launcher(actor: Any) -> _RemoteServices:
            return services

        cfg = RelayConfig(
            model=tiny_llama_dir, fileroot=str(tmp_path), experiment_name="remote", trial_name="t",
            train=TrainConfig(total_steps=1, lr=1e-4, bf16=False, checkpoint_every=0,
                              save_optimizer=False),
            rollout=RolloutConfig(group_size=2, batch_size=1, max_concurrent_rollouts=2,
                                  progress=False, episode_timeout_s=60.0))
        result = PPOTrainer(cfg, [QUESTION], launcher=launcher).train("remote")
    assert result.steps == 1
    step = json.loads((cfg.log_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert step["step"] == 1 and step["n_tokens"] > 0
    # both rollouts: two mask checks each (the second disagrees), kept as configured
    assert step["workflow/mask_checks"] == 4 and step["workflow/mask_mismatches"] == 2
    assert step["workflow/kept_mask_mismatch"] == 2 and step["workflow/errors"] == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("step 1/1"))
    assert "mask_mismatches=2" in line and "kept_mask_mismatch=2" in line
    assert result.workflow_counters["mask_mismatches"] == 2
    assert "mask_mismatches=2" in result.summary()
