"""`gateway.replicas: 2` in `relayrl train`: two engine + gateway pairs behind one router, the
agents' episodes spread over both, and every step's weights reach both engines (and so both
gateways' versions). Also: a failed weight push to one replica stops the run loudly."""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

import relayrl.launch.run as launch_run
from relayrl.config import RelayConfig, load_config
from relayrl.engine.fake import FakeEngine
from relayrl.errors import ConfigError, EngineError
from relayrl.launch.local import LocalLauncher, LocalServices
from relayrl.launch.replicas import AllEngines, replica_share
from relayrl.launch.run import run_from_config
from relayrl.service.launcher import ServiceLauncher, service_gateway_config
from relayrl.train.actor import Actor
from tests.train.conftest import tiny_llama_dir  # noqa: F401  (a fixture)

AGENT = '''
import json
import uuid
from pathlib import Path

import openai


class UrlAgent:
    """One real OpenAI-SDK call through the session URL it was given; notes that URL."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    async def run(self, data, *, base_url, api_key, **_):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        try:
            reply = await client.chat.completions.create(
                model="policy", max_tokens=6, temperature=1.0,
                messages=[{"role": "user", "content": data["q"]}])
        finally:
            await client.close()
        text = reply.choices[0].message.content or ""
        record = {"base_url": base_url, "completion_tokens": reply.usage.completion_tokens}
        Path(self.out_dir, uuid.uuid4().hex + ".json").write_text(json.dumps(record))
        return float(len(text) % 2)
'''


def _config(tmp_path: Path, model: str) -> Path:
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "url_agent.py").write_text(AGENT)
    (folder / "train.jsonl").write_text(
        "".join(json.dumps({"q": q}) + "\n" for q in ["Name a color.", "Name a fruit."]))
    (folder / "config.yaml").write_text(textwrap.dedent(f"""\
        experiment_name: replicas
        trial_name: t
        fileroot: {tmp_path / 'runs'}
        model: {model}
        workflow: url_agent.UrlAgent
        data: {{train: {folder / 'train.jsonl'}}}
        gateway: {{replicas: 2}}
        engine: {{kind: local, num_threads: 1}}
        rollout: {{group_size: 2, batch_size: 2, max_concurrent_rollouts: 4, progress: false,
                   episode_timeout_s: 120}}
        train: {{total_steps: 2, lr: 1.0e-4, bf16: false, checkpoint_every: 0,
                 save_optimizer: false, drop_uniform_groups: false}}
        """))
    return folder / "config.yaml"


def test_replicas_with_a_remote_engine_are_refused_with_the_reason() -> None:
    cfg = load_config(RelayConfig, None, ["gateway.replicas=2", "engine.kind=vllm",
                                          "engine.url=http://127.0.0.1:9"])
    for launcher in (LocalLauncher, ServiceLauncher):
        with pytest.raises(ConfigError, match="one engine per replica"):
            launcher(cfg)
    # `launcher: ray` serves from one gateway, and says so
    from relayrl.launch.local import serving_gateway_config

    with pytest.raises(ConfigError, match="launcher: ray"):
        serving_gateway_config(load_config(RelayConfig, None, ["gateway.replicas=2"]), "m")


def test_a_staleness_budget_is_split_over_the_replicas() -> None:
    one = load_config(RelayConfig, None, ["rollout.batch_size=3", "rollout.group_size=2"])
    four = load_config(RelayConfig, None, ["rollout.batch_size=3", "rollout.group_size=2",
                                            "gateway.replicas=4"])
    assert service_gateway_config(one).batch_size == 6
    assert service_gateway_config(four).batch_size == 2  # ceil(6 / 4): about one budget in all
    assert [replica_share(8, 2), replica_share(7, 2), replica_share(1, 3)] == [4, 4, 1]


def test_a_weight_push_fails_loudly_when_one_replica_fails() -> None:
    async def run() -> None:
        good, bad = FakeEngine(vocab_size=64), FakeEngine(vocab_size=64)
        sink = AllEngines([good, bad])
        assert await sink.update_weights({}, version=1) == 1
        await bad.aclose()  # the second replica's engine is gone
        with pytest.raises(EngineError, match=r"version 2 failed on 1 of 2 replicas \(r1: ") as e:
            await sink.update_weights({}, version=2)
        assert "r0: v2, r1: v1" in str(e.value)  # what each replica serves now, stated
        assert good.version == 2 and sink.version == 1
        await sink.aclose()

    asyncio.run(run())


@pytest.mark.slow
def test_two_steps_with_two_replicas_train_on_both_and_update_both(
        tmp_path: Path, tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    seen: dict[str, Any] = {}

    class Watching(LocalLauncher):
        """The local launcher, noting what each replica did just before the run stops it."""

        async def __call__(self, actor: Actor) -> LocalServices:
            services = await super().__call__(actor)
            close = services.aclose

            async def aclose() -> None:
                assert services.replicas is not None and isinstance(services.engine, AllEngines)
                seen["router"] = services.replicas.url
                seen["client"] = services.client.gateway_url
                seen["engines"] = [e.version for e in services.engine.engines]
                seen["gateways"] = [g.deps.policy_version for g in services.replicas.gateways]
                seen["exported"] = [g.deps.store.stats()["exported_total"]
                                    for g in services.replicas.gateways]
                await close()

            services.aclose = aclose  # type: ignore[method-assign]
            return services

    monkeypatch.setattr(launch_run, "LocalLauncher", Watching)
    out = tmp_path / "out"
    out.mkdir()
    path = _config(tmp_path, tiny_llama_dir)
    result = run_from_config(path, [f"workflow_kwargs.out_dir={out}"])

    assert result.steps == 2
    cfg = load_config(RelayConfig, path)
    steps = [json.loads(x) for x in (cfg.log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if "step_s" in m] == [1, 2]
    assert seen["client"] == seen["router"]  # the agents' sessions go through the router
    records = [json.loads(p.read_text()) for p in out.glob("*.json")]
    assert len(records) >= 8 and all(r["completion_tokens"] > 0 for r in records)
    assert all(r["base_url"].startswith(seen["router"] + "/s/") for r in records)
    assert all(n > 0 for n in seen["exported"]) and len(seen["exported"]) == 2  # both trained on
    assert seen["engines"] == [2, 2]  # each step's weights reached both engines
    assert seen["gateways"] == [2, 2]  # and both gateways stamp tokens with the new version
