"""`launcher: ray`: one config trains 2 steps with the gateway and engine in a Ray actor and each
agent's `run` in a Ray worker process, and the same config trains with `launcher: local`."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from relayrl.config import RelayConfig, load_config
from relayrl.errors import ConfigError
from relayrl.launch.run import make_launcher, run_from_config
from tests.train.conftest import tiny_llama_dir  # noqa: F401  (a fixture)

ray = pytest.importorskip("ray")

AGENT = '''
import os
import sys
import uuid
from pathlib import Path

import openai


class PidAgent:
    """One real OpenAI-SDK call; notes the process it ran in and what the gateway answered."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    async def run(self, data, *, base_url, api_key, **_):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        try:
            reply = await client.chat.completions.create(
                model="policy", max_tokens=8, temperature=1.0,
                messages=[{"role": "user", "content": data["q"]}])
        finally:
            await client.close()
        text = reply.choices[0].message.content or ""
        record = {"pid": os.getpid(), "base_url": base_url,
                  "env_base_url": os.environ.get("OPENAI_BASE_URL"),
                  "completion_tokens": reply.usage.completion_tokens,
                  "torch_imported": "torch" in sys.modules}
        Path(self.out_dir, uuid.uuid4().hex + ".json").write_text(__import__("json").dumps(record))
        return float(len(text) % 2)
'''


def _config(tmp_path: Path, model: str) -> Path:
    """A run config and its agent module and dataset, in one folder (as a user writes them)."""
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "pid_agent.py").write_text(AGENT)
    (folder / "train.jsonl").write_text(
        "".join(json.dumps({"q": q}) + "\n" for q in ["Name a color.", "Name a fruit."]))
    (folder / "config.yaml").write_text(textwrap.dedent(f"""\
        experiment_name: ray
        fileroot: {tmp_path / 'runs'}
        model: {model}
        workflow: pid_agent.PidAgent
        data: {{train: {folder / 'train.jsonl'}}}
        rollout: {{group_size: 2, batch_size: 1, max_concurrent_rollouts: 2, progress: false,
                   episode_timeout_s: 120}}
        train: {{total_steps: 2, lr: 1.0e-4, bf16: false, checkpoint_every: 0,
                 save_optimizer: false, drop_uniform_groups: false}}
        """))
    return folder / "config.yaml"


def _records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in out.glob("*.json")]


def _steps(cfg_path: Path, trial: str) -> list[int]:
    cfg = load_config(RelayConfig, cfg_path, [f"trial_name={trial}"])
    lines = (cfg.log_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["step"] for x in lines if '"step_s"' in x]


def test_the_launcher_is_picked_by_config_and_unknown_ones_are_refused(tmp_path: Path) -> None:
    from relayrl.launch.local import LocalLauncher
    from relayrl.launch.ray import RayLauncher

    path = _config(tmp_path, "m")
    assert isinstance(make_launcher(load_config(RelayConfig, path)), LocalLauncher)
    assert isinstance(make_launcher(load_config(RelayConfig, path, ["launcher=ray"])), RayLauncher)
    with pytest.raises(ConfigError, match="launcher"):
        load_config(RelayConfig, path, ["launcher=slurm"])


@pytest.mark.slow
def test_two_steps_with_agents_in_ray_workers_and_the_same_config_locally(
        tmp_path: Path, tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    import relayrl.launch.ray as ray_launch

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = _config(tmp_path, tiny_llama_dir)
    launched: list[ray_launch.RayLauncher] = []

    class SmallRay(ray_launch.RayLauncher):
        """The launcher `launcher: ray` makes, on 2 CPUs with a small object store."""

        def __init__(self, config: RelayConfig) -> None:
            super().__init__(config, num_cpus=2, object_store_memory=200 * 2**20)
            launched.append(self)

    monkeypatch.setattr(ray_launch, "RayLauncher", SmallRay)
    ray_out, local_out = tmp_path / "ray_out", tmp_path / "local_out"
    ray_out.mkdir()
    local_out.mkdir()

    result = run_from_config(path, ["launcher=ray", "trial_name=ray",
                                    f"workflow_kwargs.out_dir={ray_out}"])
    assert result.steps == 2 and _steps(path, "ray") == [1, 2]
    (services,) = [launcher.last_services for launcher in launched]
    assert services is not None
    driver = os.getpid()
    assert services.host_pid != driver  # the gateway and engine ran in the actor's process
    assert services.closed_version == 2  # both steps' weights reached the engine in the actor
    records = _records(ray_out)
    assert len(records) >= 4  # 2 steps x a group of 2, each a real SDK call answered
    assert all(r["completion_tokens"] > 0 for r in records)
    assert all(r["pid"] not in (driver, services.host_pid) for r in records)  # Ray workers
    assert not any(r["torch_imported"] for r in records)  # workers import the agent, not relayrl
    assert {r["base_url"] for r in records} == {r["env_base_url"] for r in records}
    assert all(r["base_url"].startswith(services.gateway_url) for r in records)
    assert not ray.is_initialized()  # the launcher started Ray, and shut it down

    result = run_from_config(path, ["launcher=local", "trial_name=local",
                                    f"workflow_kwargs.out_dir={local_out}"])
    assert result.steps == 2 and _steps(path, "local") == [1, 2]
    records = _records(local_out)
    assert len(records) >= 4 and {r["pid"] for r in records} == {driver}  # inline, here
