"""relayrl.envs.verifiers with the real verifiers package (v1): an installed environment loaded
by its id, run by verifiers' own rollout code against relayrl's per-episode session URL.

No environment package on PyPI runs offline, so these tests install `tests/envs/vf_packages`'s
`vf-addition`, built with verifiers' own classes (`vf.Taskset`, `vf.Task`, `@vf.reward`). The
rollouts use verifiers' `null` harness (its chat program, prepared by uv) in the subprocess
runtime. verifiers pins openai<3, so these run in a venv of their own (see
docs/environments/verifiers.md); the scripted-engine tests here, the real model in the slow one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from relayrl.errors import ConfigError

PACKAGES = Path(__file__).resolve().parent / "vf_packages"
ROOT = Path(__file__).resolve().parents[2]


vf = pytest.importorskip("verifiers.v1", reason="verifiers is not installed: it pins openai<3, "
                         "so it runs in a venv of its own (docs/environments/verifiers.md)")

from relayrl.client.session_client import SessionClient  # noqa: E402
from relayrl.envs import verifiers as vfenv  # noqa: E402
from relayrl.workflow import EpisodeContext, EpisodeStatus, resolve_workflow, run_episode  # noqa: E402
from tests.gateway.conftest import ADMIN, Gateway, fake_gateway  # noqa: E402

AGENT = "relayrl.envs.verifiers:VerifiersAgent"


@pytest.fixture(autouse=True)
def installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """`vf-addition` importable, as `pip install` would make it."""
    monkeypatch.syspath_prepend(str(PACKAGES))


@pytest.fixture(scope="module")
def gw(model_dir: str) -> Iterator[Gateway]:
    g = fake_gateway(model_dir, batch_size=100_000)
    yield g
    g.thread.stop()


@pytest.fixture
async def client(gw: Gateway) -> AsyncIterator[SessionClient]:
    gw.script.replies.clear()
    async with SessionClient(gw.url, ADMIN) as c:
        yield c


def _ctx(i: int = 0) -> EpisodeContext:
    return EpisodeContext(task_id="t", episode_id=f"ep-{i}", group_id="g", sample_index=i)


def test_an_unknown_environment_id_names_the_close_installed_ones() -> None:
    with pytest.raises(ConfigError, match=r"no verifiers environment 'vf-additon'.*vf_addition"):
        vfenv.make_items("vf-additon")


def test_items_are_the_tasksets_tasks_and_bad_settings_name_the_environment() -> None:
    items = vfenv.make_items("vf-addition", taskset={"num_tasks": 3})
    assert [i["verifiers"]["index"] for i in items] == [0, 1, 2]
    assert items[0]["prompt"].startswith("What is 1 + 3?")
    with pytest.raises(ConfigError, match="verifiers environment 'vf-addition'"):
        vfenv.make_items("vf-addition", taskset={"num_tasks": "many"})


async def test_a_group_runs_through_verifiers_rollout_and_gets_the_rubrics_reward(
        gw, client) -> None:
    item = vfenv.make_items("vf-addition", taskset={"num_tasks": 2})[0]  # 1 + 3
    workflow = resolve_workflow(AGENT, {"env_id": "vf-addition", "taskset": {"num_tasks": 2},
                                        "max_tokens": 16}, group_size=2, gateway=client)
    try:
        gw.script.replies.extend(["The sum is 4", "I think it is 5"])
        out = await run_episode(workflow, None, item, _ctx())
    finally:
        await workflow.aclose()
    assert out.status == EpisodeStatus.FINISHED, out.error
    rows = out.rows.rows
    assert sorted(r.reward for r in rows) == [0.0, 1.0]  # the @vf.reward's verdicts
    # the gateway recorded the harness's call token by token, with the task's prompt
    prompt = gw.thread.deps.engine.tokenizer.decode(gw.script.requests[-1].prompt_ids)
    assert "What is 1 + 3?" in prompt
    assert all(r.loss_mask and any(r.loss_mask) for r in rows)
    assert workflow.counters() == {"episodes": 2, "failed_episodes": 0}


async def test_a_failed_rollout_is_aborted_never_scored_zero(gw, client) -> None:
    item = vfenv.make_items("vf-addition", taskset={"num_tasks": 1})[0]
    agent = vfenv.VerifiersAgent("vf-addition", taskset={"num_tasks": 1}, max_tokens=16)
    # an endpoint that refuses the harness's call: the rollout fails inside verifiers
    workflow = resolve_workflow(agent, gateway=client)
    try:
        out = await run_episode(workflow, None, {**item, "verifiers": {"index": 5}}, _ctx())
        assert out.status == EpisodeStatus.ABORTED and "outside the taskset" in out.error
        ctx = agent.model_context(gw.url + "/no-such-route/v1", "wrong-key")
        env, tasks = await agent._serving()
        episode = await env.run_slot(env.slots(tasks[0], 1)[0], ctx)
        assert not episode.ok
    finally:
        await workflow.aclose()


@pytest.mark.slow
def test_one_grpo_step_on_a_verifiers_environment_with_the_real_model(tmp_path: Path) -> None:
    items = vfenv.make_items("vf-addition", taskset={"num_tasks": 4})
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(i) + "\n" for i in items))
    config = tmp_path / "config.yaml"
    config.write_text(f"""
experiment_name: vf
trial_name: smoke
fileroot: {tmp_path}
workflow: relayrl.envs.verifiers:VerifiersAgent
workflow_kwargs: {{env_id: vf-addition, taskset: {{num_tasks: 4}}, max_tokens: 12}}
data: {{train: {data}, eval: {data}}}
rollout: {{group_size: 2, batch_size: 2, dynamic_sampling: false, progress: false}}
train: {{total_steps: 1, drop_uniform_groups: false, checkpoint_every: 0}}
eval: {{max_items: 2, workflow_kwargs: {{env_id: vf-addition, taskset: {{num_tasks: 4}},
        max_tokens: 12, temperature: 0.0}}}}
""")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(PACKAGES), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "relayrl.cli", "train", str(config)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in
             (tmp_path / "vf" / "smoke" / "logs" / "metrics.jsonl").read_text().splitlines()]
    step = next(m for m in lines if "step_s" in m)
    assert step["workflow/episodes"] >= 4 and step["workflow/failed_episodes"] == 0
    final = next(m for m in lines if "eval_reward_after" in m)
    assert 0 <= final["eval_reward_before"] <= 1 and 0 <= final["eval_reward_after"] <= 1
