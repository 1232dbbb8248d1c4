"""The run's engine reaches every `arun_episode`: an AReaL-style custom workflow (tokenise, generate
with the engine, build the tensor dict) runs through the launcher's rollout path as written.

FakeEngine behind a loopback gateway (what is tested is the wiring and the adapter; the real
model runs the same workflow in test_areal_workflows_train.py)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from relayrl.client import SessionClient
from relayrl.config import RelayConfig
from relayrl.errors import InvalidRequest
from relayrl.launch.local import LocalServices
from relayrl.rollout import RolloutConfig
from relayrl.types import FinishReason, GenerateRequest, SamplingParams
from relayrl.workflow import GenerationHyperparameters, ModelRequest, RolloutWorkflow, RunEngine
from tests.gateway.conftest import ADMIN, Gateway, fake_gateway


class MyWorkflow(RolloutWorkflow):
    """AReaL's custom workflow, as written there (imports mapped to relayrl's)."""

    def __init__(self, tokenizer, gconfig, **kwargs):
        self.tokenizer = tokenizer
        self.gconfig = gconfig

    async def arun_episode(self, engine, data):
        # 1. Prepare input
        input_ids = self.tokenizer.encode(data["prompt"])

        # 2. Generate completion
        req = ModelRequest(
            rid=uuid.uuid4().hex,
            input_ids=input_ids,
            gconfig=self.gconfig,
            tokenizer=self.tokenizer,
        )
        resp = await engine.agenerate(req)

        # 3. Compute reward
        reward = self.compute_reward(resp, data)

        # 4. Return tensor dict (or None to reject)
        if reward < 0:
            return None

        return self.build_tensor_dict(resp, reward)

    # the two helpers the seed leaves to the user, written the usual way
    def compute_reward(self, resp, data) -> float:
        text = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        if data.get("reject"):
            return -1.0
        return float(text.strip() == data["answer"])

    def build_tensor_dict(self, resp, reward) -> dict[str, torch.Tensor]:
        seq = resp.input_tokens + resp.output_tokens
        return {
            "input_ids": torch.tensor([seq], dtype=torch.int32),
            "attention_mask": torch.ones(1, len(seq), dtype=torch.bool),
            "loss_mask": torch.tensor([[0] * resp.input_len + [1] * resp.output_len],
                                      dtype=torch.int32),
            "logprobs": torch.tensor([[0.0] * resp.input_len + resp.output_logprobs],
                                     dtype=torch.float32),
            "rewards": torch.tensor([reward], dtype=torch.float32),
            "versions": torch.tensor([[-1] * resp.input_len + resp.output_versions],
                                     dtype=torch.int32),
        }


@pytest.fixture(scope="module")
def tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture
def gateway(model_dir: str) -> Iterator[Gateway]:
    g = fake_gateway(model_dir, max_staleness=None)
    yield g
    g.thread.stop()


def _services(gateway: Gateway, model_dir: str) -> LocalServices:
    """The local launcher's services around a running fake-engine gateway."""
    client = SessionClient(gateway.url, admin_key=ADMIN)
    return LocalServices(gateway.deps.engine, gateway.thread, client, RelayConfig(), model_dir)


def _rollout(**kw: Any) -> RolloutConfig:
    base = dict(group_size=2, batch_size=2, max_concurrent_rollouts=4, episode_timeout_s=10.0,
                progress=False, shuffle=False, max_consecutive_aborts=4)
    return RolloutConfig(**{**base, **kw})


async def test_the_tensor_dict_workflow_generates_with_the_runs_engine(
        gateway: Gateway, model_dir: str, tokenizer: Any) -> None:
    gateway.script.replies[:] = ["4", "5", "4", "4"]
    await gateway.deps.engine.update_weights({}, version=3)  # the weights the engine serves
    services = _services(gateway, model_dir)
    data = [{"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]
    gconfig = GenerationHyperparameters(max_new_tokens=8, temperature=1.0)
    controller = services.batches(MyWorkflow, {"tokenizer": tokenizer, "gconfig": gconfig}, data,
                                  _rollout(), version_fn=lambda: 3)
    async with controller:
        async with asyncio.timeout(30):  # before: engine=None, every episode aborted
            batch = await controller.next_batch()
    await services.client.aclose()
    assert batch.group_sizes == (2, 2) and batch.stats.aborted == 0
    rows = batch.rows.rows
    prompt = tokenizer.encode("2+2=")
    assert rows[0].input_ids[:len(prompt)] == prompt
    sampled = [t for t, m in zip(rows[0].input_ids, rows[0].loss_mask, strict=True) if m]
    assert tokenizer.decode(sampled, skip_special_tokens=True) == "4"
    # the completion ended at the model's end of turn, and every sampled token has version 3
    assert sampled[-1] == tokenizer.eos_token_id
    assert {v for v, m in zip(rows[0].versions, rows[0].loss_mask, strict=True) if m} == {3}
    assert sorted(batch.rows.rewards) == [0.0, 0.0, 0.0, 1.0]  # "4", "5" | "4", "4" vs 4, 6


async def test_the_engine_handed_to_a_workflow_says_its_version_and_generates_natively(
        gateway: Gateway, model_dir: str) -> None:
    services = _services(gateway, model_dir)
    engine = services.run_engine()
    await gateway.deps.engine.update_weights({}, version=7)
    assert engine.version == engine.get_version() == 7
    assert engine.context_length == gateway.deps.engine.context_length
    gateway.script.replies[:] = ["hi there"]
    out = await engine.generate(GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=16)))
    assert out.finish_reason == FinishReason.STOP and set(out.versions) == {7}
    with pytest.raises(InvalidRequest, match="group_size"):
        await engine.agenerate(ModelRequest(input_ids=[1, 2], gconfig={"n_samples": 2}))
    await services.client.aclose()


def test_gconfig_maps_to_relayrls_sampling_params() -> None:
    g = GenerationHyperparameters.coerce({"max_new_tokens": 12, "greedy": True,
                                          "stop_token_ids": [5], "stop": ["\n"]})
    p = g.to_sampling_params([2])
    assert (p.max_new_tokens, p.temperature, p.top_k, p.stop_token_ids, p.stop) == (
        12, 0.0, 0, (5, 2), ("\n",))
    assert GenerationHyperparameters(top_k=40).to_sampling_params().top_k == 40


def test_a_run_engine_without_a_local_engine_says_what_works_instead() -> None:
    engine = RunEngine(None, SessionClient("http://127.0.0.1:9", admin_key="k"))
    with pytest.raises(Exception, match="DirectClient"):
        asyncio.run(engine.generate(GenerateRequest([1])))
