"""AReaL's custom workflows as users write them (imports mapped to relayrl's), for the real
training runs in test_areal_workflows_train.py; loaded from `relayrl train` by dotted path."""

from __future__ import annotations

import uuid

import torch

from relayrl.workflow import DirectClient as ArealOpenAI
from relayrl.workflow import ModelRequest, RolloutWorkflow


def reward_of(text: str) -> float:
    """Any reward that spreads a group: shorter answers score higher."""
    return 1.0 / (1.0 + len(text.split()))


class MyWorkflow(RolloutWorkflow):
    """AReaL's tensor-dict workflow: tokenise, generate with the engine, build the tensor dict."""

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

    def compute_reward(self, resp, data) -> float:
        return reward_of(self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True))

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


class DirectWorkflow(RolloutWorkflow):
    """AReaL's direct approach (`ArealOpenAI` is relayrl's DirectClient); no tokenizer."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    async def arun_episode(self, engine, data):
        # Create client bound to engine
        client = ArealOpenAI(engine=engine, tokenizer=self.tokenizer)

        # Use like standard OpenAI client
        response = await client.chat.completions.create(
            model="default",
            messages=data["messages"],
            max_tokens=24,
        )

        # Set reward and export
        reward = reward_of(response.choices[0].message.content or "")
        client.set_last_reward(reward)
        client.apply_reward_discount(turn_discount=0.9)

        return client.export_interactions(style="individual")


class FailsAfterFirstGroup(RolloutWorkflow):
    """Its first two episodes finish (rewards 0 and 1), then every one raises: a tool server
    that went down mid-run."""

    episodes = 0

    async def arun_episode(self, engine, data):
        FailsAfterFirstGroup.episodes += 1
        n = FailsAfterFirstGroup.episodes
        if n > 2:
            raise RuntimeError("tool server down")
        resp = await engine.agenerate(ModelRequest(input_ids=[1, 2, 3, 4],
                                                   gconfig={"max_new_tokens": 4}))
        seq = resp.input_tokens + resp.output_tokens
        return {
            "input_ids": torch.tensor([seq], dtype=torch.int32),
            "attention_mask": torch.ones(1, len(seq), dtype=torch.bool),
            "loss_mask": torch.tensor([[0] * resp.input_len + [1] * resp.output_len],
                                      dtype=torch.int32),
            "logprobs": torch.tensor([[0.0] * resp.input_len + resp.output_logprobs],
                                     dtype=torch.float32),
            "versions": torch.tensor([[-1] * resp.input_len + resp.output_versions],
                                     dtype=torch.int32),
            "rewards": torch.tensor([float(n - 1)], dtype=torch.float32),
        }
